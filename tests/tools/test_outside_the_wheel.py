"""The tools and the demo stay outside the installed package and run from a checkout."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("tools", "examples")


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_library_never_imports_the_tools_or_the_demo():
    sources = [*(ROOT / "portable_spec").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]
    assert len(sources) > 20
    wrong = {str(p.relative_to(ROOT)): sorted(_imported_roots(p) & set(OUTSIDE)) for p in sources}
    assert not {p: r for p, r in wrong.items() if r}


def test_the_wheel_lists_the_library_only():
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)
    packages = config["tool"]["setuptools"]["packages"]
    assert all(p == "portable_spec" or p.startswith("portable_spec.") for p in packages), packages
    dirs = config["tool"]["setuptools"].get("package-dir", {})
    for package in packages:  # each listed package is where setuptools will look for it
        parent = next((d for name, d in dirs.items() if package.startswith(name)), None)
        if parent is None:
            folder = ROOT / package.replace(".", "/")
        else:
            name = next(name for name in dirs if package.startswith(name))
            folder = ROOT / parent / package[len(name) :].lstrip(".").replace(".", "/")
        assert (folder / "__init__.py").exists(), package
    # every folder of the library with Python code is listed: nothing of it is left out
    for init in (ROOT / "portable_spec").rglob("__init__.py"):
        name = ".".join(init.parent.relative_to(ROOT).parts)
        assert name in packages, name
    assert "scripts" not in config["project"] or not config["project"].get("scripts")


@pytest.mark.parametrize(
    "script,usage",
    [
        ("demo.sh", "usage: scripts/demo.sh"),
        ("bench.sh", "usage: scripts/bench.sh"),
        ("masks.sh", "usage: scripts/masks.sh"),
        ("soak.sh", "usage: scripts/soak.sh"),
    ],
)
def test_each_script_runs_its_tool_from_the_checkout(script, usage, tmp_path):
    """From another directory, with nothing of the checkout on PYTHONPATH: the script finds
    its tool (the .venv exists already: scripts/setup.sh only checks it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard only
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(usage), done.stdout[:300]


def test_the_tools_list_their_commands():
    done = subprocess.run(
        [sys.executable, "-m", "tools", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
    )
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["demo", "bench", "masks", "soak"]
