"""The compact layout on the host: the entries the per-node replay oracle lists, for every
engine, walk path (lists, arrays, splits), with and without the compiled helper; static
capacity; refusals; the apply of a compact mask equals the dense one's."""

from __future__ import annotations

import numpy as np
import pytest
from _cases import draw_case
from _oracle import (
    ProtocolMatcher,
    Request,
    assert_compact_matches,
    expected_compact,
    expected_mask,
    expected_node_counts,
    expected_valid,
    matcher_state,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_spec as ps
import portable_spec.builder.routes as routes
import portable_spec.native as native_module
import portable_spec.topology as topology_module
from portable_spec.masks import compact_views, index_words
from portable_spec.stats import reset_grammar_stats

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _prints(case, vocab):
    probe = [vocab.eos, 0, 1, 2, 100, 1000]
    out = []
    for m in case.matchers:
        inner = m.inner if isinstance(m, ProtocolMatcher) else m
        out.append(None if m is None else matcher_state(inner, probe, vocab.words))
    return out


@pytest.mark.parametrize("path", ["lists", "arrays"])
@SETTINGS
@given(data=st.data())
def test_compact_matches_oracle(vocab, path, builder_mode, data):
    """Random trees, padding, off-grammar/EOS/out-of-range drafts, padded vocabularies,
    xgrammar and protocol matchers: exactly the oracle's entries, rows ascending, bits equal,
    node counts equal, matchers restored; with max_rows, padding that applies to nothing."""
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone after each example
        if path == "arrays":
            monkeypatch.setattr(topology_module, "SMALL_TREE_ROWS", 0)
        monkeypatch.setattr(routes, "POOL_WORK", data.draw(st.sampled_from([0, routes.POOL_WORK])))
        case = draw_case(data, vocab)
        before = _prints(case, vocab)
        tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
        max_rows = data.draw(st.sampled_from([None, case.next_token.size]), label="max_rows")
        return_valid = data.draw(st.booleans(), label="return_valid")
        reset_grammar_stats()
        mask = ps.build_host_bitmask(
            case.matchers,
            tree,
            case.vocab_size,
            layout="compact",
            max_rows=max_rows,
            return_valid=return_valid,
        )
        arrays = (case.next_token, case.next_sibling, case.draft)
        if return_valid:  # the accepted nodes, as the dense layout reports them
            mask, valid = mask
            want = expected_valid(case.requests, *arrays, case.vocab_size, vocab.words)
            np.testing.assert_array_equal(valid, want)
        assert_compact_matches(case, vocab.words, mask)
        if mask is not None:
            assert mask.num_rows == case.next_token.size
            assert mask.capacity == (mask.count if max_rows is None else max_rows)
            real = mask.rows[: mask.count]
            assert (np.diff(real) > 0).all()  # strictly ascending
            stats = ps.grammar_stats()
            want = expected_node_counts(case.requests, *arrays, case.vocab_size, vocab.words)
            assert (stats["checked_nodes"], stats["rejected_nodes"]) == want
        assert _prints(case, vocab) == before
        for m in case.matchers:
            if isinstance(m, ProtocolMatcher):
                assert m.depth == 0


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_compact_split_walks_match_oracle(vocab, builder_mode, data, monkeypatch):
    """Small batches of big trees are cut over threads: the same entries."""
    split_nodes = data.draw(st.sampled_from([2, 8]))  # trees of at least this many nodes
    monkeypatch.setattr(routes, "SPLIT_WORK", routes.work(split_nodes, vocab.words))
    part_nodes = data.draw(st.sampled_from([1, 3]))  # subtrees of at least this many nodes
    monkeypatch.setattr(routes, "SPLIT_PART_WORK", routes.work(part_nodes, vocab.words))
    ps.set_num_threads(data.draw(st.sampled_from([2, 4, 8]), label="threads"))
    try:
        case = draw_case(data, vocab, max_batch=2, max_nodes=40, protocol=False)
        before = _prints(case, vocab)
        tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
        mask = ps.build_host_bitmask(case.matchers, tree, case.vocab_size, layout="compact")
        assert_compact_matches(case, vocab.words, mask)
        assert _prints(case, vocab) == before
    finally:
        ps.set_num_threads(None)


def test_compact_equals_dense_on_a_large_batch(smollm2, builder_mode):
    """64 requests of 24-node trees through the pool (requests finish out of order and park
    their rows): the compact mask expands to the dense one, bit for bit."""
    rng = np.random.default_rng(4)
    compiled = smollm2.grammars["builtin_json"]
    opening = [smollm2.tokens.index(t) for t in ("{", "[", '"', "1", "Ġ", "}", "]")]
    batch, nodes = 64, 24
    parents = [-1] + [int(rng.integers(0, j)) for j in range(1, nodes)]
    nt = np.full(nodes, -1, np.int64)
    ns = np.full(nodes, -1, np.int64)
    last = [-1] * nodes
    for v in range(1, nodes):
        p = parents[v]
        if last[p] == -1:
            nt[p] = v
        else:
            ns[last[p]] = v
        last[p] = v
    dt = rng.choice(opening, size=(batch, nodes)).astype(np.int64)
    requests = [None if b % 5 == 3 else Request(compiled) for b in range(batch)]
    tree = ps.GrammarTree.from_host(np.tile(nt, (batch, 1)), np.tile(ns, (batch, 1)), dt)
    dense = ps.build_host_bitmask(
        [None if r is None else r.fresh() for r in requests], tree, smollm2.size
    )
    matchers = [None if r is None else r.fresh() for r in requests]
    mask = ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact")
    np.testing.assert_array_equal(mask.to_dense(), dense)
    assert mask.count == int((dense != -1).any(axis=1).sum())


def test_max_rows_padding_and_overflow(smollm2):
    """max_rows fixes the entry count: padding entries carry row num_rows (they apply to
    nothing); too small a bound is refused after the walks, every matcher restored."""
    compiled = smollm2.grammars["builtin_json"]
    brace, quote = smollm2.tokens.index("{"), smollm2.tokens.index('"')
    dt = np.tile([0, brace, quote], (3, 1))
    requests = [Request(compiled), None, Request(compiled)]
    tree = ps.GrammarTree.from_linear_chain(dt)
    mask = ps.build_host_bitmask(
        [r and r.fresh() for r in requests], tree, smollm2.size, layout="compact", max_rows=9
    )
    assert (mask.count, mask.capacity, mask.num_rows) == (6, 9, 9)
    assert mask.rows.tolist() == [0, 1, 2, 6, 7, 8, 9, 9, 9]
    np.testing.assert_array_equal(
        mask.to_dense(),
        expected_mask(requests, *tree.resolve(), smollm2.size, smollm2.words),
    )
    matchers = [r and r.fresh() for r in requests]
    probe = [0, brace, quote, 100]
    before = [m and matcher_state(m, probe, smollm2.words) for m in matchers]
    with pytest.raises(ValueError, match=r"lists 6 rows .* max_rows = 5"):
        ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact", max_rows=5)
    assert [m and matcher_state(m, probe, smollm2.words) for m in matchers] == before


def test_compact_into_out(smollm2):
    """out= takes a CompactMask of numpy arrays with room for every possible row; the result
    is made of views of it."""
    compiled = smollm2.grammars["builtin_json"]
    dt = np.tile([0, smollm2.tokens.index("["), smollm2.tokens.index("1")], (2, 1))
    tree = ps.GrammarTree.from_linear_chain(dt)
    words = smollm2.words
    block = np.full((6 + index_words(6, words), words), 7, dtype=np.int32)
    rows, bits = compact_views(block, 6)
    out = ps.CompactMask(rows, bits, 6)
    matchers = [xgr_matcher(compiled) for _ in range(2)]
    mask = ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact", out=out)
    assert np.shares_memory(mask.bits, block) and np.shares_memory(mask.rows, block)
    assert mask.count == 6 and mask.rows.tolist() == list(range(6))
    want = expected_compact([Request(compiled)] * 2, *tree.resolve(), smollm2.size, smollm2.words)
    np.testing.assert_array_equal(mask.bits, want[1])


def xgr_matcher(compiled):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def test_bad_layout_arguments_are_refused_before_anything_moves(smollm2):
    compiled = smollm2.grammars["builtin_json"]
    matchers = [ProtocolMatcher(xgr_matcher(compiled))]
    tree = ps.GrammarTree.from_linear_chain(np.zeros((1, 3), np.int64))
    with pytest.raises(ValueError, match="layout must be one of 'dense', 'compact'"):
        ps.build_host_bitmask(matchers, tree, smollm2.size, layout="sparse")
    with pytest.raises(ValueError, match="needs layout='compact'"):
        ps.build_host_bitmask(matchers, tree, smollm2.size, max_rows=3)
    with pytest.raises(TypeError, match="max_rows must be an int"):
        ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact", max_rows=2.0)
    with pytest.raises(ValueError, match="max_rows must be >= 0"):
        ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact", max_rows=-1)
    with pytest.raises(TypeError, match="CompactMask of numpy arrays"):
        ps.build_host_bitmask(
            matchers, tree, smollm2.size, layout="compact", out=np.zeros((3, smollm2.words))
        )
    small = ps.CompactMask(np.zeros(2, np.int32), np.zeros((2, smollm2.words), np.int32), 3)
    with pytest.raises(ValueError, match="room for 2 rows"):
        ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact", out=small)
    narrow = ps.CompactMask(np.zeros(3, np.int32), np.zeros((3, 4), np.int32), 3)
    with pytest.raises(ValueError, match="words per row"):
        ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact", out=narrow)
    assert matchers[0].calls == []


def test_no_grammar_gives_none(smollm2):
    tree = ps.GrammarTree.from_linear_chain(np.zeros((2, 3), np.int64))
    assert ps.build_host_bitmask([None, None], tree, smollm2.size, layout="compact") is None


def test_narrow_matcher_rows_are_zero_past_its_width(smollm2):
    """A protocol matcher with its own (smaller) vocabulary: the words past its width are 0 in
    the listed rows, as in the dense layout."""
    compiled = smollm2.grammars["builtin_json"]
    size = smollm2.size + 100
    tree = ps.GrammarTree.from_linear_chain(np.array([[0, smollm2.tokens.index("{")]]))
    dense = ps.build_host_bitmask(
        [ProtocolMatcher(xgr_matcher(compiled), vocab_size=smollm2.size)], tree, size
    )
    mask = ps.build_host_bitmask(
        [ProtocolMatcher(xgr_matcher(compiled), vocab_size=smollm2.size)],
        tree,
        size,
        layout="compact",
    )
    np.testing.assert_array_equal(mask.to_dense(), dense)
    assert (mask.bits[:, smollm2.words :] == 0).all()


# -- the index helpers: compiled against the Python fallback -----------------------------------
def test_keep_rows_agrees_with_the_dense_repair(monkeypatch):
    """keep_rows lists exactly the rows repair_rows leaves alone, with the same counts, and
    writes nothing; the numpy/Python implementation behind each entry agrees with the
    compiled one (rows, counts and valid flags)."""
    compiled = native_module.native

    def both(entry, *args):
        """The entry's result with the compiled helper (None when not built) and without."""
        with monkeypatch.context() as patch:
            patch.setattr(native_module, "native", None)
            python = entry(*args)
        return (entry(*args) if compiled is not None else None), python

    rng = np.random.default_rng(1)
    for _ in range(300):
        n, words = int(rng.integers(1, 14)), int(rng.integers(1, 4))
        rows = rng.integers(-(2**31), 2**31, (n, words), dtype=np.int64).astype(np.int32)
        parents = [-1] + [int(rng.integers(0, j)) for j in range(1, n)]
        nt = np.full(n, -1, np.int64)
        ns = np.full(n, -1, np.int64)
        last = [-1] * n
        for v in range(1, n):
            p = parents[v]
            if last[p] == -1:
                nt[p] = v
            else:
                ns[last[p]] = v
            last[p] = v
        limit = int(rng.integers(1, 32 * words + 1))
        dt = rng.integers(-3, limit + 3, n).astype(np.int64)
        stops = np.array([int(rng.integers(0, limit))], dtype=np.int64)
        root = int(rng.integers(-1, 2))
        original = rows.copy()
        links = (nt, ns, dt)
        native_kept, fallback = both(native_module.keep_rows, rows, links, limit, stops, root)
        np.testing.assert_array_equal(rows, original)  # nothing written
        kept = fallback[0]
        repaired = {}
        for name in ("native", "python"):
            if name == "native" and compiled is None:
                continue
            out = rows.copy()
            valid = np.zeros(n, dtype=bool)
            with monkeypatch.context() as patch:
                if name == "python":
                    patch.setattr(native_module, "native", None)
                counts = native_module.repair_rows(out, links, limit, stops, root, valid)
            assert counts == fallback[1:]
            repaired[name] = (out, valid)
            np.testing.assert_array_equal(out[kept], original[kept])
            rewritten = [j for j in range(n) if j not in kept.tolist()]
            assert (out[rewritten] == -1).all()
            # accepted: the root, and each child of a kept node whose token is allowed
            kept_set = set(kept.tolist())
            for v in range(n):
                t = int(dt[v])
                allowed = 0 <= t < limit and (int(original[parents[v], t >> 5]) >> (t & 31)) & 1
                assert valid[v] == (v == 0 or (parents[v] in kept_set and bool(allowed)))
        if compiled is None:
            continue
        assert native_kept is not None
        assert native_kept[0].tolist() == kept.tolist()
        assert native_kept[1:] == fallback[1:]
        raw = rows.copy()  # the compiled repair itself: kept rows counted, same counts
        assert compiled.repair_rows(raw, nt, ns, dt, limit, stops, root) == (
            len(kept),
            *fallback[1:],
        )
        np.testing.assert_array_equal(raw, repaired["native"][0])
        np.testing.assert_array_equal(repaired["native"][0], repaired["python"][0])
        np.testing.assert_array_equal(repaired["native"][1], repaired["python"][1])


def test_take_rows_and_its_refusals(builder_mode):
    rng = np.random.default_rng(2)
    source = rng.integers(-(2**31), 2**31, (6, 3), dtype=np.int64).astype(np.int32)
    index = np.array([5, 0, 3], dtype=np.int32)
    dest = np.full((3, 5), 9, np.int32)
    numbers = np.zeros(3, np.int32)
    native_module.take_rows(source, index, dest, numbers, 60)
    np.testing.assert_array_equal(dest[:, :3], source[index])
    assert (dest[:, 3:] == 0).all()
    assert numbers.tolist() == [65, 60, 63]
    same = np.empty((3, 3), np.int32)
    native_module.take_rows(source, index, same, numbers, 0)
    np.testing.assert_array_equal(same, source[index])
    assert numbers.tolist() == [5, 0, 3]
    native = native_module.native

    if builder_mode == "native":
        with pytest.raises(ValueError, match="every index a source row"):
            native.take_rows(source, np.array([6], np.int32), np.empty((1, 3), np.int32))
        with pytest.raises(ValueError, match="one row per index"):
            native.take_rows(source, index, np.empty((2, 3), np.int32))
        with pytest.raises(ValueError, match="one row per index"):
            native.take_rows(source, index, same, np.zeros(2, np.int32), 0)
        with pytest.raises(TypeError, match="index must be a 1-D int32"):
            native.take_rows(source, index.astype(np.int64), dest)


# -- CompactMask itself ------------------------------------------------------------------------
def test_compact_mask_checks_and_to_dense():
    rows = np.array([1, 3, 4], np.int32)
    bits = np.array([[5], [6], [7]], np.int32)
    mask = ps.CompactMask(rows, bits, 4, count=2)
    dense = mask.to_dense()
    assert dense[:, 0].tolist() == [-1, 5, -1, 6]  # row 4 = num_rows: padding, dropped
    assert "count=2" in repr(mask) and mask.capacity == 3 and mask.words == 1
    with pytest.raises(ValueError, match="rows \\[C\\] and bits \\[C, words\\]"):
        ps.CompactMask(rows[:2], bits, 4)
    with pytest.raises(TypeError, match="int32"):
        ps.CompactMask(rows.astype(np.int64), bits, 4)
    with pytest.raises(ValueError, match="count = 4"):
        ps.CompactMask(rows, bits, 4, count=4)
    with pytest.raises(TypeError, match="num_rows must be an int"):
        ps.CompactMask(rows, bits, 4.0)


@pytest.mark.parametrize("vocab", [64, 100, 1000])
def test_numpy_compact_apply_equals_dense(vocab):
    """Random masks, padding entries and rows not listed: the compact apply touches only the
    listed rows and equals the dense apply of the expanded mask; 1-D logits for one row."""
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    num_rows = 70
    listed = np.sort(rng.choice(num_rows, size=40, replace=False)).astype(np.int32)
    rows = np.concatenate([listed, np.full(5, num_rows, np.int32)])
    bits = rng.integers(-(2**31), 2**31, (45, words), dtype=np.int64).astype(np.int32)
    mask = ps.CompactMask(rows, bits, num_rows, count=40)
    logits = rng.standard_normal((num_rows, vocab)).astype(np.float32)
    want = ps.apply_vocab_mask(logits.copy(), mask.to_dense())
    got = ps.apply_vocab_mask(logits.copy(), mask)
    np.testing.assert_array_equal(got, want)
    unlisted = np.setdiff1d(np.arange(num_rows), listed)
    np.testing.assert_array_equal(got[unlisted], logits[unlisted])
    mask_unknown_count = ps.CompactMask(rows, bits, num_rows)
    np.testing.assert_array_equal(ps.apply_vocab_mask(logits.copy(), mask_unknown_count), want)
    one = ps.CompactMask(np.array([0], np.int32), bits[:1], 1, count=1)
    row = logits[0].copy()
    np.testing.assert_array_equal(
        ps.apply_vocab_mask(row, one), ps.apply_vocab_mask(logits[0].copy(), bits[0])
    )
    with pytest.raises(ValueError, match="same rows"):
        ps.apply_vocab_mask(logits[:10].copy(), mask)
    with pytest.raises(TypeError, match="floating"):
        ps.apply_vocab_mask(np.zeros((num_rows, vocab), np.int32), mask)


def test_backends_and_placements_without_compact_masks_are_refused(smollm2, monkeypatch):
    """A backend without upload_compact, and a mask spanning several processes, refuse the
    compact layout before any matcher moves."""
    from portable_spec.backend import Backend, MaskLayout

    compiled = smollm2.grammars["builtin_json"]
    matchers = [ProtocolMatcher(xgr_matcher(compiled))]
    tree = ps.GrammarTree.from_linear_chain(np.zeros((1, 3), np.int64))
    numpy_backend = type(ps.get_backend("numpy"))
    with monkeypatch.context() as patch:
        patch.setattr(numpy_backend, "upload_compact", Backend.upload_compact)
        with pytest.raises(TypeError, match="'numpy' has no compact mask layout"):
            ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, layout="compact")
    with monkeypatch.context() as patch:

        def collective(self, placement, batch, nodes, vocab_size, row_capacity):
            return MaskLayout(batch * nodes, ((0, batch * nodes, 0),), placement, True)

        patch.setattr(numpy_backend, "mask_layout", collective)
        with pytest.raises(ValueError, match="placement within this process"):
            ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, layout="compact")
    assert matchers[0].calls == []
    with pytest.raises(TypeError, match="cannot apply a CompactMask"):
        Backend.apply_compact_mask(ps.get_backend("numpy"), np.zeros((1, 32)), None)


