"""Grammar-aware drafting (``DraftSession``): trees grown level by level against the per-node
replay oracle and ``build_grammar_vocab_mask``, on SmolLM2's vocabulary; incremental cost,
matchers untouched, states released, forced chains, d2t masks, refusals."""

from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pytest
import xgrammar as xgr
from _cases import allowed_tokens, draw_case
from _engines import engine_factory, matcher_prints
from _oracle import (
    FailingMatcher,
    ProtocolMatcher,
    Request,
    expected_mask,
    fill_row,
    parents_of,
    replay,
    root_path,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_spec as ps
import portable_spec.builder.routes as routes
import portable_spec.native as native
from portable_spec.drafting import forced_tokens, graft_chain, links_from_parents
from portable_spec.registry import backend_for

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROBE = [0, 1, 2, 100, 1000, 18, 107]


# -- helpers ----------------------------------------------------------------------------------
def levels_of(case, data=None):
    """Split each request's tree of a drawn case into levels by depth, as a drafter submits
    them: per level ``(parents, tokens, where)`` with session node ids (-1 parents for padding
    slots) and ``where[b][j]`` = the case node in slot ``j`` (-1 for padding). Also returns
    ``select``: the session node of every case node (-1 for the case's padding)."""
    batch, nodes = case.draft.shape
    parent = [
        parents_of(case.next_token[b].tolist(), case.next_sibling[b].tolist()) for b in range(batch)
    ]
    session_id = [{0: 0} for _ in range(batch)]
    frontier = [[0] for _ in range(batch)]
    levels = []
    next_id = 1
    while any(frontier):
        kids = []
        for b in range(batch):
            found = []
            for u in frontier[b]:
                c = int(case.next_token[b, u])
                while c != -1:
                    found.append(c)
                    c = int(case.next_sibling[b, c])
            kids.append(found)
        width = max(len(k) for k in kids)
        if width == 0:
            break
        pads = data.draw(st.integers(0, 2), label="padding slots") if data is not None else 0
        width += pads
        P = np.full((batch, width), -1, np.int64)
        T = np.zeros((batch, width), np.int64)
        where = []
        for b in range(batch):
            slots = kids[b] + [-1] * (width - len(kids[b]))
            if data is not None:
                order = data.draw(st.permutations(range(width)), label="slot order")
                slots = [slots[i] for i in order]
            for j, v in enumerate(slots):
                if v >= 0:
                    P[b, j] = session_id[b][parent[b][v]]
                    T[b, j] = case.draft[b, v]
                    session_id[b][v] = next_id + j
                else:
                    T[b, j] = 12345  # ignored
            where.append(slots)
        levels.append((P, T, where))
        next_id += width
        frontier = kids
    select = np.full((batch, nodes), -1, np.int64)
    for b in range(batch):
        for v, s in session_id[b].items():
            select[b, v] = s
    return levels, select


def oracle_valid(request, next_token, next_sibling, draft, vocab, grammar_words):
    """Whether the grammar accepts each node's root path (the end token included), by per-node
    replay on fresh matchers."""
    n = len(next_token)
    parent = parents_of(next_token, next_sibling)
    valid = [False] * n
    if request is None:
        return [j == 0 or parent[j] != -1 for j in range(n)]
    valid[0] = True
    limit = min(vocab, 32 * grammar_words)
    for j in range(1, n):
        if parent[j] == -1:
            continue
        path, v = [], j
        while v != 0:
            path.append(v)
            v = parent[v]
        m = request.fresh()
        ok = not m.is_terminated()
        for v in reversed(path):
            if not ok:
                break
            t = int(draft[v])
            row = np.zeros((1, grammar_words), np.int32)
            m.fill_next_token_bitmask(row, 0)
            ok = 0 <= t < limit and bool((int(row[0, t >> 5]) >> (t & 31)) & 1)
            ok = ok and m.accept_token(t)
            if ok and v != j and m.is_terminated():
                ok = False  # nothing follows an accepted end token
        valid[j] = ok
    return valid


def run_levels(session, levels, lazy=()):
    """Submit every level (those whose index is in ``lazy`` with ``masks=False``); returns
    each level's host rows (None for lazy ones)."""
    got = []
    for i, (P, T, _) in enumerate(levels):
        rows = session.extend(P, T, masks=i not in lazy)
        got.append(None if rows is None else np.asarray(rows))
    return got


class ForkingProtocolMatcher(ProtocolMatcher):
    """A protocol matcher with ``fork()``: forks share one call log, so the test can count
    every accept the session made on any fork."""

    def __init__(self, inner, log=None, forks=None, vocab_size=None):
        super().__init__(inner, vocab_size)
        self.calls = log if log is not None else []
        self.forks = forks if forks is not None else []

    def fork(self):
        child = ForkingProtocolMatcher(
            self.inner.fork(), self.calls, self.forks, getattr(self, "vocab_size", None)
        )
        self.forks.append(weakref.ref(child))
        return child

    def find_jump_forward_tokens(self):
        return self.inner.find_jump_forward_tokens()


class JumpingProtocolMatcher(ProtocolMatcher):
    """A protocol matcher without fork() that knows its forced continuation."""

    def find_jump_forward_tokens(self):
        return self.inner.find_jump_forward_tokens()


# -- the oracle ---------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [False, True])
@SETTINGS
@given(data=st.data())
def test_levels_and_verify_mask_match_the_oracle(smollm2, protocol, data, monkeypatch):
    """Random trees (padding, off-grammar, EOS and out-of-range drafts, padded model
    vocabularies, terminated matchers, None, protocol matchers) grown level by level: every
    level's rows are the oracle's rows of its nodes, the verify mask of the whole tree and of
    a random ancestor-closed subtree equals the oracle's and build_grammar_vocab_mask's bit for
    bit, validity matches, and every matcher is untouched."""
    monkeypatch.setattr(routes, "POOL_WORK", data.draw(st.sampled_from([0, routes.POOL_WORK])))
    case = draw_case(data, smollm2, protocol=protocol, max_nodes=16)
    words = smollm2.words
    before = matcher_prints(case.matchers, words, PROBE)
    levels, select = levels_of(case, data)
    want = expected_mask(
        case.requests, case.next_token, case.next_sibling, case.draft, case.vocab_size, words
    )
    batch, nodes = case.draft.shape
    constrained = any(r is not None for r in case.requests)
    with ps.DraftSession(
        case.matchers, case.vocab_size, max_nodes=data.draw(st.integers(1, 8))
    ) as s:
        root = s.root_mask()
        if constrained:
            np.testing.assert_array_equal(root, want.reshape(batch, nodes, -1)[:, 0])
        else:
            assert root is None
        lazy = {i for i in range(len(levels)) if data.draw(st.booleans(), label="masks=False")}
        for i, ((P, _T, where), rows) in enumerate(
            zip(levels, run_levels(s, levels, lazy), strict=True)
        ):
            if i in lazy or not constrained:
                assert rows is None
                continue
            k = P.shape[1]
            expect = np.full((batch * k, want.shape[1]), -1, np.int32)
            for b in range(batch):
                for j, v in enumerate(where[b]):
                    if v >= 0:
                        expect[b * k + j] = want[b * nodes + v]
            np.testing.assert_array_equal(rows, expect)
        assert matcher_prints(case.matchers, words, PROBE) == before  # nothing moved while drafting
        assert s.nodes == 1 + sum(level[0].shape[1] for level in levels)
        mask = s.verify_mask(select)
        tree = s.verify_tree(select)
        valid = s.valid(select)
        # a random ancestor-closed subtree, in random order (the root first)
        keep = [[0] for _ in range(batch)]
        for b in range(batch):
            par = parents_of(case.next_token[b].tolist(), case.next_sibling[b].tolist())
            kept = {0}
            for v in sorted(range(1, nodes), key=lambda v: select[b, v]):  # parents first
                if par[v] in kept and select[b, v] > 0 and data.draw(st.booleans(), label="keep"):
                    kept.add(v)
            rest = sorted(kept - {0})
            keep[b] += [rest[i] for i in data.draw(st.permutations(range(len(rest))), label="o")]
        width = max(len(k) for k in keep)
        sub = np.full((batch, width), -1, np.int64)
        for b in range(batch):
            sub[b, : len(keep[b])] = [select[b, v] for v in keep[b]]
        sub_mask = s.verify_mask(sub, row_capacity=batch * width + 3)
        sub_tree = s.verify_tree(sub)
    if not constrained:
        assert mask is None
        return
    np.testing.assert_array_equal(mask, want)
    assert matcher_prints(case.matchers, words, PROBE) == before
    built = ps.build_grammar_vocab_mask(case.matchers, tree, case.vocab_size)
    np.testing.assert_array_equal(built, mask)
    for b, request in enumerate(case.requests):
        expect = oracle_valid(
            request,
            case.next_token[b].tolist(),
            case.next_sibling[b].tolist(),
            case.draft[b].tolist(),
            case.vocab_size,
            words,
        )
        expect = [e and (v == 0 or select[b, v] > 0) for v, e in enumerate(expect)]
        assert valid[b].tolist() == expect, b
    built = ps.build_grammar_vocab_mask(case.matchers, sub_tree, case.vocab_size)
    assert sub_mask.shape == (batch * width + 3, want.shape[1])
    np.testing.assert_array_equal(sub_mask[: batch * width], built)
    assert (sub_mask[batch * width :] == -1).all()
    assert matcher_prints(case.matchers, words, PROBE) == before


@pytest.mark.parametrize(
    "engines", [("llguidance",), ("outlines",), ("xgrammar", "llguidance", "outlines")]
)
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_other_engines_match_the_oracle(smollm2, engines, data):
    """llguidance (deep copies per node) and outlines-core (replayed paths) in a session,
    alone and mixed with xgrammar: same bits as the oracle, guides and matchers restored."""
    pytest.importorskip("llguidance")
    pytest.importorskip("outlines_core")
    make, kinds = engine_factory(smollm2, engines)
    case = draw_case(data, smollm2, kinds=kinds, make_request=make, protocol=False, max_nodes=12)
    words = smollm2.words
    before = matcher_prints(case.matchers, words, PROBE)
    levels, select = levels_of(case, data)
    want = expected_mask(
        case.requests, case.next_token, case.next_sibling, case.draft, case.vocab_size, words
    )
    with ps.DraftSession(case.matchers, case.vocab_size) as s:
        run_levels(s, levels)
        assert matcher_prints(case.matchers, words, PROBE) == before
        mask = s.verify_mask(select)
    if all(r is None for r in case.requests):
        assert mask is None
    else:
        np.testing.assert_array_equal(mask, want)
    assert matcher_prints(case.matchers, words, PROBE) == before


# -- incremental, untouched, released ------------------------------------------------------------
def _draft_level(session, rng, words, size, k, frontier):
    """k children spread over ``frontier`` (request 0), tokens the parent's row allows."""
    parents = [frontier[j % len(frontier)] for j in range(k)]
    tokens = []
    known = np.asarray(session.verify_mask()).reshape(session.batch, session.nodes, -1)
    for p in parents:
        row = known[0, p]
        options = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:size])
        tokens.append(int(rng.choice(options)))
    return np.array([parents]), np.array([tokens])


