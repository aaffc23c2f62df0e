#!/usr/bin/env bash
# Set up (first run: scripts/setup-sglang.sh) and run the tests against sglang 0.5.23's own
# code on CPU (tests/real_sglang): the speculative masks against sglang's own build, its EAGLE
# verify and NGRAM worker with the plugin on and off, the chain path, the plain batch fill,
# and the plugin loaded by sglang's own plugin loader. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-sglang.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_INTERPRET=1 TORCHDYNAMO_DISABLE=1
exec .venv-sglang/bin/python -m pytest -q -p no:cacheprovider --confcutdir=tests/real_sglang tests/real_sglang "$@"