def test_reasoning_is_dense_only(smollm2):
    compiled = smollm2.grammars["builtin_json"]
    matchers = [ProtocolMatcher(xgr_matcher(compiled))]
    tree = ps.GrammarTree.from_linear_chain(np.zeros((1, 3), np.int64))
    reasoning = ps.Reasoning(active=[True], end_token_ids=[smollm2.eos])
    for build in (ps.build_host_bitmask, ps.build_grammar_vocab_mask):
        with pytest.raises(ValueError, match="reasoning= builds dense masks only"):
            build(matchers, tree, smollm2.size, layout="compact", reasoning=reasoning)
    assert matchers[0].calls == []


def test_return_valid_through_the_device_entry_point(smollm2):
    """build_grammar_vocab_mask(layout="compact", return_valid=True): (mask, valid), valid
    the dense layout's, also when no request has a grammar."""
    requests = [Request(smollm2.grammars["builtin_json"]), None]
    dt = np.array([[0, smollm2.tokens.index("{"), 5], [0, 1, 2]])
    tree = ps.GrammarTree.from_linear_chain(dt)
    dense, want = ps.build_grammar_vocab_mask(
        [r and r.fresh() for r in requests], tree, smollm2.size, return_valid=True
    )
    mask, valid = ps.build_grammar_vocab_mask(
        [r and r.fresh() for r in requests],
        tree,
        smollm2.size,
        layout="compact",
        return_valid=True,
    )
    np.testing.assert_array_equal(valid, want)
    np.testing.assert_array_equal(mask.to_dense(), dense)
    none, valid = ps.build_grammar_vocab_mask(
        [None, None], tree, smollm2.size, layout="compact", return_valid=True
    )
    assert none is None and valid.all()
