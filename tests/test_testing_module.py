"""portable_spec.testing: importing it is cheap, and its samples are what they claim."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from portable_spec import testing

HEAVY = ("xgrammar", "gguf", "tokenizers", "torch", "jax", "llguidance", "outlines_core")


def test_import_loads_no_engine_framework_or_reader():
    code = (
        "import json, sys\n"
        "import portable_spec.testing\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
    )  # the timeout is a hang guard only
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_sample_grammars_accept_their_own_examples(smollm2):
    """Each sample grammar accepts a text written by hand for it, token by token on SmolLM2's
    vocabulary, and ends there (an xgrammar matcher is the independent judge)."""
    import xgrammar as xgr

    tok = testing.load_tokenizer()
    texts = {
        "json_schema": '{"name": "Ada", "age": 36, "address": {"street": "A", "city": "B", '
        '"zip": "10815"}}',
        "ebnf": 'port = 8080\nhost = "a"\nsizes = [1, 2.5]\n',
        "regex": "2024-05-17 ada@example.com",
    }
    for kind, text in texts.items():
        matcher = xgr.GrammarMatcher(smollm2.grammars[kind])
        for token in tok.encode(text):
            assert matcher.accept_token(token), (kind, text)
        assert matcher.accept_token(smollm2.eos) or matcher.is_terminated(), kind
    with pytest.raises(ValueError, match="unknown sample grammar"):
        testing.compile_sample(smollm2.compiler, "yaml")


def test_tokenizer_round_trips_text():
    tok = testing.load_tokenizer()
    text = '{"name": "Ada Lovelace", "born": 1815}\n\tok'
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == testing.load_vocab().eos_id
