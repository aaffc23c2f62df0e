"""The sglang tests run sglang 0.5.23's own speculative and grammar code on CPU, in their own
environment (scripts/test-sglang.sh builds .venv-sglang); elsewhere every module skips.

sglang's engine needs CUDA, but the code these tests call runs on CPU tensors (on a GPU host
the tests of the masks and fills run on CUDA instead, see ``DEVICE``):

* Triton's interpreter runs sglang's Triton kernels (``TRITON_INTERPRET=1``); sglang uses
  them on XPU, so the kernel modules the verify path calls are told they are on one
  (``_is_xpu = True`` in ``sglang.kernels.ops.speculative.{spec_tree, cache_locs, eagle,
  reconstruct_tree}``);
* ``TORCHDYNAMO_DISABLE=1``: sglang compiles a few helpers with ``torch.compile``;
* two import stubs (stubs/README.md): ``torchvision`` (transformers is first told it is
  absent) and ``sgl_kernel.speculative``;
* sglang's server arguments are published by its own test hook,
  ``get_context().override_server_args(...).install()``.

Rows and tokens compared with sglang's own are counted and printed at the end of the run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
#: where the masks go: "cpu" (sglang's code on CPU, as above), or "cuda" on a GPU host where
#: sglang's CUDA build imports (scripts/device-check.sh): no interpreter, no stubs, and the
#: tests that drive sglang's verify step on CPU skip. PORTABLE_SPEC_SGLANG_DEVICE overrides.
DEVICE = "cpu"

if HAVE_SGLANG:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.path.insert(0, HERE)
    import torch

    DEVICE = os.environ.get("PORTABLE_SPEC_SGLANG_DEVICE") or (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    if DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()  # cached: absent, before the stub is visible
        sys.path.insert(0, os.path.join(HERE, "stubs"))
        for _name in ("spec_tree", "cache_locs", "eagle", "reconstruct_tree"):
            importlib.import_module(f"sglang.kernels.ops.speculative.{_name}")._is_xpu = True
else:
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    # sglang's and xgrammar's import-time notices about CUDA-only features
    for line in ("ignore::DeprecationWarning", "ignore::UserWarning"):
        config.addinivalue_line("filterwarnings", line)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    shared = sys.modules.get("_sgl")
    counts = getattr(shared, "COUNTS", None)
    if counts:
        terminalreporter.write_line(
            "sglang 0.5.23 against the plugin: "
            + ", ".join(f"{value} {name}" for name, value in counts.items())
        )
