"""llguidance and outlines-core matchers, alone and mixed with xgrammar in one batch, against
the per-node replay oracle on SmolLM2's vocabulary; termination rules; matchers restored."""

from __future__ import annotations

import numpy as np
import pytest
from _cases import draw_case
from _oracle import (
    Request,
    assert_mask_matches,
    expected_node_counts,
    expected_valid,
    matcher_state,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

llguidance = pytest.importorskip("llguidance")
outlines_core = pytest.importorskip("outlines_core")

from _engines import engine_factory, fingerprint, matcher_prints  # noqa: E402

import portable_spec as ps  # noqa: E402
import portable_spec.builder.routes as routes  # noqa: E402
import portable_spec.topology as topology_module  # noqa: E402
from portable_spec import testing as ge  # noqa: E402
from portable_spec.stats import reset_grammar_stats  # noqa: E402

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROBE = [0, 1, 2, 100, 1000, 18, 107]
_EXECUTOR_WORK = routes.EXECUTOR_WORK


@pytest.mark.parametrize(
    "engines", [("llguidance",), ("outlines",), ("xgrammar", "llguidance", "outlines")]
)
@pytest.mark.parametrize("path", ["lists", "arrays"])
@SETTINGS
@given(data=st.data())
def test_matches_oracle(smollm2, engines, path, builder_mode, data, monkeypatch):
    """Random trees, padding, off-grammar/EOS/out-of-range drafts and padded model
    vocabularies with llguidance and outlines-core matchers (and xgrammar ones in the same
    batch): bit-identical to the oracle, node counts equal, every matcher restored."""
    if path == "arrays":
        monkeypatch.setattr(topology_module, "SMALL_TREE_ROWS", 0)
    monkeypatch.setattr(routes, "POOL_WORK", data.draw(st.sampled_from([0, routes.POOL_WORK])))
    make, kinds = engine_factory(smollm2, engines)
    case = draw_case(data, smollm2, kinds=kinds, make_request=make, protocol=False)
    before = matcher_prints(case.matchers, smollm2.words, PROBE)
    tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
    reset_grammar_stats()
    mask, valid = ps.build_host_bitmask(case.matchers, tree, case.vocab_size, return_valid=True)
    assert_mask_matches(case, smollm2.words, mask)
    arrays = (case.next_token, case.next_sibling, case.draft)
    np.testing.assert_array_equal(
        valid, expected_valid(case.requests, *arrays, case.vocab_size, smollm2.words)
    )
    if mask is not None:
        stats = ps.grammar_stats()
        arrays = (case.next_token, case.next_sibling, case.draft)
        want = expected_node_counts(case.requests, *arrays, case.vocab_size, smollm2.words)
        assert (stats["checked_nodes"], stats["rejected_nodes"]) == want
    assert matcher_prints(case.matchers, smollm2.words, PROBE) == before


@pytest.mark.parametrize("executor_from", [1, 10**9])
@pytest.mark.parametrize("engine", ["llguidance", "outlines"])
@SETTINGS
@given(data=st.data())
def test_chains_match_oracle(smollm2, engine, executor_from, data):
    """Chains (from_linear_chain) take llguidance's one-call chain fill (from
    ``executor_from`` requests on) or its per-token chain loop; same bits either way."""
    routes.EXECUTOR_WORK = 1 if executor_from == 1 else 10**18
    make, kinds = engine_factory(smollm2, (engine,))
    case = draw_case(data, smollm2, kinds=kinds, make_request=make, protocol=False, max_nodes=12)
    batch, nodes = case.draft.shape
    case.next_token = np.tile(np.append(np.arange(1, nodes), -1), (batch, 1))
    case.next_sibling = np.full((batch, nodes), -1)
    chain = ps.GrammarTree.from_linear_chain(case.draft)
    before = matcher_prints(case.matchers, smollm2.words, PROBE)
    reset_grammar_stats()
    try:
        result = ps.build_host_bitmask(case.matchers, chain, case.vocab_size, return_valid=True)
    finally:
        routes.EXECUTOR_WORK = _EXECUTOR_WORK
    mask, valid = result
    assert_mask_matches(case, smollm2.words, mask)
    arrays = (case.next_token, case.next_sibling, case.draft)
    np.testing.assert_array_equal(
        valid, expected_valid(case.requests, *arrays, case.vocab_size, smollm2.words)
    )
    if mask is not None:
        stats = ps.grammar_stats()
        want = expected_node_counts(case.requests, *arrays, case.vocab_size, smollm2.words)
        assert (stats["checked_nodes"], stats["rejected_nodes"]) == want
    assert matcher_prints(case.matchers, smollm2.words, PROBE) == before


# -- termination: one rule for every engine ---------------------------------------------------
def _live(mask, nodes):
    return (mask != -1).any(axis=1).reshape(-1, nodes)


def _allowed(row):
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def test_llguidance_complete_grammar_waits_for_the_end_token(smollm2, tok):
    """llguidance's is_stopped() is true once the grammar is complete, before the end token:
    that node's row is the end token only; the end token's node is terminated (all-allowed,
    counted as accepted, not refused)."""
    matcher = ge.llguidance_matcher("builtin_json")
    text = tok.encode("[1]")
    assert matcher.try_consume_tokens(text[:-1]) == len(text) - 1
    dt = np.array([[0, text[-1], smollm2.eos, smollm2.eos]])
    tree = ps.GrammarTree.from_linear_chain(dt)
    before = fingerprint(matcher, smollm2.words, PROBE)
    reset_grammar_stats()
    mask = ps.build_host_bitmask([matcher], tree, smollm2.size)
    assert _allowed(mask[1]) == {smollm2.eos}  # complete: the end token only
    assert _live(mask, 4).tolist() == [[True, True, False, False]]
    stats = ps.grammar_stats()
    assert (stats["checked_nodes"], stats["rejected_nodes"]) == (2, 0)
    # the end token taken without a trace is not rolled back: the matcher is where it was
    assert fingerprint(matcher, smollm2.words, PROBE) == before
    # consumed end token (EndOfSentence): the matcher is terminated, every row all-allowed
    ended = ge.llguidance_matcher("builtin_json")
    number = tok.encode("12")
    assert ended.try_consume_tokens(number) == len(number) and not ended.is_stopped()
    assert ended.try_consume_tokens([smollm2.eos]) == 1 and ended.stop_reason() == "EndOfSentence"
    mask = ps.build_host_bitmask([ended], ps.GrammarTree.from_linear_chain([[0, 5]]), smollm2.size)
    assert (mask == -1).all()


def test_llguidance_end_token_where_the_grammar_may_go_on(smollm2, tok):
    """In an accepting state that may still continue, the end token's node is terminated
    and its sibling continuing the text is live."""
    matcher = ge.llguidance_matcher("builtin_json")
    number = tok.encode("12")
    assert matcher.try_consume_tokens(number) == len(number)
    assert matcher.is_accepting() and not matcher.is_stopped()
    digit = tok.encode("3")[0]
    nt = np.array([[1, -1, -1]])
    ns = np.array([[-1, 2, -1]])
    dt = np.array([[0, smollm2.eos, digit]])
    mask = ps.build_host_bitmask([matcher], ps.GrammarTree.from_host(nt, ns, dt), smollm2.size)
    assert smollm2.eos in _allowed(mask[0])
    assert _live(mask, 3).tolist() == [[True, False, True]]


def test_outlines_final_state_allows_the_end_token(smollm2, tok):
    """outlines-core's is_finished() means "may end here": the row allows the end token and
    more; the end token's node is terminated without advancing the guide."""
    guide = outlines_core.Guide(outlines_core.Index("a+", ge.outlines_vocabulary()))
    m_token = tok.encode("a")[0]
    guide.advance(m_token, return_tokens=False)
    assert guide.is_finished()
    nt = np.array([[1, -1, -1]])
    ns = np.array([[-1, 2, -1]])
    dt = np.array([[0, smollm2.eos, m_token]])
    state = guide.get_state()
    reset_grammar_stats()
    mask = ps.build_host_bitmask([guide], ps.GrammarTree.from_host(nt, ns, dt), smollm2.size)
    assert {smollm2.eos, m_token} <= _allowed(mask[0])
    assert _live(mask, 3).tolist() == [[True, False, True]]
    assert ps.grammar_stats()["rejected_nodes"] == 0
    assert guide.get_state() == state


def test_padded_model_vocabulary_has_zero_bits_past_the_engines(smollm2):
    """A model vocabulary wider than the engines': bits past theirs are 0 (as for xgrammar)."""
    size = smollm2.size + 100
    matchers = [ge.llguidance_matcher("builtin_json"), ge.outlines_guide("json_schema")]
    tree = ps.GrammarTree.from_linear_chain(np.zeros((2, 2), dtype=np.int64))
    mask = ps.build_host_bitmask(matchers, tree, size)
    assert mask.shape == (4, -(-size // 32))
    assert (mask[[0, 2], smollm2.words :] == 0).all()


# -- refusals and failures --------------------------------------------------------------------
def test_llguidance_matcher_in_error_state_is_named(smollm2):
    good = ge.llguidance_matcher("json_schema")
    broken = ge.llguidance_matcher("json_schema")
    assert not broken.consume_token(5)  # refused: the matcher enters its error state
    assert broken.is_error()
    before = fingerprint(good, smollm2.words, PROBE)
    tree = ps.GrammarTree.from_linear_chain(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ps.MatcherError, match=r"grammars\[1\].*error state") as info:
        ps.build_host_bitmask([good, broken], tree, smollm2.size)
    assert info.value.request_index == 1
    assert fingerprint(good, smollm2.words, PROBE) == before


def test_outlines_tree_deeper_than_its_rollback_is_refused(smollm2, tok):
    """A guide built with max_rollback=3 cannot walk 4 tokens deep and come back: refused
    before anything moves; at depth 3 it works and returns to its state."""
    import outlines_core

    guide = outlines_core.Guide(ge.outlines_index("json_schema"), max_rollback=3)
    other = ge.llguidance_matcher("json_schema")
    before = (guide.get_state(), fingerprint(other, smollm2.words, PROBE))
    text = tok.encode('{"name": "x"')
    deep = ps.GrammarTree.from_linear_chain(np.array([[0, *text[:4]]] * 2))
    with pytest.raises(ValueError, match=r"request 1 is 4 draft tokens deep.*max_rollback=3"):
        ps.build_host_bitmask([other, guide], deep, smollm2.size)
    assert (guide.get_state(), fingerprint(other, smollm2.words, PROBE)) == before
    ok = ps.GrammarTree.from_linear_chain(np.array([[0, *text[:3]]]))
    mask = ps.build_host_bitmask([guide], ok, smollm2.size)
    assert _live(mask, 4).all()
    assert guide.get_state() == before[0]


def test_failure_mid_walk_restores_every_engine(smollm2):
    """A matcher raising in the middle of a mixed batch: MatcherError names it, and the
    llguidance, outlines-core and xgrammar matchers are all back where they started."""
    from _oracle import FailingMatcher

    compiled = smollm2.grammars["json_schema"]
    brace, quote = smollm2.tokens.index("{"), smollm2.tokens.index('"')
    llm = ge.llguidance_matcher("json_schema")
    guide = ge.outlines_guide("json_schema")
    xm = Request(compiled).native()
    failing = FailingMatcher(Request(compiled).native(), fail_in="fill", at_call=2)
    dt = np.tile([0, brace, quote], (4, 1))
    before = (
        fingerprint(llm, smollm2.words, PROBE),
        fingerprint(guide, smollm2.words, PROBE),
        matcher_state(xm, PROBE, smollm2.words),
    )
    with pytest.raises(ps.MatcherError, match=r"grammars\[3\]") as info:
        ps.build_host_bitmask(
            [llm, guide, xm, failing], ps.GrammarTree.from_linear_chain(dt), smollm2.size
        )
    assert info.value.request_index == 3
    assert failing.depth == 0
    after = (
        fingerprint(llm, smollm2.words, PROBE),
        fingerprint(guide, smollm2.words, PROBE),
        matcher_state(xm, PROBE, smollm2.words),
    )
    assert after == before


MALFORMED = [
    ("cycle", [1, 2, 1, -1], [-1, -1, -1, -1], r"two parents|cycle"),
    ("link to the root", [1, 0, -1], [-1, -1, -1], r"links the root"),
    ("root sibling", [1, -1, -1], [2, -1, -1], r"cannot have a sibling"),
    ("out of range", [1, 3, -1], [-1, -1, -1], r"is outside"),
]


@pytest.mark.parametrize("engine", ["llguidance", "outlines"])
@pytest.mark.parametrize(("name", "nt", "ns", "pattern"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_input_moves_nothing(smollm2, engine, name, nt, ns, pattern):
    make = ge.llguidance_matcher if engine == "llguidance" else ge.outlines_guide
    matcher = make("json_schema")
    before = fingerprint(matcher, smollm2.words, PROBE)
    n = len(nt)
    tree = ps.GrammarTree.from_host([nt], [ns], [[0] * n])
    with pytest.raises(ValueError, match=pattern):
        ps.build_host_bitmask([matcher], tree, smollm2.size)
    good = ps.GrammarTree.from_linear_chain(np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="smaller than the vocabulary"):
        ps.build_host_bitmask([matcher], good, smollm2.size - 64)
    with pytest.raises(ValueError, match="same matcher object"):
        ps.build_host_bitmask(
            [matcher, matcher],
            ps.GrammarTree.from_linear_chain(np.zeros((2, 2), dtype=np.int64)),
            smollm2.size,
        )
    assert fingerprint(matcher, smollm2.words, PROBE) == before


def test_deep_chain_without_recursion(smollm2):
    """A 3000-node chain through llguidance and outlines-core (outlines built deep enough)."""
    import outlines_core

    space = smollm2.tokens.index("Ġ")
    llm = llguidance.LLMatcher(
        ge.llguidance_tokenizer(), llguidance.LLMatcher.grammar_from_regex(" *"), log_level=0
    )
    index = outlines_core.Index(" *", ge.outlines_vocabulary())
    guide = outlines_core.Guide(index, max_rollback=3000)
    dt = np.full((2, 3001), space)
    mask = ps.build_host_bitmask([llm, guide], ps.GrammarTree.from_linear_chain(dt), smollm2.size)
    assert _live(mask, 3001).all()
    assert guide.get_state() == outlines_core.Guide(index, max_rollback=1).get_state()


def test_llguidance_chain_row_equal_to_the_sentinel(smollm2, tok, monkeypatch):
    """The chain fill tells written rows by a sentinel; a real row that happens to equal it
    is still recognised as written (decided on a fork), and the mask is unchanged."""
    import portable_spec.engines.llguidance as engine

    monkeypatch.setattr(routes, "EXECUTOR_WORK", 1)

    text = tok.encode('{"name": "ab", "age": 4')
    dt = np.array([[0, *text]])
    want = ps.build_host_bitmask(
        [ge.llguidance_matcher("json_schema")], ps.GrammarTree.from_linear_chain(dt), smollm2.size
    )
    assert (want != -1).any(axis=1).all()
    for node in (1, 3, len(text)):  # rows in the middle and at the end of the chain
        monkeypatch.setattr(engine, "_SENTINEL", (int(want[node, 0]), int(want[node, -1])))
        got = ps.build_host_bitmask(
            [ge.llguidance_matcher("json_schema")],
            ps.GrammarTree.from_linear_chain(dt),
            smollm2.size,
        )
        np.testing.assert_array_equal(got, want)
