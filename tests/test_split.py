"""Splitting a request's tree over threads (batches smaller than the pool) changes nothing in
the result: the oracle's bits, matchers restored, for every way of cutting."""

from __future__ import annotations

import numpy as np
import pytest
from _cases import draw_case
from _oracle import ProtocolMatcher, assert_mask_matches, matcher_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_spec as ps
import portable_spec.builder.jobs as jobs_module
import portable_spec.builder.routes as routes
from portable_spec.builder.split import plan_split


@pytest.fixture
def many_threads():
    yield
    ps.set_num_threads(None)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_split_walks_match_oracle(vocab, builder_mode, data, monkeypatch, many_threads):
    split_nodes = data.draw(st.sampled_from([2, 8]))  # trees of at least this many nodes
    monkeypatch.setattr(routes, "SPLIT_WORK", routes.work(split_nodes, vocab.words))
    part_nodes = data.draw(st.sampled_from([1, 3]))  # subtrees of at least this many nodes
    monkeypatch.setattr(routes, "SPLIT_PART_WORK", routes.work(part_nodes, vocab.words))
    ps.set_num_threads(data.draw(st.sampled_from([2, 3, 4, 8]), label="threads"))
    case = draw_case(data, vocab, max_batch=2, max_nodes=40, protocol=False)
    probe = [vocab.eos, 0, 1, 100]
    before = [None if m is None else matcher_state(m, probe, vocab.words) for m in case.matchers]
    tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
    mask = ps.build_host_bitmask(case.matchers, tree, case.vocab_size)
    assert_mask_matches(case, vocab.words, mask)
    after = [None if m is None else matcher_state(m, probe, vocab.words) for m in case.matchers]
    assert after == before


def test_cuts_are_balanced_and_disjoint():
    # a chain of 16: one cut halves it
    nt = [*range(1, 16), -1]
    ns = [-1] * 16
    split = plan_split(nt, ns, list(range(16)), 2, 2)
    assert [sub.nodes for sub in split.subtrees] == [list(range(8, 16))]
    assert split.subtrees[0].path == list(range(1, 9))
    assert split.next_token[7] == -1 and split.next_token[6] == 7
    assert split.main_rows == list(range(8))
    # a root with 6 leaf children, 4 parts: three distinct leaves cut, the rest stays linked
    nt2 = [1, -1, -1, -1, -1, -1, -1]
    ns2 = [-1, 2, 3, 4, 5, 6, -1]
    split = plan_split(nt2, ns2, [0] * 7, 4, 1)
    cut = [sub.nodes[0] for sub in split.subtrees]
    assert len(set(cut)) == 3 and 0 not in cut
    kids, c = [], int(split.next_token[0])
    while c != -1:
        kids.append(c)
        c = int(split.next_sibling[c])
    assert sorted(kids + cut) == [1, 2, 3, 4, 5, 6]
    assert sorted(split.main_rows + cut) == list(range(7))
    # nested: a later cut above an earlier one excludes it
    nt3 = [1, 2, 3, 4, 5, 6, 7, -1]
    split = plan_split(nt3, [-1] * 8, list(range(8)), 4, 1)
    seen = [v for sub in split.subtrees for v in sub.nodes] + split.main_rows
    assert sorted(seen) == list(range(8))
    assert plan_split([1, -1], [-1, -1], [0, 0], 2, 2) is None  # no piece of 2 nodes


def test_split_failure_restores_everything(smollm2, many_threads, monkeypatch):
    """A failing fork walk still reports the request and leaves the matcher untouched."""
    import xgrammar as xgr

    ps.set_num_threads(2)
    monkeypatch.setattr(routes, "SPLIT_WORK", routes.work(2, smollm2.words))
    monkeypatch.setattr(routes, "SPLIT_PART_WORK", routes.work(2, smollm2.words))
    compiled = smollm2.grammars["builtin_json"]
    m = xgr.GrammarMatcher(compiled)
    tokens = [0] + [smollm2.tokens.index(t) for t in ["[", "1", ",", "2", ","] * 4]
    tree = ps.GrammarTree.from_linear_chain(np.array([tokens]))
    before = matcher_state(m, [0, 1], smollm2.words)

    def broken(*args, **kwargs):
        raise RuntimeError("fork walk failed")

    monkeypatch.setattr(jobs_module, "walk_subtree", broken)
    with pytest.raises(
        ps.MatcherError, match="grammars\\[0\\] raised RuntimeError: fork walk failed"
    ):
        ps.build_host_bitmask([m], tree, smollm2.size)
    assert matcher_state(m, [0, 1], smollm2.words) == before
    monkeypatch.undo()
    ps.set_num_threads(2)
    assert (
        ps.build_host_bitmask([ProtocolMatcher(m, vocab_size=smollm2.size)], tree, smollm2.size)
        is not None
    )
