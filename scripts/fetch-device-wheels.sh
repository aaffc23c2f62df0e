#!/usr/bin/env bash
# For a GPU machine without network (docs/porting/hardware.md): run this where PyPI is reachable, then copy
# the checkout with .device/ to the GPU machine and run scripts/device-check.sh there. Fills
# the git-ignored .device/ with what a GPU machine that has Python with torch, jax, numpy,
# pytest and hypothesis lacks:
#   .device/wheels/                 manylinux x86_64 wheels for Python $DEVICE_PYTHON (3.12 by
#                                   default): xgrammar and what it needs beyond torch
#   .device/smollm2-vocab.json.gz   SmolLM2's tokenizer vocabulary (small; the GGUF is 90 MB)
set -euo pipefail
cd "$(dirname "$0")/.."

# xgrammar's requirements beyond the image (scripts/device-check.sh installs them with
# --no-deps; the check below fails if one is missing). typing-extensions is installed there
# only if the image's copy is older.
WHEELS=(
  xgrammar==0.2.9
  apache-tvm-ffi==0.1.15.post2
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux1_x86_64)

bash scripts/setup.sh  # the .venv: reads the GGUF, checks the wheels
py=.venv/bin/python
rm -rf .device/wheels
mkdir -p .device/wheels
"$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "${DEVICE_PYTHON:-3.12}" --implementation cp "${PLATFORMS[@]/#/--platform=}" \
  -d .device/wheels "${WHEELS[@]}"
"$py" -m tools.devicecheck check-wheels .device/wheels
"$py" -m tools.devicecheck export-vocab .device/smollm2-vocab.json.gz

bytes=$(du -sb .device | cut -f1)
ls -l .device .device/wheels
echo "fetch-device-wheels: .device holds $((bytes / 1024)) KiB; copy it with the checkout"
