"""apply_vocab_mask on numpy logits against a naive per-token reference."""

from __future__ import annotations

import numpy as np
import pytest

import portable_spec as ps


def naive_apply(logits, mask):
    out = logits.copy()
    rows, vocab = out.shape
    for i in range(rows):
        for t in range(min(vocab, 32 * mask.shape[1])):
            if not (int(mask[i, t // 32]) >> (t % 32)) & 1:
                out[i, t] = -np.inf
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(("vocab", "words"), [(64, 2), (70, 3), (100, 2), (5, 1)])
def test_apply_matches_naive(dtype, vocab, words):
    rng = np.random.default_rng(vocab + words)
    logits = rng.standard_normal((3, vocab)).astype(dtype)
    mask = rng.integers(-(2**31), 2**31, (3, words), dtype=np.int64).astype(np.int32)
    mask[1] = -1
    want = naive_apply(logits, mask)
    got = ps.apply_vocab_mask(logits, mask)
    assert got is logits  # in place
    np.testing.assert_array_equal(got, want)


def test_apply_one_row_and_none():
    logits = np.zeros(40, np.float32)
    mask = np.array([0x0000000F, 0x1], dtype=np.uint32).view(np.int32)
    ps.apply_vocab_mask(logits, mask)
    assert np.isfinite(logits).tolist() == [True] * 4 + [False] * 28 + [True] + [False] * 7
    assert ps.apply_vocab_mask(logits, None) is logits


def test_apply_errors():
    with pytest.raises(TypeError, match="logits must have a floating dtype"):
        ps.apply_vocab_mask(np.zeros((1, 4), np.int32), np.zeros((1, 1), np.int32))
    with pytest.raises(TypeError, match="mask must have dtype int32"):
        ps.apply_vocab_mask(np.zeros((1, 4)), np.zeros((1, 1), np.int64))
    with pytest.raises(ValueError, match="same rows"):
        ps.apply_vocab_mask(np.zeros((2, 4)), np.zeros((1, 1), np.int32))
