"""xgrammar's matcher methods called by the compiled helper through tvm-ffi's C ABI.

The rows it writes are checked against a per-node replay on fresh matchers (and against
xgrammar's own Python binding, the independent path it replaces); the GIL is shown released
without any clock; malformed calls are refused before xgrammar sees them; a signature the
helper does not know leaves xgrammar's Python binding in use.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import (
    Request,
    expected_accepted,
    expected_mask,
    expected_node_counts,
    expected_rows,
    fill_row,
    matcher_state,
)

import portable_spec as ps
import portable_spec.native as native_module
from portable_spec.builder import routes
from portable_spec.engines.xgrammar import chain_facts, probe_xgrammar

native = native_module.native
compiled_only = pytest.mark.skipif(native is None, reason="portable_spec._native is not built here")


def _bits(row):
    return (row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)).reshape(-1) & 1


def _random_chain(rng, vocab, length):
    """(request, drafts): a JSON-schema request after a random valid prefix, then up to
    ``length`` drafts that follow the grammar, one of them sometimes refused or the end token."""
    compiled = vocab.grammars["json_schema"]
    probe = Request(compiled).fresh()
    prefix = []
    for _ in range(rng.randrange(12)):
        allowed = [
            t
            for t in np.flatnonzero(_bits(fill_row(probe, vocab.words, vocab.size)))
            if t != vocab.eos
        ]
        if not allowed:
            break
        t = int(rng.choice(allowed))
        assert probe.accept_token(t)
        prefix.append(t)
    drafts = []
    while len(drafts) < length and not probe.is_terminated():
        row = fill_row(probe, vocab.words, vocab.size)
        allowed = np.flatnonzero(_bits(row)[: vocab.size]).tolist()
        roll = rng.random()
        if roll < 0.1 and vocab.eos in allowed:
            drafts.append(vocab.eos)
            break
        if roll < 0.25 or not allowed:
            drafts.append(rng.randrange(-2, vocab.size + 3))  # mostly refused, maybe out of range
            continue
        t = int(rng.choice(allowed))
        assert probe.accept_token(t)
        drafts.append(t)
    return Request(compiled, prefix), drafts


def _links(n):
    return np.array([*range(1, n), -1], dtype=np.int64), np.full(n, -1, dtype=np.int64)


@compiled_only
def test_bound_on_the_installed_xgrammar(smollm2):
    """The installed xgrammar (tvm-ffi 0.1) is bound: a real matcher has a handle."""
    matcher = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    assert native_module.xgrammar_handle(matcher) != 0
    assert native_module.xgrammar_handle(object()) == 0


@compiled_only
def test_traverse_matches_the_python_binding_and_the_oracle(smollm2):
    """Random chains: the direct call writes the rows xgrammar's Python binding writes, every
    accepted, live node's row is the replay's, and the matcher ends where it started."""
    rng = random.Random(1)
    probes = list(range(0, smollm2.size, 997))
    for _ in range(30):
        request, drafts = _random_chain(rng, smollm2, rng.randrange(1, 7))
        draft = np.array([0, *[max(t, 0) for t in drafts]], dtype=np.int64)
        nt, ns = _links(len(draft))
        direct = np.full((len(draft), smollm2.words), 7, dtype=np.int32)
        binding = direct.copy()
        matcher = request.native()
        before = matcher_state(matcher, probes, smollm2.words)
        native_module.traverse_xgrammar(matcher, nt, ns, draft, direct)
        assert matcher_state(matcher, probes, smollm2.words) == before
        request.native().traverse_draft_tree(nt, ns, draft, binding)
        np.testing.assert_array_equal(direct, binding)
        want = expected_rows(
            request.fresh, nt.tolist(), ns.tolist(), draft.tolist(), smollm2.size, smollm2.words
        )
        accepted = expected_accepted(
            request.fresh, nt.tolist(), ns.tolist(), draft.tolist(), smollm2.size, smollm2.words
        )
        for j in range(len(draft)):
            if accepted[j] and not (want[j] == -1).all():
                np.testing.assert_array_equal(direct[j], want[j])


def _terminated_request(vocab):
    """A request whose matcher has accepted a whole document and the end token."""
    compiled = vocab.compiler.compile_grammar('root ::= "{}"')
    probe = xgr.GrammarMatcher(compiled)
    prefix = []
    while not probe.is_terminated():
        allowed = np.flatnonzero(_bits(fill_row(probe, vocab.words, vocab.size))[: vocab.size])
        t = vocab.eos if vocab.eos in allowed else int(allowed[0])
        assert probe.accept_token(t)
        prefix.append(t)
    return Request(compiled, prefix)


def _walk_case(rng, vocab, batch, with_absent=True):
    """Requests, their matchers (probed by the library; ``None`` where absent), their drafts,
    the packed tokens and a walk_chains span table."""
    requests, matchers, rows_of, table, tokens = [], [], [], [], []
    for _b in range(batch):
        request, drafts = _random_chain(rng, vocab, rng.randrange(0, 6))
        if rng.random() < 0.15:  # a terminated matcher: its rows are all-allowed
            request = _terminated_request(vocab)
        matcher = request.native()
        probe_xgrammar(matcher, vocab.words)
        absent = with_absent and rng.random() < 0.1
        start = len(tokens)
        tokens.extend([0, *drafts])
        requests.append(None if absent else request)
        matchers.append(None if absent else matcher)
        table.append((start, start, len(drafts) + 1))
        rows_of.append(drafts)
    return (
        requests,
        matchers,
        rows_of,
        np.array(table, dtype=np.int64),
        np.array(tokens, dtype=np.int64),
    )


def _expected_chain(request, drafts, vocab, repeat):
    n = len(drafts) + 1
    nt, ns = [*range(1, n), -1], [-1] * n
    dt = [0, *drafts]
    if request is None:
        return np.full((n, vocab.words), -1, dtype=np.int32), [True] + [False] * (n - 1)
    rows = expected_rows(request.fresh, nt, ns, dt, vocab.size, vocab.words)
    accepted = expected_accepted(request.fresh, nt, ns, dt, vocab.size, vocab.words)
    if repeat:  # vLLM's rule: a refused draft repeats the row before it on every later row
        for j in range(1, n):
            if not accepted[j]:
                m = request.fresh()
                live = not m.is_terminated()
                for t in drafts[: j - 1]:
                    live = live and m.accept_token(t) and not m.is_terminated()
                if live:
                    rows[j:] = rows[j - 1]
                break
    return rows, accepted


@compiled_only
@pytest.mark.parametrize("repeat", [0, 1])
def test_walk_chains_matches_the_oracle(smollm2, repeat):
    """A batch of chains (live, terminated and absent matchers) walked in one call: rows,
    valid flags and counts as the replay says; every matcher back in its state."""
    rng = random.Random(10 + repeat)
    probes = list(range(0, smollm2.size, 1013))
    for _ in range(6):
        requests, matchers, drafts, table, tokens = _walk_case(rng, smollm2, rng.randrange(1, 9))
        rows = np.full((len(tokens), smollm2.words), 5, dtype=np.int32)
        valid = np.zeros(len(tokens), dtype=bool)
        seconds = np.full(len(matchers), -1.0)
        live = [m for m in matchers if m is not None]
        before = [matcher_state(m, probes, smollm2.words) for m in live]
        stops = np.array([smollm2.eos], dtype=np.int64)
        checked, rejected, failed, message = native.walk_chains(
            rows, tokens, table, matchers, smollm2.size, stops, repeat, valid, seconds
        )
        assert (failed, message) == (-1, None)
        assert [matcher_state(m, probes, smollm2.words) for m in live] == before
        assert (seconds >= 0).all()
        want_checked = want_rejected = 0
        for b, (request, chain) in enumerate(zip(requests, drafts, strict=True)):
            start, n = int(table[b, 0]), len(chain) + 1
            want, accepted = _expected_chain(request, chain, smollm2, repeat)
            np.testing.assert_array_equal(rows[start : start + n], want, err_msg=f"request {b}")
            assert valid[start : start + n].tolist() == accepted, f"request {b}"
            if request is not None and not matchers[b].is_terminated():  # type: ignore[union-attr]
                for j in range(1, n):  # the helper's counts: drafts asked about, drafts refused
                    want_checked += 1
                    if not accepted[j]:
                        want_rejected += 1
                        break
                    if chain[j - 1] == smollm2.eos:
                        break
        assert (checked, rejected) == (want_checked, want_rejected)


@compiled_only
def test_the_gil_is_released_during_the_walk(smollm2):
    """Another Python thread runs while one walk_chains call is in progress. The switch
    interval is set so high that the walking thread never hands the GIL over on its own: the
    other thread can only run inside the call if the call releases the GIL."""
    rng = random.Random(3)
    _requests, matchers, _, table, tokens = _walk_case(rng, smollm2, 8, with_absent=False)
    rows = np.zeros((len(tokens), smollm2.words), dtype=np.int32)
    stops = np.array([smollm2.eos], dtype=np.int64)
    inside = False
    seen = 0
    stop = False

    def watch():  # hands the GIL back at every turn, so the walking thread never waits long
        nonlocal seen
        while not stop:
            if inside:
                seen += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        sys.setswitchinterval(1000.0)
        for _ in range(2000):
            inside = True
            native.walk_chains(rows, tokens, table, matchers, smollm2.size, stops, 0)
            inside = False
            if seen:
                break
    finally:
        sys.setswitchinterval(interval)
        stop = True
        watcher.join(600)
    assert seen > 0


@compiled_only
def test_malformed_calls_are_refused_before_xgrammar(smollm2):
    matcher = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    probe_xgrammar(matcher, smollm2.words)
    rows = np.zeros((2, smollm2.words), dtype=np.int32)
    tokens = np.zeros(2, dtype=np.int64)
    stops = np.zeros(0, dtype=np.int64)
    table = np.array([[0, 0, 2]], dtype=np.int64)
    for bad in ([[1, 0, 2]], [[0, 1, 2]], [[0, 0, 0]], [[0, 0, 2, 0]]):
        with pytest.raises(ValueError, match="spans out of bounds or malformed"):
            native.walk_chains(rows, tokens, np.array(bad, dtype=np.int64), [matcher], 64, stops, 0)
    stranger = xgr.GrammarMatcher(smollm2.grammars["json_schema"])  # never probed
    for who in (stranger, object(), smollm2.grammars["json_schema"], 0):
        with pytest.raises(TypeError, match=r"matchers\[0\] is not an xgrammar matcher"):
            native.walk_chains(rows, tokens, table, [who], 64, stops, 0)
    with pytest.raises(TypeError, match="one entry per span"):
        native.walk_chains(rows, tokens, table, [matcher, matcher], 64, stops, 0)
    for bad in ([(0, 0)], [[0, 0, 2]], [(1, 0, 2)], [(0, 0, 2.0)], [(0, 0, True)]):  # lists
        with pytest.raises(ValueError, match="spans out of bounds or malformed"):
            native.walk_chains(rows, tokens, bad, [matcher], 64, stops, 0)
    with pytest.raises(TypeError, match="valid must be"):
        native.walk_chains(rows, tokens, table, [matcher], 64, stops, 0, np.zeros(3, dtype=bool))
    with pytest.raises(TypeError, match="seconds must"):
        native.walk_chains(
            rows, tokens, table, [matcher], 64, stops, 0, None, np.zeros(1, dtype=np.float32)
        )
    with pytest.raises(TypeError, match="rows must be a 2-D int32 array"):
        native.walk_chains(rows.astype(np.int64), tokens, table, [matcher], 64, stops, 0)
    with pytest.raises(ValueError, match="differ in length"):
        native.xgrammar_traverse(matcher, *_links(2), np.zeros(3, np.int64), rows)
    cycle = np.array([1, 0], np.int64), np.full(2, -1, np.int64)
    with pytest.raises(ValueError, match="do not form a tree"):
        native.xgrammar_traverse(matcher, *cycle, np.zeros(2, np.int64), rows)
    assert native.xgrammar_traverse(stranger, *_links(2), np.zeros(2, np.int64), rows) is None
    assert not matcher.is_terminated() and matcher_state(
        matcher, [0, 90], smollm2.words
    ) == matcher_state(xgr.GrammarMatcher(smollm2.grammars["json_schema"]), [0, 90], smollm2.words)


@compiled_only
def test_an_xgrammar_error_names_its_chain_and_moves_no_matcher(smollm2, monkeypatch):
    """Facts that give a width xgrammar does not take (as if the table lied): xgrammar refuses,
    the failing chain is named with xgrammar's message, and the matchers stay in their
    states."""
    rng = random.Random(5)
    _requests, matchers, _, table, tokens = _walk_case(rng, smollm2, 3, with_absent=False)
    probes = [0, 90, 1000]
    before = [matcher_state(m, probes, smollm2.words) for m in matchers]
    for m in matchers:
        ref, handle, words, vocab, stops = chain_facts[id(m)]
        monkeypatch.setitem(chain_facts, id(m), (ref, handle, words + 1, vocab, stops))
    rows = np.zeros((len(tokens), smollm2.words + 1), dtype=np.int32)
    live = [b for b, m in enumerate(matchers) if not m.is_terminated()]
    _checked, _rejected, failed, message = native.walk_chains(
        rows, tokens, table, matchers, smollm2.size, np.zeros(0, np.int64), 0
    )
    assert failed == live[0] and isinstance(message, str) and message
    assert [matcher_state(m, probes, smollm2.words) for m in matchers] == before
    with pytest.raises(RuntimeError):
        native.xgrammar_traverse(matchers[live[0]], *_links(1), np.zeros(1, np.int64), rows[:1])


def test_an_unknown_signature_keeps_the_python_binding(smollm2, monkeypatch):
    """A matcher type whose methods say something the helper does not expect is not bound
    (and ``PORTABLE_SPEC_XGRAMMAR_FFI=0`` declines too): no handle, xgrammar's binding walks."""
    matcher = xgr.GrammarMatcher(smollm2.grammars["json_schema"])
    monkeypatch.setattr(native_module, "_bound_types", {})
    monkeypatch.setitem(native_module._XGRAMMAR_METHODS, "is_terminated", ["int"])
    assert native_module.xgrammar_handle(matcher) == 0
    monkeypatch.setattr(native_module, "_bound_types", {})
    monkeypatch.setitem(native_module._XGRAMMAR_METHODS, "is_terminated", [])
    monkeypatch.setenv("PORTABLE_SPEC_XGRAMMAR_FFI", "0")
    assert native_module.xgrammar_handle(matcher) == 0
    rows = np.zeros((2, smollm2.words), dtype=np.int32)
    native_module.traverse_xgrammar(matcher, *_links(2), np.array([0, 90], np.int64), rows)
    assert (rows[0] != 0).any()


