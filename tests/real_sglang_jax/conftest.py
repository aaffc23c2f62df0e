"""The sglang-jax tests run in their own environment (scripts/test-sglang-jax.sh builds
.venv-sglang-jax); elsewhere every module skips. Rows and tokens checked against the
reference are counted and printed at the end of the run."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    shared = sys.modules.get("_sgl")
    checked = getattr(shared, "CHECKED", None)
    if checked and checked["requests"]:
        terminalreporter.write_line(
            "sglang-jax verify against the reference: "
            f"{checked['requests']} request-steps, {checked['rows']} tree nodes, "
            f"{checked['tokens']} committed tokens checked"
        )
