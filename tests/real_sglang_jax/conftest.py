"""The sglang-jax tests run in their own environment (scripts/test-sglang-jax.sh builds
.venv-sglang-jax); elsewhere every module skips. Rows and tokens checked against the
reference are counted and printed at the end of the run."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


#: the modules that launch sglang-jax's whole engine (minutes each): run after the others, so
#: that the first results come within a minute or two
ENGINE_MODULES = ("test_eagle_loop.py", "test_engine.py")


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    items.sort(key=lambda item: item.path.name in ENGINE_MODULES)  # (a stable sort)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    shared = sys.modules.get("_sgl")
    checked = getattr(shared, "CHECKED", None)
    if checked and checked["requests"]:
        terminalreporter.write_line(
            "sglang-jax verify against the reference: "
            f"{checked['requests']} request-steps, {checked['rows']} tree nodes, "
            f"{checked['tokens']} committed tokens checked"
        )


@pytest.fixture(scope="session")
def spawned(tmp_path_factory):
    """sglang-jax's engine launched with ``PORTABLE_SPEC_SGLANG_JAX=1`` (its scheduler in the
    process it spawns), non-speculative: the reference of the speculative runs, which run
    without the overlap schedule, as it does (sglang-jax's EAGLE on CPU)."""
    pytest.importorskip("sgl_jax")
    from _engine import MAX_NEW_TOKENS, launch

    report, log, code = launch(
        tmp_path_factory.mktemp("spawned"),
        {"max_new_tokens": MAX_NEW_TOKENS, "engine": {"disable_overlap_schedule": True}},
        {"PORTABLE_SPEC_SGLANG_JAX": "1"},
    )
    if report is None:
        pytest.fail(f"engine run failed ({code}):\n{log[-6000:]}")
    return report, log
