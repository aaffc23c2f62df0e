#!/usr/bin/env bash
# Set up (first run only: scripts/setup-tpu-inference.sh, on top of .venv-vllm) and run the
# tpu-inference integration's tests: tpu-inference 0.32.0's own runner code on JAX CPU, with
# vLLM 0.32's own grammar rows. Extra arguments go to pytest.
# PORTABLE_SPEC_TPU_INFERENCE_TEST=off runs them on tpu-inference's own structured decoding
# (the integration not installed), where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-tpu-inference.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 JAX_PLATFORMS=cpu
exec .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/real_tpu_inference "$@"
