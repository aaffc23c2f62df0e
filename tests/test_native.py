"""The compiled helper refuses bad buffers with Python errors (never a crash); every entry of
``portable_spec.native``, compiled or numpy/Python, agrees with a reference on random rows."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import portable_spec.native as native_module
from portable_spec.native import native
from portable_spec.topology import validate_links

compiled_only = pytest.mark.skipif(native is None, reason="portable_spec._native is not built here")


@compiled_only
def test_links_valid_rejects_bad_buffers():
    good = np.array([[1, -1]], dtype=np.int64)
    with pytest.raises(TypeError, match="next_token must be a 2-D int64 array"):
        native.links_valid(good.astype(np.int32), good)
    with pytest.raises(TypeError, match="C-contiguous"):
        native.links_valid(np.zeros((2, 4), np.int64)[:, ::2], good)
    with pytest.raises(TypeError):
        native.links_valid("not a buffer", good)
    with pytest.raises(ValueError, match="one shape"):
        native.links_valid(good, np.array([[1, -1, -1]], dtype=np.int64))
    assert native.links_valid(good, np.array([[-1, -1]], dtype=np.int64)) is True


@compiled_only
def test_repair_rows_rejects_bad_buffers():
    rows = np.zeros((3, 2), np.int32)
    links = np.array([1, 2, -1], dtype=np.int64)
    none = np.full(3, -1, dtype=np.int64)
    stops = np.array([2], dtype=np.int64)
    with pytest.raises(TypeError, match="rows must be a C-contiguous writable buffer"):
        ro = rows.copy()
        ro.flags.writeable = False
        native.repair_rows(ro, links, none, links, 64, stops, 1)
    with pytest.raises(ValueError, match="inconsistent shapes or limit"):
        native.repair_rows(rows, links[:2], none, links, 64, stops, 1)
    with pytest.raises(ValueError, match="inconsistent shapes or limit"):
        native.repair_rows(rows, links, none, links, 65, stops, 1)  # past 32 * words


def test_repair_rows_against_a_reference(builder_mode):
    """Random chains and rows: rows of kept nodes untouched, every other row -1, the counts
    and the valid flags as the reference says (the compiled helper and the numpy/Python
    implementation behind the entry)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, words = int(rng.integers(1, 12)), int(rng.integers(1, 4))
        rows = rng.integers(-(2**31), 2**31, (n, words), dtype=np.int64).astype(np.int32)
        original = rows.copy()
        nt = np.append(np.arange(1, n), -1).astype(np.int64)
        ns = np.full(n, -1, dtype=np.int64)
        limit = int(rng.integers(1, 32 * words + 1))
        dt = rng.integers(-3, limit + 3, n).astype(np.int64)
        stops = np.array([int(rng.integers(0, limit))], dtype=np.int64)
        root = int(rng.integers(-1, 2))
        root_ok = bool(original[0].any()) if root == -1 else bool(root)
        keep = [root_ok]
        allowed = [True]
        checked = rejected = 0
        for j in range(1, n):
            t = int(dt[j])
            bit = 0 <= t < limit and (int(original[j - 1, t >> 5]) >> (t & 31)) & 1
            allowed.append(bit)
            if keep[-1]:
                checked += 1
                rejected += not bit
            keep.append(keep[-1] and bool(bit) and t != stops[0])
        accepted = [True] + [keep[j - 1] and bool(allowed[j]) for j in range(1, n)]
        if builder_mode == "native":  # the compiled helper itself also counts the kept rows
            raw = original.copy()
            assert native.repair_rows(raw, nt, ns, dt, limit, stops, root) == (
                sum(keep),
                checked,
                rejected,
            )
        valid = np.zeros(n, dtype=bool)
        counts = native_module.repair_rows(rows, (nt, ns, dt), limit, stops, root, valid)
        assert counts == (checked, rejected)
        assert valid.tolist() == accepted
        for j in range(n):
            want = original[j] if keep[j] else np.full(words, -1, np.int32)
            np.testing.assert_array_equal(rows[j], want)


