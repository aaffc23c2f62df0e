#!/usr/bin/env bash
# Set up (first run only) and run the test suite; extra arguments go to pytest
# (e.g. --backend=jax, -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