@compiled_only
@pytest.mark.parametrize("direct", [True, False])
def test_small_builds_take_one_call_or_walk_each(smollm2, monkeypatch, direct):
    """The small-call path of build_host_bitmask: one helper call (``span_masks``) when every
    matcher has a handle, else request after request through xgrammar's binding (the table's
    ``inline`` row); the rows and valid flags are the replay's."""
    from _short_path import spy_routes

    if not direct:
        monkeypatch.setattr(native_module, "_bound_helper", [None])  # as if never bound
    taken = spy_routes(monkeypatch)
    calls = {"one call": 0, "inline": 0}
    counted = dict(calls)
    rng = random.Random(20)
    for _ in range(4):
        batch, k = rng.randrange(1, 5), rng.randrange(1, 5)
        pairs = [_random_chain(rng, smollm2, k) for _ in range(batch)]
        chains = np.array(
            [[0, *[max(t, -1) for t in d], *[-1] * (k - len(d))] for _, d in pairs], dtype=np.int64
        )
        chains[chains < 0] = smollm2.size + 5  # out of range: refused, never a padding link
        matchers = [request.native() for request, _ in pairs]
        for m in matchers:
            ps.build_host_bitmask(
                [m], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)), smollm2.size
            )
        taken.clear()  # the probing builds above take the general path
        mask, valid = ps.build_host_bitmask(
            matchers, ps.GrammarTree.from_linear_chain(chains), smollm2.size, return_valid=True
        )
        for name in calls:
            counted[name] += taken.count(name)
        nt, ns = _links(k + 1)
        for b, (request, _) in enumerate(pairs):
            dt = chains[b].tolist()
            want = expected_rows(
                request.fresh, nt.tolist(), ns.tolist(), dt, smollm2.size, smollm2.words
            )
            np.testing.assert_array_equal(mask[b * (k + 1) : (b + 1) * (k + 1)], want)
            assert valid[b].tolist() == expected_accepted(
                request.fresh, nt.tolist(), ns.tolist(), dt, smollm2.size, smollm2.words
            )
    assert counted == ({"one call": 4, "inline": 0} if direct else {"one call": 0, "inline": 4})