def test_forks_make_a_level_cost_its_new_nodes(smollm2):
    """With a forking matcher every new node costs one accept (on a fork of its parent): no
    root path is replayed, however deep the tree; without fork() the replay costs more, and
    the matcher is back where it started after every level."""
    rng = np.random.default_rng(3)
    grammar = smollm2.grammars["builtin_json"]
    forking = ForkingProtocolMatcher(xgr.GrammarMatcher(grammar), vocab_size=smollm2.size)
    plain = ProtocolMatcher(xgr.GrammarMatcher(grammar), vocab_size=smollm2.size)
    accepts = {}
    trees = {}
    for name, m in (("fork", forking), ("replay", plain)):
        rng = np.random.default_rng(3)
        with ps.DraftSession([m], smollm2.size) as s:
            frontier = [0]
            for _ in range(8):  # deep: 8 levels of 3 nodes
                P, T = _draft_level(s, rng, smollm2.words, smollm2.size, 3, frontier)
                first = s.nodes
                s.extend(P, T)
                frontier = [first + j for j in range(3) if s.valid()[0, first + j]]
                assert m.depth == 0  # restored after every level
            trees[name] = s.tree()
            accepts[name] = sum(1 for c in m.calls if c[0] == "accept")
            mask = s.verify_mask()
        built = ps.build_grammar_vocab_mask(
            [xgr.GrammarMatcher(grammar)], _tree(trees[name]), smollm2.size
        )
        np.testing.assert_array_equal(mask, built)
    np.testing.assert_array_equal(trees["fork"][1], trees["replay"][1])
    assert accepts["fork"] == 8 * 3  # one per new node
    assert accepts["replay"] > 2 * accepts["fork"]  # paths replayed


def _tree(parents_tokens):
    parents, tokens = parents_tokens
    nt, ns = links_from_parents(parents)
    return ps.GrammarTree.from_host(nt, ns, tokens)


def test_states_are_released_at_close_and_on_errors(smollm2):
    forking = ForkingProtocolMatcher(xgr.GrammarMatcher(smollm2.grammars["builtin_json"]))
    rng = np.random.default_rng(0)
    with pytest.raises(KeyError), ps.DraftSession([forking], smollm2.size) as s:
        frontier = [0]
        for _ in range(3):
            P, T = _draft_level(s, rng, smollm2.words, smollm2.size, 2, frontier)
            frontier = [s.nodes, s.nodes + 1]
            s.extend(P, T)
        assert sum(r() is not None for r in forking.forks) >= 6
        raise KeyError("the engine failed mid-step")
    gc.collect()
    assert all(r() is None for r in forking.forks)  # every fork dropped
    with pytest.raises(RuntimeError, match="closed"):
        s.extend([[0]], [[1]])
    s.close()  # idempotent


def test_matcher_error_names_the_request_and_keeps_the_session(smollm2):
    grammar = smollm2.grammars["json_schema"]
    good = xgr.GrammarMatcher(grammar)
    bad = FailingMatcher(xgr.GrammarMatcher(grammar), fail_in="fill", at_call=2)
    with ps.DraftSession([good, bad], smollm2.size) as s:
        first = allowed_tokens(good, smollm2.words, smollm2.size)[:2]
        with pytest.raises(ps.MatcherError) as info:
            s.extend([[0, 0], [0, 0]], [first, first])
        assert info.value.request_index == 1 and bad.depth == 0
        assert s.nodes == 1  # the level was not added
        s.extend([[0, 0], [0, 0]], [first, first])  # the next fill works again
        assert s.valid().tolist() == [[True, True, True], [True, True, True]]


