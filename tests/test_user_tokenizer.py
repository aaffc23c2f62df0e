"""A user's own model: the grammar engines' vocabularies built the way the docs show, from a
``transformers`` tokenizer (``AutoTokenizer.from_pretrained``), here SmolLM2's as transformers
reads it from the GGUF on disk (its own GGUF reader, no hub)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import expected_rows

import portable_spec as ps
from portable_spec.testing import PERSON_SCHEMA

VOCAB = 49152
TEXT = '{"name": "Ada", "age": 36, "tags": ["x"]}'


def _chains(tokenizer, batch: int = 3) -> np.ndarray:
    """Chains that follow a JSON text, leave it, and stop at its end."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return np.array(
        [
            [0, *ids[:7]],
            [0, *ids[:3], tokenizer.convert_tokens_to_ids("x"), *ids[4:7]],
            [0, *ids[-4:], eos, eos, eos],
        ][:batch]
    )


def test_xgrammar_tokenizer_info_from_huggingface(hf_tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=VOCAB)
    assert info.vocab_size == VOCAB and info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.stop_token_ids == [hf_tokenizer.eos_token_id]
    for token_id in hf_tokenizer.encode(TEXT, add_special_tokens=False):
        want = hf_tokenizer.decode([token_id]).encode()
        assert info.decoded_vocab[token_id] == want
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON_SCHEMA))
    draft = _chains(hf_tokenizer)
    tree = ps.GrammarTree.from_linear_chain(draft)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(len(draft))]
    mask = ps.build_grammar_vocab_mask(matchers, tree, VOCAB)
    next_token, next_sibling, _ = tree.resolve()
    for b in range(len(draft)):
        want = expected_rows(
            lambda: xgr.GrammarMatcher(compiled), next_token[b].tolist(),
            next_sibling[b].tolist(), draft[b].tolist(), VOCAB, (VOCAB + 31) // 32,
        )  # fmt: skip
        n = draft.shape[1]
        np.testing.assert_array_equal(mask[b * n : (b + 1) * n], want)
    assert (mask != -1).any(axis=1).sum() >= 8  # the grammar constrained real rows


def test_llguidance_from_tokenizer(hf_tokenizer, smollm2):
    """llguidance's tokenizer from the same object builds the masks xgrammar's does."""
    llguidance = pytest.importorskip("llguidance")
    hf = pytest.importorskip("llguidance.hf")

    tokenizer = hf.from_tokenizer(hf_tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PERSON_SCHEMA))
    draft = _chains(hf_tokenizer)
    tree = ps.GrammarTree.from_linear_chain(draft)
    ll = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(len(draft))]
    xg = [xgr.GrammarMatcher(smollm2.grammars["json_schema"]) for _ in range(len(draft))]
    _, ll_valid = ps.build_host_bitmask(ll, tree, VOCAB, return_valid=True)
    _, xg_valid = ps.build_host_bitmask(xg, tree, VOCAB, return_valid=True)
    np.testing.assert_array_equal(ll_valid, xg_valid)  # the same drafts follow the grammar
    assert ll_valid[0].all() and not ll_valid[1].all()
