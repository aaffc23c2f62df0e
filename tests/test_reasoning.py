"""Reasoning models: the grammar starts where the reasoning ends, per path, on every engine."""

from __future__ import annotations

import numpy as np
import pytest
import xgrammar as xgr
from _cases import draw_case
from _oracle import ProtocolMatcher, Request, expected_reasoning_mask, matcher_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_spec as ps

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROBE = [0, 1, 2, 100, 1000, 18, 107]


def _draw_reasoning(data, case, vocab):
    """Active flags, and end / content end tokens taken from the drawn trees' own drafts
    (so that they occur) plus a few others."""
    seen = sorted({int(t) for t in case.draft[:, 1:].ravel() if 0 <= t < vocab.size})
    pool = [*seen, vocab.eos, 0, 5]
    chosen = data.draw(
        st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True), label="enders"
    )
    split = data.draw(st.integers(0, len(chosen)), label="split")
    ends, content = chosen[:split], chosen[split:]
    if not ends and not content:
        ends = [vocab.eos]
    active = data.draw(
        st.lists(st.booleans(), min_size=len(case.matchers), max_size=len(case.matchers))
    )
    return ps.Reasoning(np.array(active, dtype=bool), ends, content)


@pytest.mark.parametrize("engines", ["xgrammar", "mixed"])
@SETTINGS
@given(data=st.data())
def test_matches_the_replay_oracle(smollm2, engines, builder_mode, data):
    """Random trees and drafts, random reasoning requests and end tokens: bit-identical to a
    per-node replay, matchers restored."""
    if engines == "mixed":
        pytest.importorskip("llguidance")
        pytest.importorskip("outlines_core")
        from _engines import engine_factory

        make, kinds = engine_factory(smollm2, ("xgrammar", "llguidance", "outlines"))
        case = draw_case(data, smollm2, kinds=kinds, make_request=make, protocol=False)
    else:
        case = draw_case(data, smollm2)
    reasoning = _draw_reasoning(data, case, smollm2)
    tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
    mask, valid = ps.build_host_bitmask(
        case.matchers, tree, case.vocab_size, reasoning=reasoning, return_valid=True
    )
    want, want_valid = expected_reasoning_mask(
        case.requests, case.next_token, case.next_sibling, case.draft, case.vocab_size,
        smollm2.words, reasoning.active, set(reasoning.end_token_ids),
        set(reasoning.content_end_token_ids), with_valid=True,
    )  # fmt: skip
    np.testing.assert_array_equal(valid, want_valid)
    if all(r is None for r in case.requests):
        assert mask is None
        return
    bad = np.flatnonzero((mask != want).any(axis=1))
    assert bad.size == 0, f"rows differing from the oracle: {bad.tolist()}"
    for m in case.matchers:
        if isinstance(m, ProtocolMatcher):
            assert m.depth == 0


def test_end_token_on_one_branch_only(smollm2, tok):
    """Root -> [</think>-like end, "x"]: the end branch gets the grammar's first mask, the
    other keeps reasoning (everything allowed) and so does its child."""
    compiled = smollm2.grammars["builtin_json"]
    end = smollm2.tokens.index("<|im_start|>")  # stands for </think>
    x = smollm2.tokens.index("x")
    brace = smollm2.tokens.index("{")
    nt = np.array([[1, 3, 4, -1, -1]])
    ns = np.array([[-1, 2, -1, -1, -1]])
    dt = np.array([[0, end, x, brace, brace]])
    matcher = xgr.GrammarMatcher(compiled)
    before = matcher_state(matcher, PROBE, smollm2.words)
    reasoning = ps.Reasoning([True], [end])
    mask = ps.build_host_bitmask(
        [matcher], ps.GrammarTree.from_host(nt, ns, dt), smollm2.size, reasoning=reasoning
    )
    first = np.zeros((1, smollm2.words), np.int32)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first, 0)
    assert (mask[0] == -1).all() and (mask[2] == -1).all() and (mask[4] == -1).all()  # reasoning
    np.testing.assert_array_equal(mask[1], first[0])  # the grammar starts after the end token
    after_brace = xgr.GrammarMatcher(compiled)
    assert after_brace.accept_token(brace)
    after_brace.fill_next_token_bitmask(first, 0)
    np.testing.assert_array_equal(mask[3], first[0])
    assert matcher_state(matcher, PROBE, smollm2.words) == before


