"""The drafter's own vocabulary (EAGLE-3's reduced draft vocabulary): target-vocabulary rows
as draft-vocabulary rows, through the ``d2t`` map."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_spec.masks import ALL_ALLOWED, words_for
from portable_spec.tree import host_array

__all__ = ["DraftVocab"]


class DraftVocab:
    """An EAGLE-3 style draft vocabulary: draft token ``i`` is target token ``d2t[i]``."""

    def __init__(self, d2t: Any, vocab_size: int) -> None:
        host = host_array("d2t", d2t)
        if host.dtype.kind not in "iu":
            raise TypeError(f"d2t must have an integer dtype, got {host.dtype}")
        if host.ndim != 1 or host.size == 0:
            raise ValueError(f"d2t must be a non-empty 1-D [draft_vocab] array, got {host.shape}")
        ids = host.astype(np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            raise ValueError(
                f"d2t[{int(bad[0])}] = {int(ids[bad[0]])} is not a target token id "
                f"(0 <= id < vocab_size = {vocab_size}); d2t holds target ids, not offsets "
                "(EAGLE-3 checkpoints store offsets: pass d2t + arange(len(d2t)))"
            )
        self.size = int(ids.size)
        self.words = words_for(self.size)
        # bit t of a little-endian row is bit t % 8 of byte t // 8
        self._byte = (ids >> 3).astype(np.intp)
        self._shift = (ids & 7).astype(np.uint8)

    def convert(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Target-vocabulary rows ``[n, W]`` -> draft-vocabulary rows ``out`` ``[n, Wd]``.

        Bit ``i`` of a draft row is bit ``d2t[i]`` of the target row (vectorized: one gather
        of ``n * draft_vocab`` bytes, no loop over tokens; about 20 us per row for a 32000-token
        draft vocabulary on one core of the development machine). All-allowed rows stay all-allowed;
        a row allowing no draft token (the grammar wants a token outside the draft
        vocabulary) becomes all-allowed too, so that no drafter softmax row is all ``-inf``.
        """
        out.fill(ALL_ALLOWED)
        if rows.shape[0] == 0:
            return
        real = np.flatnonzero((rows != ALL_ALLOWED).any(axis=1))
        if real.size == 0:
            return
        little = rows[real].astype("<i4", copy=False).view(np.uint8)  # [r, 4 * W] bytes
        bits = np.take(little, self._byte, axis=1)  # [r, draft_vocab] uint8
        np.right_shift(bits, self._shift, out=bits)
        np.bitwise_and(bits, 1, out=bits)
        packed = np.packbits(bits, axis=1, bitorder="little")
        words = np.zeros((real.size, self.words * 4), dtype=np.uint8)
        words[:, : packed.shape[1]] = packed
        converted = words.view("<i4").astype(np.int32, copy=False)
        empty = ~converted.any(axis=1)
        converted[empty] = ALL_ALLOWED
        out[real] = converted
