"""The checkout's command line (``python -m tools``, ``scripts/*.sh``) as a user meets it: pipes
closed early, readable output."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import numpy as np
import pytest

# the byte-level alphabet of GPT-2-style tokenizers: bytes that are not printable are shown as
# these code points ("Ġ" a space, "Ċ" a newline, "ĉ" a tab)
BYTE_ALPHABET = re.compile("[\u0100-\u0143]")

# the checkout: the tools run from there (they are not installed)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _closed_pipe_run(*args: str) -> subprocess.CompletedProcess:
    """Run ``python -m tools ARGS`` with its stdout a pipe nobody reads any more (as in
    ``python -m tools --help | head -3`` once ``head`` has exited)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "tools", *args],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            timeout=1800,  # a hang guard only
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["--help"], ["masks", "--batch", "2", "--nodes", "4"]])
def test_a_reader_that_leaves_early_gets_no_traceback(args):
    done = _closed_pipe_run(*args)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 1


def test_help_through_head_is_quiet():
    done = subprocess.run(
        ["bash", "-c", f"'{sys.executable}' -m tools --help | head -1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.stdout == "usage: python -m tools <command> [options]\n"
    assert done.stderr == ""


def test_decode_tokens_gives_the_tokenizers_text(smollm2, tok):
    """The masks command's decoding against the `tokenizers` library's byte-level decoder."""
    from portable_spec.testing import tokenizer_info
    from tools.masks import decode_tokens

    info = tokenizer_info()
    rng = np.random.default_rng(0)
    special = set(tok.vocab.special_ids)
    cases = [tok.encode('{\n\t"name": "Ada Lovelace",\r\n "born": 1815}')]  # tabs, newlines
    for _ in range(50):
        cases.append(
            [int(t) for t in rng.integers(0, smollm2.size, size=6) if int(t) not in special]
        )
    for ids in cases:
        want = tok.decode(ids, skip_special=False)
        if "\ufffd" in want:  # a split multi-byte character: both replace it
            continue
        assert decode_tokens(info, ids) == want


def test_masks_prints_paths_as_text(capsys):
    from tools.masks import main

    assert main(["--batch", "6", "--nodes", "16", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    paths = [ast.literal_eval(line.rsplit(": ", 1)[1]) for line in out.splitlines()[2:]]
    assert len(paths) == 6 and any(paths)
    for path in paths:
        assert not BYTE_ALPHABET.search(path), path
    assert any(" " in p or '"' in p for p in paths)  # decoded JSON: spaces and quotes