# -- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "parents,tokens,error,message",
    [
        ([[0, 5]], [[1, 2]], ValueError, r"parents\[0, 1\] = 5 is not a node"),
        ([[0, -2]], [[1, 2]], ValueError, r"parents\[0, 1\] = -2 is not a node"),
        ([[3, 0]], [[1, 2]], ValueError, r"parents\[0, 0\] = 3 is a padding slot"),
        ([[0.0, 0.0]], [[1, 2]], TypeError, "parents must have an integer dtype"),
        ([[0, 0]], [[1, 2, 3]], ValueError, "same shape"),
        ([[0], [0]], [[1], [2]], ValueError, r"\[batch, k\] with batch = 2"),
        (np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64), ValueError, "no columns"),
        ([[[0]]], [[[1]]], ValueError, r"\[batch, k\]"),
        # int64 host arrays: xgrammar sessions take them in one compiled call
        (np.array([[0, 4]]), np.array([[1, 2]]), ValueError, r"parents\[0, 1\] = 4 is not a"),
        (np.array([[0, 3]]), np.array([[1, 2]]), ValueError, r"parents\[0, 1\] = 3 is a pad"),
        (np.array([[-3, 0]]), np.array([[1, 2]]), ValueError, r"parents\[0, 0\] = -3 is not"),
    ],
)
@pytest.mark.parametrize("kind", ["protocol", "xgrammar"])
def test_malformed_levels_are_refused_before_anything_moves(
    smollm2, parents, tokens, error, message, kind
):
    """Refused before any matcher moves and before anything is written: the session goes on
    as if the call had not been made (its verify mask the build's)."""
    inner = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    m = ProtocolMatcher(inner) if kind == "protocol" else inner
    with ps.DraftSession([m, None], smollm2.size) as s:
        s.extend(np.array([[0, 0, -1]] * 2), np.array([[107, 18, 0]] * 2))  # 1, 2, padding 3
        calls = len(m.calls) if kind == "protocol" else None
        before = s.tree()
        with pytest.raises(error, match=message):
            s.extend(*(np.concatenate([a, a]) if isinstance(a, np.ndarray) else a * 2
                       for a in (parents, tokens)))  # fmt: skip
        assert s.nodes == 4
        for got, want in zip(s.tree(), before, strict=True):
            np.testing.assert_array_equal(got, want)
        if kind == "protocol":
            assert len(m.calls) == calls and m.depth == 0
        s.extend(np.array([[1, 0]] * 2), np.array([[18, 107]] * 2))  # still usable
        mask = s.verify_mask()
        want = ps.build_grammar_vocab_mask([m, None], _tree(s.tree()), smollm2.size)
        np.testing.assert_array_equal(mask, want)


def test_bad_selections_and_arguments_are_refused(smollm2):
    m = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    with ps.DraftSession([m], smollm2.size) as s:
        s.extend([[0, 0]], [[107, 18]])
        s.extend([[1]], [[18]])  # node 3 below node 1
        for select, message in [
            ([[1, 0]], "the first node must be 0"),
            ([[0, 9]], "is not a node"),
            ([[0, 1, 1]], "names node 1 twice"),
            ([[0, 3]], "its parent 1 is not selected"),
            ([[0.0, 1.0]], "integer dtype"),
        ]:
            with pytest.raises((ValueError, TypeError), match=message):
                s.verify_mask(select)
        np.testing.assert_array_equal(s.verify_mask([[0, 1, 3, -1]])[3], -1)
        with pytest.raises(ValueError, match="row_capacity"):
            s.verify_mask(row_capacity=2)
        with pytest.raises(ValueError, match="max_tokens"):
            s.forced(max_tokens=-1)
    with pytest.raises(TypeError, match="backend="):
        ps.DraftSession([m], smollm2.size, device="cuda:0")
    with pytest.raises(ValueError, match="same matcher object"):
        ps.DraftSession([m, m], smollm2.size)
    with pytest.raises(TypeError, match="vocab_size"):
        ps.DraftSession([m], 49152.0)


def test_outlines_depth_is_refused_before_the_guide_moves(smollm2):
    pytest.importorskip("outlines_core")
    from _engines import fingerprint

    from portable_spec import testing as ge

    guide = ge.outlines_guide("json_schema", max_rollback=2)
    before = fingerprint(guide, smollm2.words, PROBE)
    with ps.DraftSession([guide], smollm2.size) as s:
        s.extend([[0]], [[107]])
        s.extend([[1]], [[18]])
        with pytest.raises(ValueError, match="max_rollback >= 3"):
            s.extend([[2]], [[18]])
        assert s.nodes == 3
    assert fingerprint(guide, smollm2.words, PROBE) == before


def test_levels_added_without_masks_are_computed_when_needed(smollm2, tok):
    """masks=False: the level is only staged; its rows come out of verify_mask, bit-identical;
    a malformed one is refused there, naming it."""
    m = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    toks = tok.encode('{"name": "A')
    with ps.DraftSession([m], smollm2.size) as s:
        assert s.extend([[0]], [[toks[0]]], masks=False) is None
        assert s.extend([[1]], [[toks[1]]], masks=False) is None
        assert s.nodes == 3
        mask = s.verify_mask()
        want = ps.build_grammar_vocab_mask(
            [m], ps.GrammarTree.from_linear_chain([[0, *toks[:2]]]), smollm2.size
        )
        np.testing.assert_array_equal(mask, want)
        s.extend([[7]], [[1]], masks=False)  # accepted now, refused when computed
        with pytest.raises(ValueError, match="masks=False"):
            s.verify_mask()
        assert s.nodes == 3
        np.testing.assert_array_equal(s.verify_mask(), want)


def _spy_walks(monkeypatch):
    """Record the DraftSession's xgrammar walks: ``grows`` the compiled step-by-step calls
    (start, end, checked), ``wholes`` the whole-tree builds (tree shapes)."""
    from portable_spec.drafting import session as session_module

    grows, wholes = [], []
    grow, build = native.grow_xgrammar, session_module.build_host_bitmask

    def counted_grow(*args):
        done = grow(*args)
        if done is not None:
            grows.append((args[-2], args[-1], done[2]))
        return done

    def counted_build(matchers, tree, *args, **kwargs):
        wholes.append(tree.shape)
        return build(matchers, tree, *args, **kwargs)

    level = native.level_xgrammar

    def counted_level(*args):  # a level in one call: its walk is a grow of the level's nodes
        done = level(*args)
        if done is not None and done[0] == 0:
            first = args[8]
            grows.append((first, first + args[9].shape[1], done[2]))
        return done

    monkeypatch.setattr(native, "grow_xgrammar", counted_grow)
    monkeypatch.setattr(native, "level_xgrammar", counted_level)
    monkeypatch.setattr(session_module, "build_host_bitmask", counted_build)
    return grows, wholes


