"""docs/vllm.md's python blocks run, each alone in a fresh interpreter (blocks that start an
engine say so on their first line and are only checked to compile)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")  # run in scripts/test-vllm.sh's .venv-vllm

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "vllm.md").read_text(), re.DOTALL)
NOT_RUN = "# needs: vllm"  # starts an engine: test_engine.py covers that, here compiled only


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index, tmp_path):
    block = BLOCKS[index]
    if block.startswith(NOT_RUN):
        compile(block, f"docs/vllm.md block {index}", "exec")
        return
    script = tmp_path / "block.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_there_are_blocks():
    assert len(BLOCKS) >= 2 and any(not b.startswith(NOT_RUN) for b in BLOCKS)
