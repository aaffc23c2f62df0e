"""The backend hook that places mask rows (``Backend.mask_layout``), on the numpy backend:
the default pads at the end, a backend's own layout is honoured, a bad one is refused before
any matcher moves, and ``row_capacity`` never gives ``None``."""

from __future__ import annotations

import numpy as np
import pytest
from _oracle import ProtocolMatcher, Request, expected_mask

import portable_spec as ps
from portable_spec.backend import MaskLayout


@pytest.fixture
def case(smollm2):
    """Two requests of 3 nodes (root -> "{" -> '"'): the first unconstrained, the second JSON."""
    brace, quote = smollm2.tokens.index("{"), smollm2.tokens.index('"')
    nt = np.array([[1, 2, -1], [1, 2, -1]])
    ns = np.full((2, 3), -1)
    dt = np.array([[0, brace, quote], [0, brace, quote]])
    requests = [None, Request(smollm2.grammars["builtin_json"])]
    want = expected_mask(requests, nt, ns, dt, smollm2.size, smollm2.words)
    return requests, ps.GrammarTree.from_host(nt, ns, dt), want


def _fresh(requests):
    return [None if r is None else r.fresh() for r in requests]


def test_default_layout_pads_at_the_end(case, smollm2):
    requests, tree, want = case
    mask = ps.build_grammar_vocab_mask(_fresh(requests), tree, smollm2.size, row_capacity=10)
    np.testing.assert_array_equal(mask[:6], want)
    assert (mask[6:] == -1).all()
    layout = ps.get_backend("numpy").mask_layout(None, 2, 3, smollm2.size, 10)
    assert layout == MaskLayout(10, ((0, 6, 0),), None)


def test_no_grammar_with_row_capacity_gives_the_all_allowed_mask(case, smollm2):
    _, tree, _ = case
    mask = ps.build_grammar_vocab_mask([None, None], tree, smollm2.size, row_capacity=8)
    assert isinstance(mask, np.ndarray) and mask.shape == (8, smollm2.words)
    assert (mask == -1).all()
    assert ps.build_grammar_vocab_mask([None, None], tree, smollm2.size) is None


def test_a_backend_layout_is_honoured(case, smollm2, monkeypatch):
    """A backend that gives each request its own 4-row part: rows, then padding."""
    requests, tree, want = case

    def per_request(placement, batch, nodes, vocab_size, row_capacity):
        blocks = tuple((b * nodes, nodes, b * 4) for b in range(batch))
        return MaskLayout(4 * batch, blocks, placement)

    monkeypatch.setattr(ps.get_backend("numpy"), "mask_layout", per_request)
    mask = ps.build_grammar_vocab_mask(_fresh(requests), tree, smollm2.size, row_capacity=8)
    np.testing.assert_array_equal(mask[[0, 1, 2, 4, 5, 6]], want)
    assert (mask[[3, 7]] == -1).all()


@pytest.mark.parametrize(
    "blocks",
    [
        ((0, 6, 0), (6, 1, 6)),  # covers more rows than were built
        ((0, 3, 0), (3, 3, 1)),  # moves rows backwards (over rows not yet moved)
        ((0, 3, 4), (3, 3, 5)),  # overlapping destinations
        ((0, 6, 8),),  # past the host buffer
    ],
)
def test_a_bad_backend_layout_is_refused_before_matchers_move(case, smollm2, monkeypatch, blocks):
    requests, tree, _ = case

    def bad(placement, batch, nodes, vocab_size, row_capacity):
        return MaskLayout(10, blocks, placement)

    monkeypatch.setattr(ps.get_backend("numpy"), "mask_layout", bad)
    matchers = [None, ProtocolMatcher(requests[1].fresh())]
    with pytest.raises(ValueError, match="invalid mask layout"):
        ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, row_capacity=10)
    assert matchers[1].calls == []