@compiled_only
@pytest.mark.parametrize("packed", [False, True])
def test_small_chain_trees_in_one_call_match_the_replay(smollm2, monkeypatch, packed):
    """Chain trees (``from_linear_chain``, ``from_packed_chains``) of probed matchers, a
    terminated one among them: one ``span_masks`` call gives the replay's rows, valid flags
    and node counts, into ``out`` or a new array; slow walks are counted and logged."""
    from portable_spec.stats import (
        get_slow_grammar_threshold,
        reset_grammar_stats,
        set_slow_grammar_threshold,
    )

    taken = []
    walk = native_module.span_masks

    def spy(*args):
        done = walk(*args)
        taken.append(done is not None)
        return done

    monkeypatch.setattr(native_module, "span_masks", spy)
    rng = random.Random(30 + packed)
    threshold = get_slow_grammar_threshold()
    try:
        for trial in range(4):
            batch, k = rng.randrange(1, 6), rng.randrange(1, 6)
            pairs = [_random_chain(rng, smollm2, k) for _ in range(batch)]
            if trial % 2:
                pairs[rng.randrange(batch)] = (_terminated_request(smollm2), [3])
            requests = [request for request, _ in pairs]
            rows = [[0, *[t if t >= 0 else smollm2.size + 5 for t in d]] for _, d in pairs]
            if not packed:
                rows = [r + [smollm2.size + 5] * (k + 1 - len(r)) for r in rows]
            width = max(len(r) for r in rows)
            matchers = [request.native() for request in requests]
            for m in matchers:  # the library's first look: the general path probes each
                ps.build_host_bitmask(
                    [m], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)), smollm2.size
                )
            if packed:
                offsets = np.cumsum([0, *map(len, rows)])
                tree = ps.GrammarTree.from_packed_chains(
                    np.array([t for r in rows for t in r], dtype=np.int64), offsets
                )
            else:
                tree = ps.GrammarTree.from_linear_chain(np.array(rows, dtype=np.int64))
            out = None if trial < 2 else np.zeros((tree.rows, smollm2.words), dtype=np.int32)
            set_slow_grammar_threshold(1e-12 if trial == 3 else None)
            reset_grammar_stats()
            taken.clear()
            mask, valid = ps.build_host_bitmask(
                matchers, tree, smollm2.size, out=out, return_valid=True
            )
            assert taken == [True]
            assert out is None or mask is out
            flat = valid.reshape(-1).tolist()
            row = 0
            next_token = np.full((batch, width), -1, dtype=np.int64)
            draft = np.full((batch, width), -1, dtype=np.int64)
            for b, (request, tokens) in enumerate(zip(requests, rows, strict=True)):
                nt, ns = _links(len(tokens))
                next_token[b, : len(tokens)] = nt
                draft[b, : len(tokens)] = tokens
                args = (request.fresh, nt.tolist(), ns.tolist(), tokens, smollm2.size)
                want = expected_rows(*args, smollm2.words)
                np.testing.assert_array_equal(mask[row : row + len(tokens)], want)
                assert flat[row : row + len(tokens)] == expected_accepted(*args, smollm2.words)
                row += len(tokens)
            assert valid.shape == ((row,) if packed else (batch, k + 1))
            stats = ps.grammar_stats()
            counts = expected_node_counts(
                requests, next_token, np.full_like(next_token, -1), draft, smollm2.size,
                smollm2.words,
            )  # fmt: skip
            assert (stats["checked_nodes"], stats["rejected_nodes"]) == counts
            assert (stats["builds"], stats["rows"], stats["requests"]) == (1, row, batch)
            assert stats["slow_requests"] == (batch if trial == 3 else 0)
    finally:
        set_slow_grammar_threshold(threshold)


