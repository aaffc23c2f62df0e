#!/usr/bin/env bash
# Set up (first run only) and run a quick look at the builder (tools/masks.py): masks for a
# sample batch.
# Extra arguments go to it (`scripts/masks.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m tools masks "$@"
