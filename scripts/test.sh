#!/usr/bin/env bash
# Set up (first run only) and run the test suite; extra arguments go to pytest (e.g.
# --backend=jax). The slow tests (marked `slow`: the device check end to end, the porting
# guide's examples, a benchmark run) are left out by default: `-m slow` runs only them,
# `-m "slow or not slow"` everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