@compiled_only
def test_large_chain_batches_are_walked_in_parts_on_the_pool(smollm2, monkeypatch):
    """Chains past the parallel bound are cut into parts walked at once on the pool; every
    row, flag and unconstrained request is as the replay says."""
    from portable_spec.builder import jobs

    parts = []
    cuts = jobs._balanced_cuts

    def spy(lengths, count):
        parts.append(cuts(lengths, count))
        return parts[-1]

    monkeypatch.setattr(jobs, "_balanced_cuts", spy)
    parts_from = routes.work(48, smollm2.words)  # parts at this small size
    monkeypatch.setattr(routes, "ONE_THREAD_WORK", parts_from)
    rng = random.Random(30)
    k = 4
    pairs = [_random_chain(rng, smollm2, k) for _ in range(24)]
    chains = np.array(
        [[0, *d, *[smollm2.size + 1] * (k - len(d))] for _, d in pairs], dtype=np.int64
    )
    chains[chains < 0] = smollm2.size + 2
    matchers = [None if b % 7 == 3 else request.native() for b, (request, _) in enumerate(pairs)]
    for m in matchers:
        if m is not None:
            ps.build_host_bitmask(
                [m], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)), smollm2.size
            )
    previous = ps.get_num_threads()
    ps.set_num_threads(2)
    try:
        mask, valid = ps.build_host_bitmask(
            matchers, ps.GrammarTree.from_linear_chain(chains), smollm2.size, return_valid=True
        )
    finally:
        ps.set_num_threads(previous)
    assert routes.work(len(chains) * (k + 1), smollm2.words) >= parts_from
    assert len(parts) == 1 and len(parts[0]) == 3 and parts[0][0] == 0 and parts[0][-1] == 24
    nt, ns = _links(k + 1)
    for b, (request, _) in enumerate(pairs):
        dt = chains[b].tolist()
        fresh = None if matchers[b] is None else request.fresh
        want = expected_rows(fresh, nt.tolist(), ns.tolist(), dt, smollm2.size, smollm2.words)
        np.testing.assert_array_equal(
            mask[b * (k + 1) : (b + 1) * (k + 1)], want, err_msg=f"request {b}"
        )
        assert valid[b].tolist() == expected_accepted(
            fresh, nt.tolist(), ns.tolist(), dt, smollm2.size, smollm2.words
        )


