#!/usr/bin/env bash
# Set up (first run only) and run the end-to-end demo (examples/demo/); extra arguments go to
# it (`scripts/demo.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m examples.demo "$@"