def test_content_end_tokens(smollm2):
    """A content end token is the grammar's first token: accepted ones start the grammar
    with it consumed; one the grammar refuses as first content is banned while reasoning."""
    compiled = smollm2.grammars["builtin_json"]
    brace = smollm2.tokens.index("{")
    letter = smollm2.tokens.index("x")  # JSON cannot start with it
    nt = np.array([[1, -1, -1]])
    ns = np.array([[-1, 2, -1]])
    dt = np.array([[0, brace, letter]])
    reasoning = ps.Reasoning([True], [], [brace, letter])
    mask = ps.build_host_bitmask(
        [xgr.GrammarMatcher(compiled)], ps.GrammarTree.from_host(nt, ns, dt), smollm2.size,
        reasoning=reasoning,
    )  # fmt: skip
    bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")
    assert bits[brace] == 1 and bits[letter] == 0 and bits.sum() == 32 * smollm2.words - 1
    after = xgr.GrammarMatcher(compiled)
    assert after.accept_token(brace)
    row = np.zeros((1, smollm2.words), np.int32)
    after.fill_next_token_bitmask(row, 0)
    np.testing.assert_array_equal(mask[1], row[0])
    assert (mask[2] == -1).all()  # rejected: all-allowed, like any rejected node


def test_inactive_requests_and_chains_are_unchanged(smollm2):
    """Requests not reasoning are built as usual; ragged chains padded with -1 work."""
    compiled = smollm2.grammars["json_schema"]
    brace = smollm2.tokens.index("{")
    dt = np.array([[0, brace, -1, -1], [0, brace, smollm2.tokens.index('"'), -1]])
    tree = ps.GrammarTree.from_linear_chain(dt)
    plain = ps.build_host_bitmask(
        [xgr.GrammarMatcher(compiled)] * 1 + [xgr.GrammarMatcher(compiled)], tree, smollm2.size
    )
    same = ps.build_host_bitmask(
        [xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)], tree, smollm2.size,
        reasoning=ps.Reasoning([False, False], [smollm2.eos]),
    )  # fmt: skip
    np.testing.assert_array_equal(plain, same)
    assert (plain.reshape(2, 4, -1)[0, 2:] == -1).all()  # -1 padding: rejected, all-allowed


