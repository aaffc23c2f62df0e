#!/usr/bin/env bash
# The compiled helper's own checks (CI runs them; about 10 minutes on 2 busy cores):
#   1. a strict build: -Wall -Wextra -Werror, with numpy's headers and without;
#   2. the index kernels' C tests (tests/native/), under AddressSanitizer and UBSan;
#   3. the helper built with AddressSanitizer and UndefinedBehaviorSanitizer into a copy of
#      the package, and the tests of the compiled entries and of threads changing what a
#      build reads run against it, and the draft sessions' level-by-level walks (any report
#      fails the run); of the llguidance vocabulary
#      tests, the randomized compiled-against-fallback one and the 130 padded chains (the
#      route matrix runs in scripts/test.sh only: the C it reaches is the same).
# Extra arguments go to pytest in step 3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
CC=${CC:-gcc}
include=$($py -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
numpy=$($py -c 'import numpy; print(numpy.get_include())')
suffix=$($py -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source=portable_spec/csrc/module.c
sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)

echo "== strict build (-Wall -Wextra -Werror)"
"$CC" -shared -fPIC -O2 -Wall -Wextra -Werror -DPS_NUMPY=1 -I"$include" -I"$numpy" \
  "$source" -o "$work/with-numpy.so"
"$CC" -shared -fPIC -O2 -Wall -Wextra -Werror -I"$include" "$source" -o "$work/buffers-only.so"

echo "== kernels (ASan + UBSan)"
"$CC" -O1 -g -Wall -Wextra -Werror "${sanitize[@]}" -Iportable_spec/csrc \
  tests/native/kernels_test.c portable_spec/csrc/kernels.c -o "$work/kernels_test"
"$work/kernels_test"

echo "== the helper under ASan + UBSan"
# a copy of the checkout's package (backends/ in its installed place) and tests, run from there
tree="$work/tree"
mkdir -p "$tree"
cp -r portable_spec tests pyproject.toml "$tree/"
cp -r backends "$tree/portable_spec/backends"
rm -f "$tree/portable_spec/"_native*.so
"$CC" -shared -fPIC -O1 -g "${sanitize[@]}" -DPS_NUMPY=1 -I"$include" -I"$numpy" "$source" \
  -o "$tree/portable_spec/_native$suffix"
# The interpreter is not instrumented: the runtime is preloaded, Python's allocator handed to
# malloc so that ASan sees every object, leaks (the interpreter's own, at exit) not reported.
export LD_PRELOAD
LD_PRELOAD="$("$CC" -print-file-name=libasan.so):$("$CC" -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONMALLOC=malloc PYTHONPATH="$tree" PORTABLE_SPEC_EXPECT_NATIVE=1
python="$PWD/$py"
cd "$tree"
"$python" -m pytest -q -p no:cacheprovider \
  tests/test_native.py tests/test_threads.py tests/test_xgrammar_ffi.py tests/test_small_trees.py \
  tests/test_chain_lists.py tests/test_vllm_fast.py tests/test_vllm_guidance.py \
  tests/test_llguidance_paths.py tests/test_native_bounds.py tests/test_forced_drafts.py \
  tests/test_drafting.py tests/test_sglang_drafted_tree.py \
  tests/test_llguidance_vocabulary.py::test_compiled_equals_fallback_with_drafts_past_the_vocabulary \
  tests/test_llguidance_vocabulary.py::test_many_chains_with_padding_drafts_leave_every_matcher_usable \
  "$@"
