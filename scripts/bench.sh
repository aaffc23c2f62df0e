#!/usr/bin/env bash
# Set up (first run only) and run the benchmark (tools/bench/, docs/benchmarks.md); tables go
# to stdout.
# Extra arguments go to it (`scripts/bench.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m tools bench "$@"
