"""Compact masks on every backend target: the oracle's entries on the device, the same logits
as the dense mask, static capacity, padding, row capacity (per-shard layouts included)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _cases import matrix_case
from _oracle import expected_compact, expected_mask
from test_backend_matrix import BATCH, NODES, _matchers, _reference_masked

import portable_spec as ps
from portable_spec.registry import backend_for


@pytest.fixture
def batch_case(smollm2):
    """The backend matrix's batch (see ``_cases.matrix_case``)."""
    return matrix_case(smollm2, BATCH, NODES)


def _host(target, mask):
    return target.get(mask.rows), target.get(mask.bits)


def test_compact_entries(target, batch_case, smollm2):
    """Exactly the accepted, non-terminated nodes are listed and travel (K rows + index), in
    the backend's types and placement; expanded, the mask is the oracle's."""
    requests, nt, ns, dt, want = batch_case
    tree = ps.GrammarTree.from_device(*(target.put(a) for a in (nt, ns, dt)))
    mask = ps.build_grammar_vocab_mask(
        _matchers(requests), tree, smollm2.size, device=target.device(), layout="compact"
    )
    assert isinstance(mask, ps.CompactMask)
    assert backend_for(mask.bits).name == target.backend
    rows, bits = _host(target, mask)
    listed, expected_bits = expected_compact(requests, nt, ns, dt, smollm2.size, smollm2.words)
    assert mask.count == len(listed) and mask.num_rows == BATCH * NODES
    assert rows.dtype == np.int32 and bits.dtype == np.int32
    np.testing.assert_array_equal(rows, listed)
    np.testing.assert_array_equal(bits, expected_bits)
    assert bits.shape == (len(listed), smollm2.words)  # only K rows travel
    np.testing.assert_array_equal(ps.CompactMask(rows, bits, mask.num_rows).to_dense(), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_compact_apply_equals_dense(target, batch_case, smollm2, dtype):
    """The masked logits of the compact mask equal the dense mask's, bit for bit, with and
    without a static capacity (padding entries apply to nothing)."""
    if dtype not in target.float_dtypes:
        pytest.skip(f"{target.name} does not run {dtype} logits")
    requests, nt, ns, dt, want = batch_case
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((BATCH * NODES, smollm2.size)) * 3).astype(np_dtype)
    reference = _reference_masked(logits, want)
    tree = ps.GrammarTree.from_device(*(target.put(a) for a in (nt, ns, dt)))
    for max_rows in (None, BATCH * NODES):
        mask = ps.build_grammar_vocab_mask(
            _matchers(requests), tree, smollm2.size, layout="compact", max_rows=max_rows
        )
        masked = target.get(ps.apply_vocab_mask(target.put(logits), mask))
        assert masked.dtype == logits.dtype
        np.testing.assert_array_equal(masked.astype(np.float64), reference)


def test_compact_capacity(target, batch_case, smollm2):
    """row_capacity sets num_rows (row indices follow the dense layout of that capacity, per
    row shard on sharded targets); max_rows fixes the entries; no grammar with either gives an
    all-padding mask instead of None."""
    requests, nt, ns, dt, _ = batch_case
    tree = ps.GrammarTree.from_device(*(target.put(a) for a in (nt, ns, dt)))
    dense = ps.build_grammar_vocab_mask(_matchers(requests), tree, smollm2.size, row_capacity=64)
    mask = ps.build_grammar_vocab_mask(
        _matchers(requests), tree, smollm2.size, row_capacity=64, layout="compact", max_rows=40
    )
    rows, bits = _host(target, mask)
    assert mask.num_rows == 64 and rows.shape == (40,) and bits.shape[0] == 40
    assert (rows[mask.count :] == 64).all()
    np.testing.assert_array_equal(
        ps.CompactMask(rows, bits, 64).to_dense(), target.get(dense).astype(np.int32)
    )
    idle = ps.build_grammar_vocab_mask(
        [None] * BATCH, tree, smollm2.size, row_capacity=64, layout="compact", max_rows=40
    )
    assert idle.count == 0 and idle.num_rows == 64
    assert (target.get(idle.rows) == 64).all() and target.get(idle.bits).shape == (
        40,
        bits.shape[1],
    )
    empty = ps.build_grammar_vocab_mask(
        [None] * BATCH, tree, smollm2.size, row_capacity=64, layout="compact"
    )
    assert empty.count == 0 and target.get(empty.rows).shape == (0,)
    assert ps.build_grammar_vocab_mask([None] * BATCH, tree, smollm2.size, layout="compact") is None
    logits = np.random.default_rng(0).standard_normal((64, smollm2.size)).astype(np.float32)
    same = target.get(ps.apply_vocab_mask(target.put(logits), idle))
    np.testing.assert_array_equal(same, logits)


def test_compact_masks_survive_later_steps(target, smollm2):
    """Pooled host blocks are reused only when nothing reads them any more: every earlier
    compact mask still holds its own entries after later builds."""
    from _oracle import Request

    rng = np.random.default_rng(4)
    compiled = smollm2.grammars["builtin_json"]
    opening = [smollm2.tokens.index(t) for t in ("{", "[", '"', "1", "Ġ")]
    kept = []
    for step in range(10):
        dt = rng.choice(opening, size=(BATCH, NODES))
        dt[:, 0] = 0
        requests = [Request(compiled) for _ in range(BATCH)]
        tree = ps.GrammarTree.from_linear_chain(target.put(dt))
        mask = ps.build_grammar_vocab_mask(
            _matchers(requests), tree, smollm2.size, layout="compact"
        )
        want = expected_mask(requests, *tree.resolve(), smollm2.size, smollm2.words)
        kept.append((mask, want))
        if step % 3 == 0:
            kept.pop(0)
    for mask, want in kept:
        rows, bits = _host(target, mask)
        np.testing.assert_array_equal(ps.CompactMask(rows, bits, mask.num_rows).to_dense(), want)


def test_bad_compact_masks_for_logits(target):
    logits = target.put(np.zeros((8, 64), np.float32))
    rows = target.put(np.arange(8, dtype=np.int32))
    bits = target.put(np.zeros((8, 2), np.int32))
    with pytest.raises(ValueError, match="same rows"):
        ps.apply_vocab_mask(logits, ps.CompactMask(rows, bits, 16))
