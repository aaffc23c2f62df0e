"""docs/vllm.md's python blocks run, each alone in a fresh interpreter, as a reader runs them.

The block that starts an engine (first line ``# needs: vllm``) runs as written from the
checkout's root (``.vllm-model`` is scripts/setup-vllm.sh's): it must say that the plugin is
on in vLLM's log and show rows built by the library, none differing from vLLM's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")  # run in scripts/test-vllm.sh's .venv-vllm

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "vllm.md").read_text(), re.DOTALL)
ENGINE = "# needs: vllm"  # starts an engine
ACTIVE = "portable_spec: grammar_bitmask built by portable_spec (shadow, packed rows"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index, tmp_path):
    block = BLOCKS[index]
    script = tmp_path / "block.py"
    script.write_text(block)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # as written
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if block.startswith(ENGINE):
        assert ACTIVE in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
        assert "'portable_spec': {" in done.stdout and "'vllm': {" in done.stdout, done.stdout


def test_there_are_blocks():
    assert len(BLOCKS) >= 2 and any(b.startswith(ENGINE) for b in BLOCKS)