def _chain_reference(rows, chain, live, limit, stops, repeat):
    """The rows of one chain after repair, by a plain loop: kept up to the first draft out of
    range, not allowed by the row before it, or a stop token; later rows all-allowed, or the
    row before a refused draft with ``repeat``."""
    rows = rows.copy()
    first, refused = 0, False
    if live:
        for first in range(1, len(chain) + 1):
            if first == len(chain):
                break
            t = int(chain[first])
            word = int(rows[first - 1, t // 32]) if 0 <= t < limit else 0
            if not (word >> (t % 32)) & 1:
                refused = True
                break
            if t in stops:
                break
    for v in range(first, len(chain)):
        rows[v] = rows[first - 1] if repeat and refused else -1
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_repair_chains_against_a_reference(seed):
    """Many chains in one call (strided rows, gaps, dead matchers, stop tokens, tokens out of
    range or refused): every chain's rows as the plain loop says, rows outside the spans
    untouched, both with and without vLLM's repeat rule."""
    rng = np.random.default_rng(seed)
    words = 3
    limit = words * 32 - int(rng.integers(0, 5))
    stops = [int(s) for s in rng.choice(limit, 2, replace=False)]
    chains, spans, row = [], [], 0
    for _ in range(int(rng.integers(1, 9))):
        n = int(rng.integers(1, 7))
        chain = rng.integers(-2, words * 32 + 3, size=n)
        spans.append((row, sum(map(len, chains)), n, int(rng.random() < 0.85)))
        chains.append(chain)
        row += n + int(rng.integers(0, 3))  # gaps: rows no chain owns
    tokens = np.concatenate(chains).astype(np.int64)
    for repeat in (0, 1):
        rows = rng.integers(-(2**31), 2**31, size=(row + 1, words), dtype=np.int32)
        # mostly allowed bits, so that chains run deep
        rows |= rng.integers(-(2**31), 2**31, size=rows.shape, dtype=np.int32)
        want = rows.copy()
        for (r, _t, n, live), chain in zip(spans, chains, strict=True):
            want[r : r + n] = _chain_reference(rows[r : r + n], chain, live, limit, stops, repeat)
        table = np.array(spans, dtype=np.int64)
        native.repair_chains(rows, tokens, table, limit, np.array(stops, np.int64), repeat)
        np.testing.assert_array_equal(rows, want)


def test_repair_chains_checks_spans_before_writing():
    rows = np.zeros((4, 2), np.int32)
    tokens = np.zeros(4, np.int64)
    stops = np.zeros(0, np.int64)
    for bad in ([[0, 0, 5, 1]], [[3, 0, 2, 1]], [[0, 3, 2, 1]], [[0, 0, 0, 1]], [[-1, 0, 1, 1]]):
        with pytest.raises(ValueError, match="spans"):
            native.repair_chains(rows, tokens, np.array(bad, np.int64), 64, stops, 1)
        assert (rows == 0).all()
    with pytest.raises(ValueError):
        native.repair_chains(rows, tokens, np.zeros((1, 3), np.int64), 64, stops, 1)
    with pytest.raises(ValueError):
        native.repair_chains(rows, tokens, np.array([[0, 0, 1, 1]], np.int64), 65, stops, 1)
    with pytest.raises(TypeError):
        native.repair_chains(rows, tokens.astype(np.int32), np.array([[0, 0, 1, 1]]), 64, stops, 1)


@compiled_only
@pytest.mark.parametrize("seed", range(40))
def test_chain_live_agrees_with_numpy(seed):
    """After llguidance's executor: the compiled pass that counts each chain's allowed drafts
    and lists the drafts to decide on a fork equals the numpy pass, on random rows with
    planted sentinels, drafts flagged as end tokens, out-of-range drafts and ended requests;
    bad shapes and row indices are refused with an error."""
    from portable_spec.engines import llguidance as engine

    rng = np.random.default_rng(seed)
    count, nodes, width = int(rng.integers(1, 6)), int(rng.integers(1, 7)), int(rng.integers(1, 5))
    limit = 32 * width
    height = count * nodes + int(rng.integers(0, 3))
    target = rng.integers(-(2**31), 2**31, size=(height, width), dtype=np.int64)
    target = np.where(rng.random(target.shape) < 0.5, target, -1).astype(np.int32)
    rows = rng.permutation(height)[: count * nodes].reshape(count, nodes).astype(np.int64)
    for r in rng.choice(height, size=height // 2, replace=False):  # planted sentinel rows
        target[r, 0], target[r, -1] = engine._SENTINEL
    tokens = rng.integers(-2, limit + 2, size=(count, nodes - 1)).astype(np.int64)
    outside = (tokens < 0) | (tokens >= limit)
    usable = np.zeros(count, dtype=np.int64)
    if nodes > 1:  # each chain's drafts before its first out-of-range one
        usable = np.where(outside.any(axis=1), outside.argmax(axis=1), nodes - 1).astype(np.int64)
    ended = rng.random(count) < 0.2
    ends = rng.random((count, nodes - 1)) < 0.3
    live, checks = native.chain_live(target, rows, tokens, usable, ended, ends, *engine._SENTINEL)
    if nodes > 1:  # (the numpy pass is never asked about chains without drafts)
        want_live, want_checks = engine._live_by_numpy(target, rows, tokens, usable, ended, ends)
        assert live == want_live.tolist()
        assert checks == want_checks
    assert all(not ended[k] and i < live[k] for k, i, _, _ in checks)
    bad = rows.copy()
    bad[0, 0] = height
    with pytest.raises(ValueError, match="outside target"):
        native.chain_live(target, bad, tokens, usable, ended, ends, *engine._SENTINEL)
    with pytest.raises(ValueError, match="tokens"):
        native.chain_live(target, rows, tokens[:, :0].copy() if nodes > 1 else np.zeros((count, 1),
                          np.int64), usable, ended, ends, *engine._SENTINEL)  # fmt: skip
    with pytest.raises(ValueError, match="ends"):
        native.chain_live(target, rows, tokens, usable, ended, np.zeros((count, nodes), bool),
                          *engine._SENTINEL)  # fmt: skip
    with pytest.raises(TypeError, match="ends"):
        native.chain_live(target, rows, tokens, usable, ended, ends.astype(np.int64),
                          *engine._SENTINEL)  # fmt: skip


@compiled_only
def test_the_compiled_builds_keep_nothing(smollm2):
    """Thousands of compiled builds (draft lists, host chains, host trees) leave no memory
    behind: everything a walk allocates (its copies, its times) is freed with it."""
    import gc
    import tracemalloc

    import xgrammar as xgr

    import portable_spec as ps

    matchers = [xgr.GrammarMatcher(smollm2.grammars["json_schema"]) for _ in range(3)]
    chains = np.array([[0, 90, 91]] * 3, np.int64)
    links = np.array([[1, 2, -1]] * 3), np.full((3, 3), -1)
    out = np.empty((9, smollm2.words), np.int32)

    def step():
        ps.build_chain_bitmask(matchers, [[90, 91]] * 3, smollm2.size, out=out)
        ps.build_host_bitmask(matchers, ps.GrammarTree.from_linear_chain(chains), smollm2.size,
                              out=out)  # fmt: skip
        ps.build_host_bitmask(matchers, ps.GrammarTree.from_host(*links, chains), smollm2.size,
                              out=out)  # fmt: skip

    for _ in range(100):
        step()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            step()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 16 * 1024, f"{grown} bytes kept by 6000 builds"


def _verify_parents(next_token: list[int], next_sibling: list[int]) -> list[int] | None:
    """Each verify node's parent by the links (-1: none), None when the links are malformed
    (the library's Python validator): one node at a time."""
    try:
        validate_links(np.array([next_token]), np.array([next_sibling]))
    except ValueError:
        return None
    above = [-1] * len(next_token)
    for p, child in enumerate(next_token):
        while child != -1:
            above[child] = p
            child = next_sibling[child]
    return above


def _same_tree(nt, ns, draft, select, parents, tokens) -> bool:
    """The reference of native.tree_matches for one request, node by node."""
    n = len(parents)
    above = _verify_parents(nt, ns)
    if above is None or any(not -1 <= s < n for s in select):
        return False
    position = {s: j for j, s in enumerate(select) if s >= 0}
    for j, s in enumerate(select):
        mine = -1
        if s >= 0:
            if not -1 <= parents[s] < n:
                return False
            mine = position.get(parents[s], -1) if parents[s] >= 0 else -1
            if j > 0 and tokens[s] != draft[j]:
                return False
        if mine != above[j]:
            return False
    return True


def _drafted_case(rng: np.random.Generator) -> tuple[list[int], ...]:
    """A drafted tree (parents, tokens), a selection of it closed under parents (the root
    first, padding after) and the verify tree's links and tokens as an engine builds them
    (children in a random order)."""
    n = int(rng.integers(1, 14))
    parents = [-1] + [int(rng.integers(-1, v)) for v in range(1, n)]  # -1: a padding slot
    tokens = [0] + [int(rng.integers(0, 6)) for _ in range(1, n)]
    reachable = [0]
    for v in range(1, n):
        if parents[v] in reachable:
            reachable.append(v)
    chosen = [0]
    for v in reachable[1:]:
        if parents[v] in chosen and rng.random() < 0.7:
            chosen.append(v)
    select = chosen + [-1] * int(rng.integers(0, 3))
    m = len(select)
    position = {s: j for j, s in enumerate(select) if s >= 0}
    kids: dict[int, list[int]] = {}
    for j, s in enumerate(select):
        if s > 0:
            kids.setdefault(position[parents[s]], []).append(j)
    nt, ns = [-1] * m, [-1] * m
    for p, children in kids.items():
        order = [int(c) for c in rng.permutation(children)]
        nt[p] = order[0]
        for a, b in itertools.pairwise(order):
            ns[a] = b
    draft = [tokens[s] if s > 0 else int(rng.integers(0, 6)) for s in select]
    return nt, ns, draft, select, parents, tokens


@compiled_only
def test_tree_matches_against_a_reference():
    """Random drafted trees, selections and the verify trees built from them, then spoilt one
    way at a time (a token, a parent link, a malformed link, a selection out of range, a
    padding node linked in): the compiled check agrees with a node-by-node reference on
    each, batches of them included (true only when every request is)."""
    rng = np.random.default_rng(11)
    outcomes = set()
    batch_cases = []
    for trial in range(600):
        nt, ns, draft, select, parents, tokens = _drafted_case(rng)
        m = len(select)
        spoil = trial % 7
        if spoil == 1 and m > 1:
            j = int(rng.integers(1, m))
            draft[j] += 1
        elif spoil == 2 and m > 2:
            a, b = (int(x) for x in rng.choice(np.arange(m), 2, replace=False))
            nt[a], nt[b] = nt[b], nt[a]
        elif spoil == 3:
            nt[int(rng.integers(0, m))] = int(rng.integers(-2, m + 2))
        elif spoil == 4:
            select[int(rng.integers(0, m))] = int(rng.integers(-2, len(parents) + 2))
        elif spoil == 5 and m > 1 and -1 in select:
            j = select.index(-1)
            ns[j], nt[0] = nt[0], j  # padding made the root's first child
        elif spoil == 6:
            v = int(rng.integers(0, len(parents)))
            parents[v] = int(rng.integers(-3, len(parents) + 3))
        want = _same_tree(nt, ns, draft, select, parents, tokens)
        arrays = [np.array([x], dtype=np.int64) for x in (nt, ns, draft, select, parents, tokens)]
        assert native.tree_matches(*arrays) is want, (trial, nt, ns, draft, select, parents)
        outcomes.add((spoil, want))
        batch_cases.append((arrays, want))
    assert {want for _, want in outcomes} == {True, False}
    assert sum(1 for spoil, want in outcomes if not want) >= 6  # each spoiling seen to fail
    for start in range(0, 60, 4):  # batches of four trees of one shape: padded to one width
        group = batch_cases[start : start + 4]
        m = max(a[0].shape[1] for a, _ in group)
        n = max(a[4].shape[1] for a, _ in group)
        padded = []
        for arrays, _ in group:
            nt, ns, draft, select, parents, tokens = (a[0].tolist() for a in arrays)
            extra_m, extra_n = m - len(nt), n - len(parents)
            padded.append(
                [
                    nt + [-1] * extra_m,
                    ns + [-1] * extra_m,
                    draft + [0] * extra_m,
                    select + [-1] * extra_m,
                    parents + [-1] * extra_n,
                    tokens + [0] * extra_n,
                ]
            )
        want = all(_same_tree(*case) for case in padded)
        stacked = [np.array([case[i] for case in padded], dtype=np.int64) for i in range(6)]
        assert native.tree_matches(*stacked) is want


@compiled_only
def test_tree_matches_rejects_bad_buffers():
    one = np.array([[-1]], dtype=np.int64)
    with pytest.raises(TypeError, match="select must be a 2-D int64 array"):
        native.tree_matches(one, one, one, one.astype(np.int32), one, one)
    with pytest.raises(ValueError, match="tree_matches"):
        native.tree_matches(one, np.array([[-1, -1]], np.int64), one, one, one, one)
    with pytest.raises(ValueError, match="need a root"):
        empty = np.zeros((1, 0), np.int64)
        native.tree_matches(one, one, one, one, empty, empty)
    assert native.tree_matches(one, one, one, np.zeros((1, 1), np.int64), one, one) is True


def _selection_ok(select: list[int], parents: list[int], n: int) -> bool:
    """The reference of native.selection_valid for one request, node by node."""
    if not select or select[0] != 0 or any(not -1 <= s < n for s in select):
        return False
    chosen = [s for s in select if s >= 0]
    if len(set(chosen)) != len(chosen):
        return False
    return all(parents[s] < 0 or parents[s] in chosen for s in chosen[1:])


@compiled_only
def test_selection_valid_against_a_reference():
    """Random drafted trees and selections of them, closed under parents or spoilt (a node
    twice, one out of range, a parent left out, the root missing), one request at a time
    and in batches: the compiled check agrees with a node-by-node reference."""
    rng = np.random.default_rng(5)
    seen = set()
    for trial in range(800):
        batch = 1 + trial % 3
        capacity = int(rng.integers(1, 12))
        n = int(rng.integers(1, capacity + 1))
        m = int(rng.integers(1, 8))
        parents = np.full((batch, capacity), -1, np.int64)
        select = np.full((batch, m), -1, np.int64)
        for b in range(batch):
            parents[b, 1:n] = [int(rng.integers(-1, v)) for v in range(1, n)]
            chosen = [0]
            for v in range(1, n):
                if parents[b, v] in chosen and len(chosen) < m and rng.random() < 0.6:
                    chosen.append(v)
            select[b, : len(chosen)] = chosen
            spoil = int(rng.integers(0, 6))
            if spoil == 1 and m > 1:
                select[b, int(rng.integers(1, m))] = select[b, int(rng.integers(0, m))]
            elif spoil == 2:
                select[b, int(rng.integers(0, m))] = int(rng.integers(-3, n + 3))
            elif spoil == 3 and len(chosen) > 1:
                select[b, int(rng.integers(1, len(chosen)))] = -1
            elif spoil == 4:
                select[b, 0] = int(rng.integers(-1, n))
        want = all(_selection_ok(list(select[b]), list(parents[b]), n) for b in range(batch))
        assert native.selection_valid(select, parents, n) is want, (select, parents, n)
        seen.add(want)
    assert seen == {True, False}
    with pytest.raises(ValueError, match="selection_valid"):
        native.selection_valid(select, parents, capacity + 1)
    with pytest.raises(TypeError, match="select must be a 2-D int64 array"):
        native.selection_valid(select.astype(np.int32), parents, 1)
