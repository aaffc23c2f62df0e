#!/usr/bin/env bash
# The GPU check in one command (docs/porting/hardware.md):
#
#   scripts/device-check.sh [--cpu] [--install] [--out DIR] [driver options...]
#
# On a GPU machine (Python >= 3.11 with CUDA builds of torch and jax, numpy, pytest,
# hypothesis): installs the wheels in .device/ if there are any (scripts/fetch-device-wheels.sh,
# for a machine without network) and the project into a private folder on PYTHONPATH, never
# over the machine's packages, then runs every part (python -m tools.devicecheck) and
# writes device-check.json, device-check.md and device-check.log into --out.
#   --cpu      the same on a machine without a GPU, with the project's .venv (GPU parts are
#              reported as skipped); what CI runs
#   --install  rehearse the private install under --cpu too (always done on the GPU machine)
# Other options go to the driver: --limit PART=SECONDS, --total SECONDS, --parts a,b.
# Time limits only catch hangs (45 minutes in all; see tools/devicecheck/limits.py).
# Exit status: 0 passed; 1 a correctness part or a check failed; 2 another part failed.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=gpu
install=
out=out/device-check
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) mode=cpu ;;
    --install) install=1 ;;
    --out) out=$2; shift ;;
    --out=*) out=${1#--out=} ;;
    -h | --help) sed -n 2,16p "$0"; exit 0 ;;
    *) extra+=("$1") ;;
  esac
  shift
done

if [ "$mode" = cpu ]; then
  if [ -z "${PYTHON:-}" ]; then
    bash scripts/setup.sh || exit 1  # the project's .venv (once; then only a check)
  fi
  py=${PYTHON:-.venv/bin/python}
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
else
  py=${PYTHON:-python3}
  install=1
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}  # the GPU, and CPU devices beside it
  export XLA_PYTHON_CLIENT_PREALLOCATE=false      # JAX and torch share the GPU
  export TVM_FFI_DISABLE_TORCH_C_DLPACK=1         # no JIT build of an optional addon
  export TORCH_EXTENSIONS_DIR=/tmp/portable-spec-torch-extensions  # kept for a rerun
  if [ -f .device/smollm2-vocab.json.gz ]; then
    export PORTABLE_SPEC_VOCAB=$PWD/.device/smollm2-vocab.json.gz
  fi
  if ! ls .device/wheels/*.whl >/dev/null 2>&1 && ! "$py" -c 'import xgrammar' 2>/dev/null; then
    echo "device-check: xgrammar is missing: pip install xgrammar==0.2.9, or (no network) run" \
      "scripts/fetch-device-wheels.sh where PyPI is reachable and copy .device here" >&2
  fi
fi
export PYTHONUNBUFFERED=1
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "device-check: needs Python >= 3.11 (python -P), got $("$py" --version 2>&1)" >&2
  exit 1
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
: >"$out/device-check.log"
work=$(mktemp -d "${TMPDIR:-/tmp}/portable-spec-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
status=()
if [ -n "$install" ]; then
  site=$work/site
  timeout 1800 "$py" tools/devicecheck/prepare.py --root . --site "$site" \
    --wheels .device/wheels --status "$work/prepare.json" 2>&1 | tee -a "$out/device-check.log"
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  export PORTABLE_SPEC_CHECK_SITE=$site
  status=(--prepare-status "$work/prepare.json")
fi

cpu=()
[ "$mode" = cpu ] && cpu=(--cpu)
# -P: the checkout is not on the path, so the library comes from where it is installed; the
# tools (not installed) are found at the end of PYTHONPATH.
PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD "$py" -P -m tools.devicecheck run ${cpu[@]+"${cpu[@]}"} --out "$out" --work "$work" \
  --root "$PWD" ${status[@]+"${status[@]}"} ${extra[@]+"${extra[@]}"}
rc=$?
if [ ! -s "$out/device-check.json" ]; then  # the driver could not even start
  printf '{"schema": 1, "mode": "%s", "exit_code": 1, "parts": {}, "error": "driver exited with %s before writing results; see device-check.log"}\n' \
    "$mode" "$rc" >"$out/device-check.json"
  printf '# portable_spec device check\n\n**NOT PASSED**: the driver exited with %s before writing results; see device-check.log.\n' \
    "$rc" >"$out/device-check.md"
  exit 1
fi
exit "$rc"
