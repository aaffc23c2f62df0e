#!/usr/bin/env bash
# Set up (first run: scripts/setup-sglang-jax.sh) and run the tests against sglang-jax's own
# code on JAX CPU: its verify entry points with the integration (tests/real_sglang_jax), the
# library's llguidance engine on sglang-jax's llguidance, the switch, and engine runs. Extra
# arguments go to pytest. The library is imported as installed (-P: not from the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-sglang-jax.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 JAX_PLATFORMS=cpu
echo "sglang-jax's tests on JAX CPU: the verify, grammar and switch tests first (each compiles" >&2
echo "sglang-jax's functions: tens of seconds before a dot), then the engine runs (sglang-jax's" >&2
echo "whole engine, spawned: several minutes each before their dots)" >&2
exec .venv-sglang-jax/bin/python -P -m pytest -q -p no:cacheprovider --confcutdir=tests/real_sglang_jax tests/real_sglang_jax "$@"
