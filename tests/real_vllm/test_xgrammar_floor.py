"""The library's xgrammar floor is the xgrammar vLLM pins, and this environment runs it.

scripts/test-vllm.sh runs the library's oracle test (tests/test_builder_oracle.py: every row
against a per-node replay on fresh matchers) in this environment too, so the floor's rows are
checked, not assumed; the shadow and replay tests check them against vLLM's own fill.
"""

import re
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("vllm")  # this environment: scripts/test-vllm.sh's .venv-vllm

ROOT = Path(__file__).resolve().parents[2]


def test_this_environment_runs_the_xgrammar_floor():
    floor = re.search(r'"xgrammar>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert version("xgrammar") == floor
