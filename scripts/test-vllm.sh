#!/usr/bin/env bash
# Set up (first run only: scripts/setup-vllm.sh) and run the real-vLLM tests: the replay of
# vLLM's own grammar_bitmask, the end-to-end LLM.generate runs (one engine start per
# structured-output backend) and vLLM's OpenAI server under load with the plugin on and off
# (tests/real_vllm/test_server_load.py: two `vllm serve` starts). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-vllm.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# vLLM's CPU engine binds its threads; keep the KV cache small on small machines.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# tests/test_builder_oracle.py: the library against its oracle on vLLM's xgrammar (the floor).
exec .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/real_vllm tests/test_builder_oracle.py "$@"
