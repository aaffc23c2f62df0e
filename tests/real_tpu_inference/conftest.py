"""Fixtures of the tpu-inference tests (run by scripts/test-tpu-inference.sh in .venv-vllm).

``PORTABLE_SPEC_TPU_INFERENCE_TEST=off`` runs the same tests on tpu-inference's own
structured decoding (the integration not installed): they must fail, showing its rows.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import tpu_env  # noqa: E402

OFF = os.environ.get("PORTABLE_SPEC_TPU_INFERENCE_TEST", "on").lower() in ("0", "off")


@pytest.fixture(scope="session")
def tpu():
    """tpu-inference's runner module, loaded on JAX CPU (see tpu_env)."""
    reason = tpu_env.available()
    if reason:
        pytest.skip(reason)
    return tpu_env.load()


@pytest.fixture(scope="session")
def grammars(tpu):
    import steps

    if not os.path.exists(os.path.join(steps.MODEL, "tokenizer.json")):
        pytest.skip(f"no model directory at {steps.MODEL}: run scripts/setup-vllm.sh")
    return steps.grammars()


@pytest.fixture
def integration(tpu):
    """The integration installed for the test (or not, with the switch off), and removed after."""
    from portable_spec.integrations import tpu_inference

    tpu_inference.reset_stats()
    if OFF:
        tpu_inference.uninstall()
    else:
        assert tpu_inference.install()
    yield tpu_inference
    tpu_inference.uninstall()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = sys.modules.get("test_rows")
    if rows is not None and rows.TALLY["steps"]:
        terminalreporter.write_sep("-", "tpu-inference steps checked")
        terminalreporter.write_line(", ".join(f"{k}: {v}" for k, v in rows.TALLY.items()))