@compiled_only
def test_a_refusal_in_a_later_part_names_its_request(smollm2, monkeypatch):
    """The parts report chain indices of the whole table: xgrammar refusing the rows of the
    first live chain in the second part names that chain."""
    from portable_spec.builder import jobs

    matchers = [xgr.GrammarMatcher(smollm2.grammars["json_schema"]) for _ in range(12)]
    for m in matchers:  # facts that give a width xgrammar refuses (as if the table lied)
        probe_xgrammar(m, smollm2.words)
        ref, handle, words, vocab, stops = chain_facts[id(m)]
        monkeypatch.setitem(chain_facts, id(m), (ref, handle, words + 1, vocab, stops))
    n = 5
    table = np.array([(b * n, b * n, n) for b in range(12)], dtype=np.int64)
    tokens = np.zeros(12 * n, dtype=np.int64)
    rows = np.zeros((12 * n, smollm2.words + 1), dtype=np.int32)
    previous = ps.get_num_threads()
    ps.set_num_threads(2)
    try:
        with pytest.raises(ps.MatcherError) as raised:
            jobs.walk_chain_table(
                rows, tokens, table, [None] * 6 + matchers[6:], smollm2.size,
                np.zeros(0, np.int64), None, 2,
            )  # fmt: skip
    finally:
        ps.set_num_threads(previous)
    assert raised.value.request_index == 6


