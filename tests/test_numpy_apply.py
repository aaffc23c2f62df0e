"""apply_vocab_mask on numpy logits against a naive per-token reference."""

from __future__ import annotations

import numpy as np
import pytest

import portable_spec as ps


def naive_apply(logits, mask, vocab_size=None):
    """Per token: banned at or past ``vocab_size`` (every row), else by its bit."""
    out = logits.copy()
    rows, vocab = out.shape
    for i in range(rows):
        for t in range(vocab):
            padding = vocab_size is not None and t >= vocab_size
            if padding or not (int(mask[i, t // 32]) >> (t % 32)) & 1:
                out[i, t] = -np.inf
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    ("vocab", "words", "vocab_size"),
    [(64, 2, None), (70, 3, None), (5, 1, None), (100, 2, 64), (100, 2, 50), (70, 3, 65)],
)
def test_apply_matches_naive(dtype, vocab, words, vocab_size):
    rng = np.random.default_rng(vocab + words)
    logits = rng.standard_normal((3, vocab)).astype(dtype)
    mask = rng.integers(-(2**31), 2**31, (3, words), dtype=np.int64).astype(np.int32)
    mask[1] = -1  # all-allowed: still banned past vocab_size
    want = naive_apply(logits, mask, vocab_size)
    got = ps.apply_vocab_mask(logits, mask, vocab_size=vocab_size)
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


def test_read_only_logits_are_refused_by_name():
    """numpy logits are written in place: read-only ones (a view of a buffer the caller does
    not own) are refused with the way out, dense, compact and mask-less alike."""
    logits = np.zeros((2, 64), np.float32)
    logits.flags.writeable = False
    compact = ps.CompactMask(np.array([1], np.int32), np.zeros((1, 2), np.int32), 2)
    for mask, vocab_size in ((np.zeros((2, 2), np.int32), None), (compact, None), (None, 40)):
        with pytest.raises(ValueError, match=r"logits are read-only.*np\.array\(logits\)"):
            ps.apply_vocab_mask(logits, mask, vocab_size=vocab_size)
    assert (logits == 0).all()


def test_logits_wider_than_the_mask_are_refused_unless_vocab_size_says_how():
    """60000-wide logits, a 49152-token mask: the 10848 extra columns would stay allowed in
    constrained rows (padding ids sampled); refused, nothing written."""
    logits = np.zeros((2, 60000), np.float32)
    mask = np.zeros((2, 1536), np.int32)
    with pytest.raises(ValueError, match=r"60000 columns but the mask covers only 49152"):
        ps.apply_vocab_mask(logits, mask)
    assert np.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"vocab_size = 49153 but the mask covers only 49152"):
        ps.apply_vocab_mask(logits, mask, vocab_size=49153)
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        ps.apply_vocab_mask(logits, mask, vocab_size=49152.0)
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        ps.apply_vocab_mask(logits, mask, vocab_size=0)
    assert np.isfinite(logits).all()
    mask[0, 0] = 1  # row 0 allows token 0 only; row 1 nothing
    ps.apply_vocab_mask(logits, mask, vocab_size=49152)
    assert np.isfinite(logits).sum(axis=1).tolist() == [1, 0]
    # no mask: only the padding ids go
    logits[:] = 0
    ps.apply_vocab_mask(logits, None, vocab_size=49152)
    assert np.isfinite(logits[:, :49152]).all() and np.isneginf(logits[:, 49152:]).all()