@pytest.mark.parametrize(
    ("reasoning", "error", "pattern"),
    [
        ("yes", TypeError, "must be a portable_spec.Reasoning"),
        (ps.Reasoning([True], [2]), ValueError, "has shape"),
        (ps.Reasoning([1, 0], [2]), TypeError, "booleans"),
        (ps.Reasoning([True, False], []), ValueError, "at least one end token"),
        (ps.Reasoning([True, False], [2], [2]), ValueError, "both end_token_ids"),
        (ps.Reasoning([True, False], [-1]), ValueError, "outside the vocabulary"),
        (ps.Reasoning([True, False], "ab"), TypeError, "collection of token ids"),
        (ps.Reasoning([True, False], True), TypeError, "the bool True"),
        (ps.Reasoning([True, False], 2.0), TypeError, "collection of token ids"),
        (ps.Reasoning([True, False], {2.0}), TypeError, "int token ids, got 2.0"),
        (ps.Reasoning([True, False], [2], [False]), TypeError, "content_end_token_ids"),
        (ps.Reasoning([True, False], {-3}), ValueError, "holds -3, outside"),
        (ps.Reasoning([True, False], -3), ValueError, "holds -3, outside"),
        (ps.Reasoning([True, False], np.array([2.0])), TypeError, "dtype float64"),
        (ps.Reasoning([True, False], np.array([[2]])), TypeError, r"shape \(1, 1\)"),
        (ps.Reasoning([True, False], {2: "x"}), TypeError, "collection of token ids"),
        (ps.Reasoning([True, False], iter([2])), TypeError, "collection of token ids"),
    ],
)
def test_bad_reasoning_moves_nothing(smollm2, reasoning, error, pattern):
    m = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    before = matcher_state(m, PROBE, smollm2.words)
    tree = ps.GrammarTree.from_linear_chain(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(error, match=pattern):
        ps.build_host_bitmask([m, None], tree, smollm2.size, reasoning=reasoning)
    assert matcher_state(m, PROBE, smollm2.words) == before


@pytest.mark.parametrize(
    "form",
    [set, frozenset, tuple, list, np.array, "range", "int", "numpy int"],
    ids=lambda f: f if isinstance(f, str) else f.__name__,
)
def test_token_ids_take_any_collection_of_ints(smollm2, form):
    """A set, frozenset, tuple, list, range, integer array or a single int of end tokens builds
    the mask the oracle gives for those tokens."""
    compiled = smollm2.grammars["json_schema"]
    end = smollm2.tokens.index("<|im_start|>")
    brace = smollm2.tokens.index("{")
    convert = {
        "range": lambda ids: range(ids[0], ids[0] + 1),
        "int": lambda ids: ids[0],
        "numpy int": lambda ids: np.int32(ids[0]),
    }.get(form, form)
    draft = np.array([[0, 5, end, brace], [0, brace, 7, end]])
    tree = ps.GrammarTree.from_linear_chain(draft)
    matchers = [xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)]
    reasoning = ps.Reasoning([True, True], convert([end]), convert([brace]))
    got = ps.build_host_bitmask(matchers, tree, smollm2.size, reasoning=reasoning)
    next_token, next_sibling, _ = tree.resolve()
    expected = expected_reasoning_mask(
        [Request(compiled), Request(compiled)], next_token, next_sibling, draft,
        smollm2.size, smollm2.words, [True, True], {end}, {brace},
    )  # fmt: skip
    np.testing.assert_array_equal(got, expected)


def test_failing_matcher_below_the_end_is_named(smollm2):
    """A matcher raising in a grammar sub-tree: MatcherError names its request."""
    from _oracle import FailingMatcher

    compiled = smollm2.grammars["json_schema"]
    end = smollm2.tokens.index("<|im_start|>")
    brace = smollm2.tokens.index("{")
    failing = FailingMatcher(xgr.GrammarMatcher(compiled), fail_in="fill", at_call=2)
    dt = np.array([[0, 5, 7], [0, end, brace]])
    with pytest.raises(ps.MatcherError, match=r"matchers\[1\]") as info:
        ps.build_host_bitmask(
            [xgr.GrammarMatcher(compiled), failing], ps.GrammarTree.from_linear_chain(dt),
            smollm2.size, reasoning=ps.Reasoning([False, True], [end]),
        )  # fmt: skip
    assert info.value.request_index == 1 and failing.depth == 0


def test_free_row_is_read_once_per_matcher(smollm2):
    """A reasoning matcher stands at its start state, so its free-text row is read (one fill)
    on its first build only; without content end tokens it is never read."""
    compiled = smollm2.grammars["builtin_json"]
    x = smollm2.tokens.index("x")
    tree = ps.GrammarTree.from_linear_chain(np.array([[0, x, x]]))
    matcher = ProtocolMatcher(xgr.GrammarMatcher(compiled), vocab_size=smollm2.size)
    with_content = ps.Reasoning([True], [], [smollm2.tokens.index("{")])
    first = ps.build_host_bitmask([matcher], tree, smollm2.size, reasoning=with_content)
    fills = sum(call[0] == "fill" for call in matcher.calls)
    assert fills == 1
    again = ps.build_host_bitmask([matcher], tree, smollm2.size, reasoning=with_content)
    assert sum(call[0] == "fill" for call in matcher.calls) == fills  # cached
    np.testing.assert_array_equal(first, again)
    plain = ps.Reasoning([True], [smollm2.eos])
    other = ProtocolMatcher(xgr.GrammarMatcher(compiled), vocab_size=smollm2.size)
    ps.build_host_bitmask([other], tree, smollm2.size, reasoning=plain)
    assert other.calls == []  # no end token among the drafts, no content end tokens