def test_both_schema_forms_of_xgrammar_are_read():
    """xgrammar 0.2.9 describes its methods with named parameters, 0.2.8 (vLLM 0.32's pin)
    positionally, the return first: both read as the same signature; others give nothing."""
    matcher = "xgrammar.tvm_ffi_binding.GrammarMatcher"
    named = (
        '{"type":"ffi.Function","named_args":{"return":[{"type":"bool"}],"params":[{"type":"'
        + matcher
        + '"},{"type":"Any"},{"type":"Any"},{"type":"Any"},{"type":"Any"},{"type":"float"},'
        '{"type":"Any"}]}}'
    )
    positional = (
        '{"type":"ffi.Function","args":[{"type":"bool"},{"type":"'
        + matcher
        + '"},{"type":"Any"},{"type":"Any"},{"type":"Any"},{"type":"Any"},{"type":"float"},'
        '{"type":"Any"}]}'
    )
    want = ([matcher, "Any", "Any", "Any", "Any", "float", "Any"], ["bool"])
    assert native_module._signature(json.loads(named)) == want
    assert native_module._signature(json.loads(positional)) == want
    assert native_module._signature({}) == ([], [])


@compiled_only
@pytest.mark.parametrize("parts", [1, 2])
def test_trees_walked_by_one_call_match_the_oracle(smollm2, monkeypatch, parts):
    """A batch of xgrammar trees (four grammars, an unconstrained request, a terminated
    matcher, unreachable padding) is walked and repaired by the compiled tree walker, in one
    call or in two parts on the pool: rows and valid flags as the replay says, matchers back
    in their state."""
    from _cases import matrix_case
    from _oracle import expected_valid

    requests, nt, ns, dt, _ = matrix_case(smollm2, 8, 6)
    requests[3] = _terminated_request(smollm2)
    matchers = [None if r is None else r.native() for r in requests]
    if not native_module.xgrammar_handle(matchers[0]):
        pytest.skip("xgrammar's methods cannot be called through tvm-ffi's C ABI here")
    calls = []
    walk = native_module.walk_trees

    def spy(*args):
        calls.append(len(args[4]))
        return walk(*args)

    monkeypatch.setattr(native_module, "walk_trees", spy)
    monkeypatch.setattr(routes, "ONE_THREAD_WORK", 1 if parts == 2 else 10**18)
    previous = ps.get_num_threads()
    ps.set_num_threads(2)
    probes = list(range(0, smollm2.size, 1013))
    before = [None if m is None else matcher_state(m, probes, smollm2.words) for m in matchers]
    try:
        mask, valid = ps.build_host_bitmask(
            matchers, ps.GrammarTree.from_host(nt, ns, dt), smollm2.size, return_valid=True
        )
    finally:
        ps.set_num_threads(previous)
    assert sorted(calls) == ([8] if parts == 1 else [4, 4])
    want = expected_mask(requests, nt, ns, dt, smollm2.size, smollm2.words)
    np.testing.assert_array_equal(mask, want)
    want_valid = expected_valid(requests, nt, ns, dt, smollm2.size, smollm2.words)
    np.testing.assert_array_equal(valid, want_valid)
    after = [None if m is None else matcher_state(m, probes, smollm2.words) for m in matchers]
    assert after == before
