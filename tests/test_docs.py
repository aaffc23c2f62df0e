"""The porting guide and the README cannot drift: their code runs, their quoted lines exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


# JAX warns when a jit donates a buffer it cannot write into (an argmax sampler never
# materialises the masked logits): advice that donates for nothing must not ship.
UNUSABLE_DONATION = "Some donated buffers were not usable"


@pytest.mark.parametrize("doc", ["docs/porting.md", "README.md"])
def test_code_blocks_run(doc, tmp_path):
    """All python blocks of a document run in order, in one fresh interpreter, without JAX's
    unusable-donation warning."""
    blocks = python_blocks(ROOT / doc)
    if not blocks:
        pytest.skip(f"{doc} has no python blocks")
    script = tmp_path / "doc_blocks.py"
    script.write_text("\n\n".join(blocks))
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"
    )
    done = subprocess.run(
        [sys.executable, "-W", f"error:{UNUSABLE_DONATION}", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, f"{doc}: {done.stderr[-3000:]}"
    assert UNUSABLE_DONATION not in done.stderr, f"{doc}: {done.stderr[-3000:]}"


def test_pitfall_lines_exist():
    """Every row of the pitfalls table names a file and a line that is in it."""
    text = (ROOT / "docs/porting.md").read_text()
    section = text[text.index("## 7. Pitfalls") :]
    rows = re.findall(r"^\|[^|]+\| `([^`]+)` \| `(.+)` \|$", section, re.MULTILINE)
    assert len(rows) >= 12
    for path, line in rows:
        content = (ROOT / path).read_text()
        assert line in content, f"{path} no longer contains: {line}"


def test_links_between_docs_resolve():
    for doc in ["README.md", "docs/porting.md", "docs/design.md"]:
        path = ROOT / doc
        if not path.exists():
            continue
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|png))\)", path.read_text()):
            assert (path.parent / target).exists(), f"{doc} links to missing {target}"