@pytest.mark.skipif(native.native is None, reason="portable_spec._native is not built here")
def test_xgrammar_levels_ask_the_grammar_about_their_new_nodes_only(smollm2, tok, monkeypatch):
    """xgrammar requests: each level's new nodes are decided by one compiled call that asks the
    grammar about them alone (an accept and a fill each), never again about a node decided
    before, however deep the tree; levels staged without masks are decided together; rows
    and validity are the build's."""
    grows, wholes = _spy_walks(monkeypatch)
    grammar = smollm2.grammars["json_schema"]
    matchers = [xgr.GrammarMatcher(grammar), None, xgr.GrammarMatcher(grammar)]
    toks = tok.encode('{"name": "Alice", "age": 30, "email": "al')
    depth = len(toks)
    with ps.DraftSession(matchers, smollm2.size) as s:
        assert grows == [(0, 1, 0)]  # the roots' rows: one compiled call, no token asked
        s.extend([[0, 0]] * 3, [[toks[0], 7]] * 3)
        for d in range(1, depth - 3):  # a chain with a refused sibling at every level
            first = s.nodes
            s.extend([[first - 2, first - 2]] * 3, [[toks[d], 7]] * 3)
            assert grows[-1] == (first, first + 2, 4)  # two children per xgrammar request
        for d in range(depth - 3, depth):  # the last three staged, decided together
            s.extend([[s.nodes - 2, -1]] * 3, [[toks[d], 0]] * 3, masks=False)
        assert len(grows) == depth - 2
        mask = s.verify_mask()
        assert grows[-1] == (2 * depth - 5, s.nodes, 6) and not wholes
        tree = _tree(s.tree())
        valid = s.valid()
    want, want_valid = ps.build_host_bitmask(matchers, tree, smollm2.size, return_valid=True)
    np.testing.assert_array_equal(mask, want)
    np.testing.assert_array_equal(valid, want_valid)
    assert sum(checked for *_, checked in grows) == 2 * (2 * (depth - 3) + 3)


GROWN_SHAPES = {"chain": (2, 1, 12), "tree": (4, 4, 5), "wide": (8, 8, 5)}  # kids, frontier, depth


