#!/usr/bin/env bash
# Set up (first run only) and run the soak run (tools/soak.py, docs/reliability.md): memory
# stays flat.
# Extra arguments go to it (`scripts/soak.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m tools soak "$@"
