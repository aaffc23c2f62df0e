"""The builder against the independent per-node replay oracle, on real vocabularies."""

from __future__ import annotations

import numpy as np
import pytest
from _cases import draw_case
from _oracle import (
    ProtocolMatcher,
    assert_mask_matches,
    expected_node_counts,
    expected_valid,
    matcher_state,
)
from _short_path import spy_short_paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_spec as ps
import portable_spec.builder.routes as routes
import portable_spec.topology as topology_module
from portable_spec.stats import reset_grammar_stats

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _fingerprints(case, vocab):
    probe = [vocab.eos, 0, 1, 2, 100, 1000]
    prints = []
    for m in case.matchers:
        if m is None:
            prints.append(None)
        else:
            inner = m.inner if isinstance(m, ProtocolMatcher) else m
            prints.append(matcher_state(inner, probe, vocab.words))
    return prints


def _check(case, vocab, mask):
    assert_mask_matches(case, vocab.words, mask)


@pytest.mark.parametrize("path", ["lists", "arrays"])
@SETTINGS
@given(data=st.data())
def test_matches_oracle(vocab, path, builder_mode, data, monkeypatch):
    """Random trees, sibling orders, padding, off-grammar/EOS/out-of-range drafts, padded
    model vocabularies, xgrammar and protocol matchers: bit-identical to the oracle, and every
    matcher is back where it started."""
    if path == "arrays":
        monkeypatch.setattr(topology_module, "SMALL_TREE_ROWS", 0)
    monkeypatch.setattr(routes, "POOL_WORK", data.draw(st.sampled_from([0, routes.POOL_WORK])))
    case = draw_case(data, vocab)
    before = _fingerprints(case, vocab)
    tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
    out = None
    if data.draw(st.booleans(), label="use out="):
        words = -(-case.vocab_size // 32)
        out = np.random.default_rng(0).integers(
            -(2**31), 2**31, size=(case.next_token.size, words), dtype=np.int32
        )
    reset_grammar_stats()
    return_valid = data.draw(st.booleans(), label="return_valid")
    result = ps.build_host_bitmask(
        case.matchers, tree, case.vocab_size, out=out, return_valid=return_valid
    )
    mask = result[0] if return_valid else result
    if return_valid:  # which nodes the grammars accept, against the replay oracle
        arrays = (case.next_token, case.next_sibling, case.draft)
        want = expected_valid(case.requests, *arrays, case.vocab_size, vocab.words)
        np.testing.assert_array_equal(result[1], want)
    if out is not None and mask is not None:
        assert mask is out
    _check(case, vocab, mask)
    if mask is not None:  # the draft nodes the grammars checked and refused
        stats = ps.grammar_stats()
        arrays = (case.next_token, case.next_sibling, case.draft)
        want = expected_node_counts(case.requests, *arrays, case.vocab_size, vocab.words)
        assert (stats["checked_nodes"], stats["rejected_nodes"]) == want
    assert _fingerprints(case, vocab) == before
    for m in case.matchers:
        if isinstance(m, ProtocolMatcher):
            assert m.depth == 0


@SETTINGS
@given(data=st.data())
def test_device_entry_point_matches_oracle(smollm2, data):
    """build_grammar_vocab_mask with the numpy backend returns the same bits."""
    case = draw_case(data, smollm2, max_batch=3, max_nodes=12)
    tree = ps.GrammarTree.from_device(case.next_token, case.next_sibling, case.draft)
    mask = ps.build_grammar_vocab_mask(case.matchers, tree, case.vocab_size)
    _check(case, smollm2, mask)


@SETTINGS
@given(data=st.data())
def test_linear_chain_matches_oracle(smollm2, data):
    """from_linear_chain builds node i -> i + 1 links without validation; same bits as the
    same chain given explicitly."""
    case = draw_case(data, smollm2, max_batch=3, max_nodes=16)
    batch, nodes = case.draft.shape
    chain = ps.GrammarTree.from_linear_chain(case.draft)
    next_token = np.tile(np.append(np.arange(1, nodes), -1), (batch, 1))
    next_sibling = np.full((batch, nodes), -1)
    explicit = ps.GrammarTree.from_host(next_token, next_sibling, case.draft)
    a = ps.build_host_bitmask(case.matchers, chain, case.vocab_size)
    b = ps.build_host_bitmask(case.matchers, explicit, case.vocab_size)
    case.next_token, case.next_sibling = next_token, next_sibling
    _check(case, smollm2, a)
    if a is not None:
        np.testing.assert_array_equal(a, b)


@SETTINGS
@given(data=st.data())
def test_small_chain_calls_match_oracle(vocab, data):
    """The single-function path of small chain calls (plain xgrammar matchers seen before, a
    few requests, short chains): rows, valid flags, node counts against the replay oracle, an
    ``out=`` filled with garbage rewritten in full, matchers back where they started; and the
    call really took that path."""
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone after each example
        case = draw_case(data, vocab, max_batch=8, max_nodes=9,
                         protocol=False)  # fmt: skip
        batch, nodes = case.draft.shape
        case.next_token = np.tile(np.append(np.arange(1, nodes), -1), (batch, 1))
        case.next_sibling = np.full((batch, nodes), -1)
        taken = spy_short_paths(monkeypatch)
        # the first call learns each matcher's width; the second one can take the short path
        ps.build_host_bitmask(
            case.matchers, ps.GrammarTree.from_linear_chain(case.draft), case.vocab_size
        )
        before = _fingerprints(case, vocab)
        words = -(-case.vocab_size // 32)
        out = np.random.default_rng(1).integers(
            -(2**31), 2**31, size=(batch * nodes, words), dtype=np.int32
        )
        return_valid = data.draw(st.booleans(), label="return_valid")
        reset_grammar_stats()
        taken.clear()
        tree = ps.GrammarTree.from_linear_chain(case.draft)
        result = ps.build_host_bitmask(
            case.matchers, tree, case.vocab_size, out=out, return_valid=return_valid
        )
        # every request has an xgrammar matcher as wide as the mask: the short path
        plain = all(m is not None for m in case.matchers) and words == vocab.words
        # the caller's int64 tokens, read in place by one compiled call
        assert taken == (["one call"] if plain else [])
        mask = result[0] if return_valid else result
        if all(m is None for m in case.matchers):
            assert mask is None
            return
        assert mask is out
        _check(case, vocab, mask)
        arrays = (case.next_token, case.next_sibling, case.draft)
        if return_valid:
            want = expected_valid(case.requests, *arrays, case.vocab_size, vocab.words)
            np.testing.assert_array_equal(result[1], want)
        stats = ps.grammar_stats()
        want_counts = expected_node_counts(case.requests, *arrays, case.vocab_size, vocab.words)
        assert (stats["checked_nodes"], stats["rejected_nodes"]) == want_counts
        assert _fingerprints(case, vocab) == before