@pytest.mark.skipif(native.native is None, reason="portable_spec._native is not built here")
@pytest.mark.parametrize("shape", sorted(GROWN_SHAPES))
def test_grown_levels_match_per_node_replay(smollm2, tok, monkeypatch, shape):
    """Chains, trees and wide trees grown level by level by the compiled step-by-step calls,
    deeper and wider than the drawn cases: every level's rows, the verify mask and validity
    equal each node's path replayed on a fresh matcher. The trees mix allowed tokens with end
    tokens, refused and out-of-range tokens and padding; the requests are a JSON schema, a
    grammar that may end after any token, a terminated grammar and an unconstrained one; the
    last level is staged without masks. No matcher moves, no level walks the whole tree."""
    grows, wholes = _spy_walks(monkeypatch)
    kids, frontier_width, depth = GROWN_SHAPES[shape]
    eos, size, words = smollm2.eos, smollm2.size, smollm2.words
    short = smollm2.compiler.compile_grammar('root ::= [a-c] [a-c]* | "{" [a-c]*')
    done = smollm2.compiler.compile_grammar('root ::= "a"')
    requests = [
        Request(smollm2.grammars["json_schema"], tok.encode('{"')),
        Request(short),
        None,
        Request(done, [tok.encode("a")[0], eos]),
    ]
    matchers = [r and r.fresh() for r in requests]
    assert matchers[3].is_terminated()
    batch = len(requests)
    before = matcher_prints(matchers, words, PROBE)
    rng = np.random.default_rng(sorted(GROWN_SHAPES).index(shape))
    parent = [[-1] for _ in range(batch)]
    token = [[0] for _ in range(batch)]
    got = {}  # (request, node) -> the row a level returned
    with ps.DraftSession(matchers, size, max_nodes=4) as s:
        rows = {(b, 0): row for b, row in enumerate(np.asarray(s.root_mask()))}
        frontier = [[0] for _ in range(batch)]
        for level in range(depth):
            last = level == depth - 1
            first = s.nodes
            k = kids * frontier_width
            P = np.full((batch, k), -1, np.int64)
            T = np.zeros((batch, k), np.int64)
            for b in range(batch):
                for j in range(k):
                    if j // kids >= len(frontier[b]) or rng.random() < 0.05:
                        continue  # padding
                    p = frontier[b][j // kids]
                    allowed = np.flatnonzero(
                        np.unpackbits(rows[(b, p)].view(np.uint8), bitorder="little")[:size]
                    )
                    roll = 1.0 if j % kids == 0 else rng.random()  # a first child allowed
                    if roll < 0.08:
                        t = eos
                    elif roll < 0.14:
                        t = int(rng.integers(size, size + 50))  # out of range
                    elif roll < 0.22:
                        t = int(rng.integers(0, size))  # mostly refused
                    else:
                        t = int(rng.choice(allowed)) if allowed.size else int(rng.integers(size))
                    P[b, j], T[b, j] = p, t
            out = s.extend(P, T, masks=not last)
            assert (out is None) == last
            for b in range(batch):
                for j in range(k):
                    if P[b, j] >= 0:
                        parent[b].append(int(P[b, j]))
                        token[b].append(int(T[b, j]))
                    else:
                        parent[b].append(-1)
                        token[b].append(0)
                    if not last:
                        rows[(b, first + j)] = np.asarray(out[b * k + j])
                        got[(b, first + j)] = rows[(b, first + j)]
                firsts = [first + j for j in range(0, k, kids) if P[b, j] >= 0]
                others = [first + j for j in range(k) if P[b, j] >= 0 and j % kids]
                chosen = [*rng.permutation(firsts), *rng.permutation(others)]
                frontier[b] = [int(v) for v in chosen[:frontier_width]]
            assert grows[-1][:2] == (first, first + k) or last
        assert grows[0] == (0, 1, 0)  # the roots' rows, one compiled call
        assert not wholes and len(grows) == depth
        mask = np.asarray(s.verify_mask())
        assert len(grows) == depth + 1 and grows[-1][:2] == (first, first + k)
        valid = s.valid()
        nodes = s.nodes
    assert matcher_prints(matchers, words, PROBE) == before
    mask = mask.reshape(batch, nodes, -1)
    live_count = 0
    for b, request in enumerate(requests):
        for v in range(nodes):
            if v > 0 and parent[b][v] == -1:  # padding
                want_row, want_valid = np.full(words, -1, np.int32), False
            elif request is None:
                want_row, want_valid = np.full(words, -1, np.int32), True
            else:
                accepted, m = replay(request.fresh, root_path(parent[b], v), token[b], size, words)
                live = accepted and not m.is_terminated()
                live_count += live and v > 0
                want_row = fill_row(m, words, size) if live else np.full(words, -1, np.int32)
                want_valid = accepted
            np.testing.assert_array_equal(mask[b, v], want_row, err_msg=f"{b}, {v}")
            if (b, v) in got:
                np.testing.assert_array_equal(got[(b, v)], want_row, err_msg=f"{b}, {v}")
            assert valid[b, v] == want_valid, (b, v)
    assert live_count > depth  # the trees reach past their first levels
    assert not valid[3, 1:].any()  # nothing follows a terminated grammar


@pytest.mark.parametrize("how", ["no one-call level", "the level's walk declines"])
def test_xgrammar_levels_without_the_compiled_steps_walk_the_whole_tree(
    smollm2, tok, monkeypatch, how
):
    """Where the helper cannot move xgrammar's matchers itself, a level's rows come from one
    compiled build of the tree so far (levels staged without masks from one build together):
    the same rows. Also when the one-call level finds it cannot walk after it wrote the
    level's columns (its matchers unknown to the helper's table during the call)."""
    grows, wholes = _spy_walks(monkeypatch)
    monkeypatch.setattr(native, "grow_xgrammar", lambda *args: None)
    if how == "no one-call level":
        monkeypatch.setattr(native, "level_xgrammar", lambda *args: None)
    else:
        level, facts = native.level_xgrammar, native._tables[0]

        def declining(*args):
            hidden = {id(m): facts.pop(id(m)) for m in args[0] if id(m) in facts}
            assert hidden
            try:
                done = level(*args)
            finally:
                facts.update(hidden)
            assert done[0] == 2
            return done

        monkeypatch.setattr(native, "level_xgrammar", declining)
    grammar = smollm2.grammars["json_schema"]
    matchers = [xgr.GrammarMatcher(grammar), None, xgr.GrammarMatcher(grammar)]
    toks = tok.encode('{"name": "Al')
    with ps.DraftSession(matchers, smollm2.size) as s:
        s.extend([[0, 0]] * 3, [[toks[0], 7]] * 3)
        assert len(wholes) == 1 and wholes[0].batch == 2  # the two xgrammar requests
        for depth in range(1, 4):
            s.extend([[2 * depth - 1, -1]] * 3, [[toks[depth], 0]] * 3, masks=False)
        assert len(wholes) == 1
        mask = s.verify_mask()
        assert len(wholes) == 2 and wholes[1].nodes == s.nodes and not grows
        want = ps.build_grammar_vocab_mask(matchers, _tree(s.tree()), smollm2.size)
        np.testing.assert_array_equal(mask, want)
        assert s.valid()[0].tolist() == [True, True, False, True, False, True, False, True, False]


# -- masks in host memory -------------------------------------------------------------------------
def test_host_masks_outlive_their_session_and_share_nothing(smollm2, tok):
    """Host masks (numpy, a CPU tensor) are carved from one lent block per session: each mask
    keeps the rows it was returned with through later levels (a tree outgrowing its block
    included), the session's close and the sessions after it, writing into one changes no
    other, and the blocks go back to their pool once the masks are gone."""
    from portable_spec.drafting import session as session_module

    pool = session_module._outputs
    lent = pool.stats()["lent"]
    grammar = smollm2.grammars["json_schema"]
    start = tok.encode('{"')

    def matchers():
        out = []
        for _ in range(3):
            m = xgr.GrammarMatcher(grammar)
            for t in start:
                assert m.accept_token(t)
            out.append(m)
        return out

    def grow(seed):
        rng = np.random.default_rng(seed)
        with ps.DraftSession(matchers(), smollm2.size, max_nodes=2) as s:
            masks = [s.root_mask()]
            for _ in range(4):
                parents = np.tile(np.arange(s.nodes - 2 if s.nodes > 1 else 0, s.nodes), (3, 1))
                tokens = rng.integers(0, smollm2.size, parents.shape)
                masks.append(s.extend(parents[:, -2:], tokens[:, -2:]))
            masks.append(s.verify_mask())
            want = ps.build_grammar_vocab_mask(matchers(), _tree(s.tree()), smollm2.size)
        np.testing.assert_array_equal(masks[-1], want)
        return masks, [np.array(m, copy=True) for m in masks]

    masks, copies = grow(0)
    masks[1][0] = 7  # the caller's to write: no other mask sees it
    copies[1][0] = 7
    for seed in (1, 2):
        grow(seed)
    for mask, copy in zip(masks, copies, strict=True):
        np.testing.assert_array_equal(mask, copy)
    assert pool.stats()["lent"] > lent
    del masks, mask
    gc.collect()
    assert pool.stats()["lent"] == lent


# -- unconstrained and mixed batches -----------------------------------------------------------------
def test_batches_without_grammars(smollm2):
    with ps.DraftSession([None, None], smollm2.size) as s:
        assert s.root_mask() is None
        assert s.extend([[0], [-1]], [[5], [5]]) is None
        assert s.verify_mask() is None
        full = s.verify_mask(row_capacity=6)
        assert full.shape == (6, smollm2.words) and (full == -1).all()
        assert s.valid().tolist() == [[True, True], [True, False]]
        assert s.forced() == [[], []]


# -- forced continuations -------------------------------------------------------------------------
def test_forced_chains_are_the_grammars(smollm2, tok):
    from portable_spec.testing import PERSON_SCHEMA

    compact = smollm2.compiler.compile_json_schema(json.dumps(PERSON_SCHEMA), any_whitespace=False)
    m = xgr.GrammarMatcher(compact)
    root = m.find_jump_forward_tokens()
    assert root  # the schema forces '{"name": ...'
    assert forced_tokens([m, None], smollm2.size) == [root, []]
    with ps.DraftSession([m], smollm2.size) as s:
        assert s.forced(max_tokens=2) == [root[:2]]
        s.extend([[0]], [[root[0]]])
        fork = m.fork()
        fork.accept_token(root[0])
        assert s.forced([1]) == [fork.find_jump_forward_tokens()]
        # a protocol matcher that can jump forward but not fork is replayed to the node
        replayed = JumpingProtocolMatcher(xgr.GrammarMatcher(compact))
        with ps.DraftSession([replayed], smollm2.size) as r:
            r.extend([[0]], [[root[0]]])
            assert r.forced([1]) == s.forced([1]) and replayed.depth == 0
        # grafted onto a host tree: shared where the tree already has it
        parents, tokens = s.tree()
        p, t, chain = graft_chain(parents[0], tokens[0], root, at=0)
        assert chain[0] == 1 and p[chain[1]] == 1 and t[chain[-1]] == root[-1]
        assert len(p) == 2 + len(root) - 1


def test_forced_chains_of_other_engines(smollm2, tok):
    llguidance = pytest.importorskip("llguidance")
    pytest.importorskip("outlines_core")
    from portable_spec import testing as ge

    grammar = llguidance.LLMatcher.grammar_from_regex(r"hello world [0-9]+")
    ll = llguidance.LLMatcher(ge.llguidance_tokenizer(), grammar, log_level=0)
    want = ll.compute_ff_tokens()
    assert tok.decode(want) == "hello world "
    guide = ge.outlines_guide("regex")  # [0-9]{4}-[0-9]{2}-...: after 4 digits, "-" is forced
    digits = tok.encode("2024")
    with ps.DraftSession([ll, guide], smollm2.size) as s:
        for i, d in enumerate(digits):
            s.extend([[i], [i]], [[want[0]], [d]])
        forced = s.forced([0, len(digits)])
        assert forced[0] == want
        # independent: the guide's only allowed token after the digits, replayed by hand
        for d in digits:
            guide.advance(d, return_tokens=False)
        assert forced[1][:1] == guide.get_tokens() == [tok.encode("-")[0]]
        guide.rollback_state(len(digits))


# -- links and grafting ---------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_links_from_parents_match_a_plain_loop(data):
    batch = data.draw(st.integers(1, 3))
    nodes = data.draw(st.integers(1, 12))
    parents = np.full((batch, nodes), -1, np.int64)
    for b in range(batch):
        for v in range(1, nodes):
            parents[b, v] = data.draw(st.integers(-1, v - 1))
    nt, ns = links_from_parents(parents)
    for b in range(batch):
        want_nt, want_ns, last = [-1] * nodes, [-1] * nodes, {}
        for v in range(1, nodes):
            p = int(parents[b, v])
            if p < 0:
                continue
            if p in last:
                want_ns[last[p]] = v
            else:
                want_nt[p] = v
            last[p] = v
        assert nt[b].tolist() == want_nt and ns[b].tolist() == want_ns


# -- EAGLE-3 draft vocabulary ------------------------------------------------------------------------
def test_draft_vocabulary_rows_follow_d2t(smollm2, tok):
    """Draft row bit i = target row bit d2t[i] (checked token by token here); rows that
    allow no draft token, and all-allowed rows, are all-allowed; the verify mask stays in the
    target vocabulary."""
    rng = np.random.default_rng(5)
    d2t = np.sort(rng.choice(smollm2.size, 3001, replace=False))
    quote = tok.encode('"')[0]
    d2t[:3] = [107, quote, 9]  # '{', '"' in the draft vocabulary
    d2t = np.sort(d2t)
    m = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    with ps.DraftSession([m, None], smollm2.size, d2t=d2t) as s:
        root = s.root_mask()
        rows = s.extend([[0, 0], [0, 0]], [[tok.encode("{")[0], 7], [1, 2]])
        verify = s.verify_mask()
        target = verify
    assert root.shape == (2, (3001 + 31) // 32) and rows.shape == (4, root.shape[1])
    drafted = np.concatenate([root[:1], rows[:2], root[1:], rows[2:]])
    for got, want in zip(drafted, target, strict=True):
        if (want == -1).all():
            assert (got == -1).all()
            continue
        bits = [(int(want[t >> 5]) >> (t & 31)) & 1 for t in d2t]
        if not any(bits):
            assert (got == -1).all()
            continue
        unpacked = np.unpackbits(got.view(np.uint8), bitorder="little")
        assert unpacked[: len(d2t)].tolist() == bits
        assert not unpacked[len(d2t) :].any()
    assert verify.shape == (6, smollm2.words)
    for bad, message in [
        (np.array([0, smollm2.size]), "not a target token id"),
        (np.zeros((2, 2), int), "1-D"),
        (np.array([0.5]), "integer"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            ps.DraftSession([m], smollm2.size, d2t=bad)


# -- every backend ---------------------------------------------------------------------------------
def _session_device(target):
    probe = target.put(np.zeros((8, 2), np.int64))
    if target.backend == "numpy":
        return {}
    if target.backend == "torch":
        return {"device": probe.device}
    return {"device": probe.sharding}


def test_every_backend(target, smollm2):
    """Rows of levels given as the target's arrays come back on the target's device (a
    batch-sharded placement splits them by request) with the host session's bits."""
    grammars = ["json_schema", None, "regex", "builtin_json", "json_schema", "ebnf", None, "regex"]
    requests = [None if g is None else Request(smollm2.grammars[g]) for g in grammars]
    rng = np.random.default_rng(1)
    P1 = np.zeros((8, 2), np.int64)
    T1 = np.zeros((8, 2), np.int64)
    P2 = np.array([[1, 2]] * 8, np.int64)
    T2 = np.zeros((8, 2), np.int64)
    for b, r in enumerate(requests):
        if r is None:
            T1[b] = [5, 6]
            T2[b] = [7, 8]
            continue
        m = r.fresh()
        options = allowed_tokens(m, smollm2.words, smollm2.size)
        T1[b] = [rng.choice(options), smollm2.eos if b % 2 else rng.integers(0, smollm2.size)]
        m.accept_token(int(T1[b, 0]))
        options = allowed_tokens(m, smollm2.words, smollm2.size)
        T2[b] = [rng.choice(options), rng.choice(options)]
    host = [[], None]
    with ps.DraftSession([r and r.fresh() for r in requests], smollm2.size) as s:
        host[0] = [s.root_mask(), s.extend(P1, T1), s.extend(P2, T2)]
        host[1] = s.verify_mask()
    with ps.DraftSession(
        [r and r.fresh() for r in requests], smollm2.size, **_session_device(target)
    ) as s:
        got = [
            s.root_mask(),
            s.extend(target.put(P1), target.put(T1)),
            s.extend(target.put(P2), target.put(T2)),
        ]
        verify = s.verify_mask(target.put(np.tile(np.arange(5), (8, 1))))
    for mask, want in zip([*got, verify], [*host[0], host[1]], strict=True):
        assert backend_for(mask).name == target.backend
        target.check_placement(mask)
        np.testing.assert_array_equal(target.get(mask), want)


@pytest.mark.parametrize("kind", ["xgrammar", "protocol", "forking", "llguidance"])
def test_end_tokens_terminate_their_node(smollm2, tok, kind):
    """'a' may end the text or go on with 'b': the end token's node is valid and all-allowed,
    nothing below it is valid; the 'b' node allows the end token only."""
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    eos = smollm2.eos
    grammar = smollm2.compiler.compile_grammar('root ::= "a" | "ab"')
    if kind == "llguidance":
        llguidance = pytest.importorskip("llguidance")
        from portable_spec import testing as ge

        lark = llguidance.LLMatcher.grammar_from_lark('start: "a" | "ab"')
        matcher = llguidance.LLMatcher(ge.llguidance_tokenizer(), lark, log_level=0)
    elif kind == "xgrammar":
        matcher = xgr.GrammarMatcher(grammar)
    elif kind == "protocol":
        matcher = ProtocolMatcher(xgr.GrammarMatcher(grammar))
    else:
        matcher = ForkingProtocolMatcher(xgr.GrammarMatcher(grammar))
    with ps.DraftSession([matcher], smollm2.size) as s:
        s.extend([[0]], [[a]])
        rows = np.asarray(s.extend([[1, 1]], [[eos, b]]))
        below = np.asarray(s.extend([[2, 3, 3]], [[a, eos, a]]))
        assert s.valid().tolist() == [[True, True, True, True, False, True, False]]
        mask = s.verify_mask()
        tree = s.verify_tree()
    assert (rows[0] == -1).all()  # the end token: terminated
    allowed = np.flatnonzero(np.unpackbits(rows[1].view(np.uint8), bitorder="little"))
    assert allowed.tolist() == [eos]
    assert (below == -1).all()
    want = ps.build_grammar_vocab_mask([xgr.GrammarMatcher(grammar)], tree, smollm2.size)
    np.testing.assert_array_equal(mask, want)


def test_a_bad_row_capacity_is_refused_before_the_level_is_added(smollm2):
    m = ProtocolMatcher(xgr.GrammarMatcher(smollm2.grammars["json_schema"]))
    with ps.DraftSession([m, None], smollm2.size) as s:
        with pytest.raises(ValueError, match="row_capacity"):
            s.extend([[0, 0], [0, 0]], [[107, 18], [1, 2]], row_capacity=3)
        assert s.nodes == 1 and not m.calls[1:]  # only the root's fill
        rows = s.extend([[0, 0], [0, 0]], [[107, 18], [1, 2]], row_capacity=5)
        assert rows.shape == (5, smollm2.words) and (rows[4] == -1).all()
        with pytest.raises(ValueError, match="row_capacity"):
            s.root_mask(row_capacity=1)


def _closed_selection(rng, parents, nodes, m):
    """A random selection of ``m`` slots: the root, nodes whose ancestors are all chosen (in
    id order), then -1 padding."""
    chosen = [0]
    for v in range(1, nodes):
        if parents[v] >= 0 and parents[v] in chosen and rng.random() < 0.6:
            chosen.append(v)
    chosen = chosen[:m]
    return chosen + [-1] * (m - len(chosen))


def test_levels_of_changing_width_match_per_node_replay(smollm2, tok):
    """One session grown by many levels of changing width (1 to 12 nodes, from storage sized
    for 2, so it grows several times), parents anywhere in the tree so far, as numpy arrays of
    several dtypes and as lists: every level's rows, and after every level the verify mask and
    validity of a random subtree (``return_valid=True`` and the separate calls), equal each
    node's path replayed on a fresh matcher. The requests: xgrammar matchers (walked by the
    compiled helper), a protocol matcher (decided node by node), an unconstrained one."""
    size, words, eos = smollm2.size, smollm2.words, smollm2.eos
    requests = [
        Request(smollm2.grammars["json_schema"], tok.encode('{"')),
        Request(smollm2.grammars["builtin_json"]),
        None,
        Request(smollm2.grammars["json_schema"], tok.encode('{"name": "')),
    ]
    matchers = [requests[0].fresh(), requests[1].fresh(), None]
    matchers.append(ProtocolMatcher(requests[3].fresh(), vocab_size=size))
    batch = len(requests)
    before = matcher_prints(matchers, words, PROBE)
    rng = np.random.default_rng(46)
    parent = [[-1] for _ in range(batch)]
    token = [[0] for _ in range(batch)]
    oracle = {}  # (request, node) -> (valid, row)

    def expected(b, v):
        if (b, v) not in oracle:
            if v > 0 and parent[b][v] == -1:
                oracle[(b, v)] = (False, np.full(words, -1, np.int32))
            elif requests[b] is None:
                oracle[(b, v)] = (True, np.full(words, -1, np.int32))
            else:
                path = root_path(parent[b], v)
                accepted, m = replay(requests[b].fresh, path, token[b], size, words)
                live = accepted and not m.is_terminated()
                row = fill_row(m, words, size) if live else np.full(words, -1, np.int32)
                oracle[(b, v)] = (accepted, row)
        return oracle[(b, v)]

    def grows(b, v):  # children may follow: accepted, not ended (the root: always)
        valid, row = expected(b, v)
        return v == 0 or (valid and (requests[b] is None or bool((row != -1).any())))

    widths = [1, 6, 2, 9, 1, 4, 12, 3, 5]
    kinds = [np.int64, np.int32, list, np.uint16, np.int64, list, np.int32, np.int64, np.int64]
    with ps.DraftSession(matchers, size, max_nodes=2) as s:
        np.testing.assert_array_equal(
            np.asarray(s.root_mask()), np.stack([expected(b, 0)[1] for b in range(batch)])
        )
        for level, (k, kind) in enumerate(zip(widths, kinds, strict=True)):
            last = level == len(widths) - 1
            first = s.nodes
            P = np.full((batch, k), -1, np.int64)
            T = np.zeros((batch, k), np.int64)
            for b in range(batch):
                live = [v for v in range(first) if grows(b, v)]
                for j in range(k):
                    if rng.random() < 0.1 or not live:
                        continue  # padding
                    p = int(rng.choice(live))
                    row = expected(b, p)[1]
                    allowed = np.flatnonzero(
                        np.unpackbits(row.view(np.uint8), bitorder="little")[:size]
                    )
                    roll = rng.random()
                    if roll < 0.1:
                        t = eos
                    elif roll < 0.2 or not allowed.size:
                        t = int(rng.integers(0, size))  # mostly refused
                    else:
                        t = int(rng.choice(allowed))
                    P[b, j], T[b, j] = p, t
            for b in range(batch):
                for j in range(k):
                    parent[b].append(int(P[b, j]))
                    token[b].append(int(T[b, j]) if P[b, j] >= 0 else 0)
            args = (P.tolist(), T.tolist()) if kind is list else (P.astype(kind), T.astype(kind))
            if kind is np.uint16:
                args = (P, T.astype(kind))  # parents keep their -1
            rows = s.extend(*args, masks=not last)
            nodes = s.nodes
            assert nodes == first + k
            if not last:
                want = np.stack([expected(b, first + j)[1] for b in range(batch) for j in range(k)])
                np.testing.assert_array_equal(np.asarray(rows), want, err_msg=f"level {level}")
            m = int(rng.integers(1, nodes + 3))
            select = np.array(
                [_closed_selection(rng, parent[b], nodes, m) for b in range(batch)], np.int64
            )
            mask, valid = s.verify_mask(select, return_valid=True)
            np.testing.assert_array_equal(np.asarray(s.verify_mask(select)), np.asarray(mask))
            np.testing.assert_array_equal(s.valid(select), valid)
            mask = np.asarray(mask).reshape(batch, m, words)
            for b in range(batch):
                for j, v in enumerate(select[b]):
                    want_valid, want_row = expected(b, v) if v >= 0 else (False, None)
                    if v < 0:
                        want_row = np.full(words, -1, np.int32)
                    np.testing.assert_array_equal(mask[b, j], want_row, err_msg=f"{b}, {v}")
                    assert valid[b, j] == want_valid, (level, b, v)
    assert matcher_prints(matchers, words, PROBE) == before
    accepted = [v for (b, v), (ok, _) in oracle.items() if b == 0 and v > 0 and ok]
    assert len(accepted) > 10  # the trees reach past their first levels


def test_restart_drafts_each_step_as_a_new_session_would(smollm2, tok):
    """One session restarted step after step while the engine commits tokens on its matchers
    (xgrammar matchers, walked by the compiled helper; protocol matchers with and without
    ``fork()``; an unconstrained request; a grammar that ends): after every restart the root
    rows, each level's rows and the verify mask and validity equal each node's path replayed
    on a fresh matcher after the tokens committed so far, and masks returned before a restart
    are unchanged by it."""
    size, words, eos = smollm2.size, smollm2.words, smollm2.eos
    schema, builtin = smollm2.grammars["json_schema"], smollm2.grammars["builtin_json"]
    starts = [
        (schema, tok.encode('{"')),
        (builtin, []),
        None,
        (schema, tok.encode('{"name": "')),
        (builtin, tok.encode("[1, ")),
    ]
    committed: list[list[int]] = [[] for _ in starts]

    def fresh(b):
        compiled, prefix = starts[b]
        return Request(compiled, prefix + committed[b]).fresh()

    matchers = [fresh(0), fresh(1), None]
    matchers.append(ProtocolMatcher(fresh(3), vocab_size=size))
    matchers.append(ForkingProtocolMatcher(fresh(4), vocab_size=size))
    batch = len(starts)
    rng = np.random.default_rng(4646)
    ended = np.full(words, -1, np.int32)

    def oracle(b, parent, token, v):  # (valid, row) of node v by replay
        if v > 0 and parent[v] == -1:
            return False, ended
        if starts[b] is None:
            return True, ended
        accepted, m = replay(lambda: fresh(b), root_path(parent, v), token, size, words)
        live = accepted and not m.is_terminated()
        return accepted, fill_row(m, words, size) if live else ended

    def allowed(row):
        return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:size])

    kept: list[tuple[np.ndarray, np.ndarray]] = []  # (a returned mask, its copy)
    s = ps.DraftSession(matchers, size, max_nodes=2)
    try:
        for step in range(5):
            if step:
                for b in (0, 1, 3, 4):  # the engine commits on the session's own matchers
                    if b == 1 and step <= 2:  # this request's grammar ends
                        picks = tok.encode("{}") if step == 1 else [eos]
                    elif fresh(b).is_terminated():
                        continue
                    else:
                        picks = []
                        m = fresh(b)
                        for _ in range(int(rng.integers(1, 4))):
                            options = [t for t in allowed(fill_row(m, words, size)) if t != eos]
                            picks.append(int(rng.choice(options)))
                            assert m.accept_token(picks[-1])
                    for t in picks:
                        assert matchers[b].accept_token(t)
                    committed[b] += picks
                s.restart()
            assert (s.nodes, s.levels) == (1, 0)
            forced = s.forced(max_tokens=8)  # from the restarted states, at the new root
            for b in (0, 4):
                m = fresh(b)
                want = [] if m.is_terminated() else [int(t) for t in m.find_jump_forward_tokens()]
                assert forced[b] == want[:8], (step, b)
            parent = [[-1] for _ in range(batch)]
            token = [[0] for _ in range(batch)]
            root = np.asarray(s.root_mask())
            kept.append((root, root.copy()))
            want = np.stack([oracle(b, parent[b], token[b], 0)[1] for b in range(batch)])
            np.testing.assert_array_equal(root, want, err_msg=f"step {step}")
            for k in (3, 4):
                first = s.nodes
                P = np.full((batch, k), -1, np.int64)
                T = np.zeros((batch, k), np.int64)
                for b in range(batch):
                    for j in range(k):
                        if rng.random() < 0.15:
                            continue  # padding
                        p = int(rng.integers(0, first))
                        if p and parent[b][p] == -1:
                            p = 0
                        options = allowed(oracle(b, parent[b], token[b], p)[1])
                        if rng.random() < 0.2 or not options.size:
                            t = int(rng.integers(0, size))  # mostly refused
                        else:
                            t = int(rng.choice(options))
                        P[b, j], T[b, j] = p, t
                for b in range(batch):
                    parent[b] += P[b].tolist()
                    token[b] += np.where(P[b] >= 0, T[b], 0).tolist()
                rows = np.asarray(s.extend(P, T))
                kept.append((rows, rows.copy()))
                want = np.stack(
                    [oracle(b, parent[b], token[b], first + j)[1] for b in range(batch)
                     for j in range(k)]
                )  # fmt: skip
                np.testing.assert_array_equal(rows, want, err_msg=f"step {step}, level {first}")
            mask, valid = s.verify_mask(return_valid=True)
            mask = np.asarray(mask).reshape(batch, s.nodes, words)
            for b in range(batch):
                for v in range(s.nodes):
                    want_valid, want_row = oracle(b, parent[b], token[b], v)
                    np.testing.assert_array_equal(mask[b, v], want_row, err_msg=f"{step} {b} {v}")
                    assert valid[b, v] == want_valid, (step, b, v)
            for got, copy in kept:
                np.testing.assert_array_equal(got, copy)
        assert fresh(1).is_terminated()
        assert sum(len(c) for c in committed) > 10
    finally:
        s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.restart()


@pytest.mark.skipif(native.native is None, reason="portable_spec._native is not built here")
def test_the_one_call_level_refuses_malformed_buffers_before_writing(smollm2, tok):
    """``native.level_xgrammar`` (a DraftSession level in one call): malformed arguments raise
    and a malformed parent is reported, nothing written either way; a good call writes the
    level's columns, decides the xgrammar request's nodes as a fresh matcher does, makes the
    unconstrained request's nodes valid and all-allowed, and copies the rows out in order."""
    m = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    size = smollm2.size
    with ps.DraftSession([m, None], size):  # the library probes the matcher
        words, cap = smollm2.words, 8
        rows = np.zeros((2, cap, words), np.int32)
        rows[:, 0] = -1
        m.fill_next_token_bitmask(rows[0], 0)
        parents = np.full((2, cap), -1, np.int64)
        tokens = np.zeros((2, cap), np.int64)
        valid = np.zeros((2, cap), bool)
        live = np.zeros((2, cap), bool)
        valid[:, 0] = live[:, 0] = True
        brace = tok.encode("{")[0]
        args = {
            "matchers": [m], "requests": np.array([0]), "limits": np.array([size]),
            "rows": rows, "parents": parents, "tokens": tokens, "valid": valid, "live": live,
            "first": 1, "level_parents": np.array([[0, 0], [0, -1]]),
            "level_tokens": np.array([[brace, 7], [9, 11]]),
            "out": np.zeros((4, words), np.int32),
        }  # fmt: skip
        saved = [a.copy() for a in (rows, parents, tokens, valid, live)]

        def untouched():
            for got, want in zip((rows, parents, tokens, valid, live), saved, strict=True):
                np.testing.assert_array_equal(got, want)

        bad = [
            ({"level_parents": np.array([[0, 0], [0, -1]], np.int32)}, TypeError),
            ({"level_tokens": np.array([[brace], [9]])}, ValueError),
            ({"out": np.zeros((3, words), np.int32)}, ValueError),
            ({"out": np.zeros((4, words), np.int64)}, TypeError),
            ({"first": cap - 1}, ValueError),
            ({"first": 0}, ValueError),
            ({"requests": np.array([2])}, ValueError),
            ({"valid": np.zeros((2, cap - 1), bool)}, ValueError),
        ]
        for change, error in bad:
            with pytest.raises(error):
                native.level_xgrammar(**{**args, **change})
            untouched()
        for wrong in ([[0, 1], [0, -1]], [[0, -2], [0, -1]]):  # node 1 not yet; -2
            done = native.level_xgrammar(**{**args, "level_parents": np.array(wrong)})
            assert done[0] == 1
            untouched()
        status, padded, checked, refused, failed, _ = native.level_xgrammar(**args)
        assert (status, padded, failed) == (0, True, -1) and (checked, refused) == (2, 1)
        assert parents[:, 1:3].tolist() == [[0, 0], [0, -1]]
        assert tokens[:, 1:3].tolist() == [[brace, 7], [9, 0]]
        assert valid[:, 1:3].tolist() == [[True, False], [True, False]]
        assert live[:, 1:3].tolist() == [[True, False], [True, False]]
        fork = m.fork()
        assert fork.accept_token(brace)
        np.testing.assert_array_equal(rows[0, 1], fill_row(fork, words, size))
        assert (rows[0, 2] == -1).all() and (rows[1, 1:3] == -1).all()
        np.testing.assert_array_equal(args["out"], rows[:, 1:3].reshape(4, words))
