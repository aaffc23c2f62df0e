"""The compact layout with llguidance and outlines-core matchers (alone and mixed with
xgrammar): the oracle's entries, for trees and for llguidance's chain executor."""

from __future__ import annotations

import numpy as np
import pytest
from _cases import draw_case
from _oracle import assert_compact_matches, expected_node_counts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

llguidance = pytest.importorskip("llguidance")
outlines_core = pytest.importorskip("outlines_core")

from _engines import engine_factory, matcher_prints  # noqa: E402

import portable_spec as ps  # noqa: E402
import portable_spec.builder.routes as routes  # noqa: E402
from portable_spec import testing as ge  # noqa: E402
from portable_spec.stats import reset_grammar_stats  # noqa: E402

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROBE = [0, 1, 2, 100, 1000, 18, 107]


@pytest.mark.parametrize(
    "engines", [("llguidance",), ("outlines",), ("xgrammar", "llguidance", "outlines")]
)
@SETTINGS
@given(data=st.data())
def test_compact_matches_oracle(smollm2, engines, builder_mode, data, monkeypatch):
    monkeypatch.setattr(routes, "POOL_WORK", data.draw(st.sampled_from([0, routes.POOL_WORK])))
    make, kinds = engine_factory(smollm2, engines)
    case = draw_case(data, smollm2, kinds=kinds, make_request=make, protocol=False)
    before = matcher_prints(case.matchers, smollm2.words, PROBE)
    tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
    reset_grammar_stats()
    mask = ps.build_host_bitmask(case.matchers, tree, case.vocab_size, layout="compact")
    assert_compact_matches(case, smollm2.words, mask)
    if mask is not None:
        stats = ps.grammar_stats()
        arrays = (case.next_token, case.next_sibling, case.draft)
        want = expected_node_counts(case.requests, *arrays, case.vocab_size, smollm2.words)
        assert (stats["checked_nodes"], stats["rejected_nodes"]) == want
    assert matcher_prints(case.matchers, smollm2.words, PROBE) == before


@pytest.mark.parametrize("executor_from", [1, 10**9])
@pytest.mark.parametrize("engines", [("llguidance",), ("llguidance", "xgrammar", "outlines")])
@SETTINGS
@given(data=st.data())
def test_compact_chains_match_oracle(smollm2, engines, executor_from, data, monkeypatch):
    """Chains take llguidance's one-call executor fill (into a block of the group's own,
    then each request's live prefix is committed), or below ``executor_from`` requests its
    per-token chain loop."""
    monkeypatch.setattr(routes, "EXECUTOR_WORK", 1 if executor_from == 1 else 10**18)
    make, kinds = engine_factory(smollm2, engines)
    case = draw_case(data, smollm2, kinds=kinds, make_request=make, protocol=False, max_nodes=12)
    batch, nodes = case.draft.shape
    case.next_token = np.tile(np.append(np.arange(1, nodes), -1), (batch, 1))
    case.next_sibling = np.full((batch, nodes), -1)
    before = matcher_prints(case.matchers, smollm2.words, PROBE)
    mask = ps.build_host_bitmask(
        case.matchers,
        ps.GrammarTree.from_linear_chain(case.draft),
        case.vocab_size,
        layout="compact",
        max_rows=batch * nodes,
    )
    assert_compact_matches(case, smollm2.words, mask)
    assert matcher_prints(case.matchers, smollm2.words, PROBE) == before


def test_broken_llguidance_chain_matcher_is_named(smollm2):
    good = ge.llguidance_matcher("json_schema")
    broken = ge.llguidance_matcher("json_schema")
    assert not broken.consume_token(5)
    tree = ps.GrammarTree.from_linear_chain(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ps.MatcherError, match=r"grammars\[1\]") as info:
        ps.build_host_bitmask([good, broken], tree, smollm2.size, layout="compact")
    assert info.value.request_index == 1
