"""``apply_vocab_mask`` for numpy logits (in place)."""

from __future__ import annotations

import sys

import numpy as np

from portable_spec.masks import CompactMask, apply_columns

__all__ = ["apply_compact_mask_numpy", "apply_vocab_mask_numpy", "unpack_bitmask"]

# entries unpacked at a time by the compact apply (bounds its temporary arrays)
_CHUNK = 64


def unpack_bitmask(mask: np.ndarray, vocab: int) -> np.ndarray:
    """Boolean ``[rows, vocab]`` view of an int32 ``[rows, words]`` bitmask (True = allowed).

    Columns past ``32 * words`` are reported allowed (the mask does not cover them).
    """
    mask = np.ascontiguousarray(mask, dtype=np.int32)
    if sys.byteorder != "little":
        mask = mask.byteswap()
    covered = min(vocab, 32 * mask.shape[-1])
    bits = np.unpackbits(mask.view(np.uint8), axis=-1, count=covered, bitorder="little")
    allowed = bits.view(bool)
    if covered < vocab:
        pad = np.ones((*allowed.shape[:-1], vocab - covered), dtype=bool)
        allowed = np.concatenate((allowed, pad), axis=-1)
    return allowed


def _check_writable(logits: np.ndarray) -> None:
    if not logits.flags.writeable:
        raise ValueError(
            "logits are read-only: apply_vocab_mask writes -inf into numpy logits in place; "
            "pass a writable array (np.array(logits) is a writable copy)"
        )


def apply_vocab_mask_numpy(
    logits: np.ndarray, mask: np.ndarray | None, vocab_size: int | None = None
) -> np.ndarray:
    """Write ``-inf`` into ``logits`` wherever ``mask`` disallows the token; return ``logits``.

    ``logits``: writable floating ``[rows, vocab]`` or ``[vocab]``; ``mask``: int32
    ``[rows, words]`` or ``[words]`` covering every column (``32 * words >= vocab``), or
    ``None`` with ``vocab_size``. ``vocab_size``: columns at or past it are set to ``-inf``
    in every row (see :func:`portable_spec.apply_vocab_mask`). Synchronous. Read-only logits:
    ``ValueError``.
    """
    _check_writable(logits)
    if mask is None:
        logits_2d = logits.reshape(1, -1) if logits.ndim == 1 else logits
        _, banned = apply_columns(logits_2d.shape[-1], None, vocab_size)
        if banned is not None:
            logits_2d[:, banned:] = -np.inf
        return logits
    if not isinstance(mask, np.ndarray):
        raise TypeError(
            f"mask must be a numpy array for numpy logits, got {type(mask).__name__}: a mask "
            "is of the framework of the tree it was built over (GrammarTree.from_host of numpy "
            "arrays or lists gives numpy masks; build_host_bitmask always does); or convert "
            "this one (mask.numpy() for a CPU tensor, np.asarray(mask) for a JAX array)"
        )
    if not np.issubdtype(logits.dtype, np.floating):
        raise TypeError(f"logits must have a floating dtype, got {logits.dtype}")
    if mask.dtype != np.int32:
        raise TypeError(f"mask must have dtype int32, got {mask.dtype}")
    logits_2d = logits.reshape(1, -1) if logits.ndim == 1 else logits
    mask_2d = mask.reshape(1, -1) if mask.ndim == 1 else mask
    if logits_2d.ndim != 2 or mask_2d.ndim != 2 or logits_2d.shape[0] != mask_2d.shape[0]:
        raise ValueError(
            f"logits {logits.shape} and mask {mask.shape} must be [rows, vocab] and "
            "[rows, words] with the same rows"
        )
    covered, banned = apply_columns(logits_2d.shape[1], mask_2d.shape[1], vocab_size)
    allowed = unpack_bitmask(mask_2d, covered)
    np.copyto(logits_2d[:, :covered], -np.inf, where=~allowed)
    if banned is not None:
        logits_2d[:, banned:] = -np.inf
    return logits


def apply_compact_mask_numpy(
    logits: np.ndarray, mask: CompactMask, vocab_size: int | None = None
) -> np.ndarray:
    """Write ``-inf`` into the listed rows of ``logits`` where ``mask`` disallows the token;
    return ``logits``. Rows not listed (and padding entries) are not touched, except that
    with ``vocab_size`` the columns at or past it are ``-inf`` in every row.

    ``logits``: writable floating ``[mask.num_rows, vocab]`` (or ``[vocab]`` when ``num_rows``
    is 1); ``mask``: a :class:`CompactMask` of numpy int32 arrays whose rows cover every
    column (or ``vocab_size``). Synchronous. Read-only logits: ``ValueError``.
    """
    _check_writable(logits)
    rows, bits = mask.rows, mask.bits
    if not isinstance(rows, np.ndarray) or not isinstance(bits, np.ndarray):
        raise TypeError(
            f"the CompactMask must hold numpy arrays for numpy logits, got {type(bits).__name__}"
            ": a mask is of the framework of the tree it was built over (a tree of numpy "
            "arrays gives numpy masks; build_host_bitmask always does)"
        )
    if not np.issubdtype(logits.dtype, np.floating):
        raise TypeError(f"logits must have a floating dtype, got {logits.dtype}")
    logits_2d = logits.reshape(1, -1) if logits.ndim == 1 else logits
    if logits_2d.ndim != 2 or logits_2d.shape[0] != mask.num_rows:
        raise ValueError(
            f"logits {logits.shape} must be [rows, vocab] with the mask's num_rows = "
            f"{mask.num_rows} rows (the same rows)"
        )
    real = rows < mask.num_rows
    if mask.count is not None and real[: mask.count].all():
        which, source = rows[: mask.count], bits[: mask.count]
    else:
        which, source = rows[real], bits[real]
    covered, banned = apply_columns(logits_2d.shape[1], bits.shape[1], vocab_size)
    for start in range(0, len(which), _CHUNK):
        dropped = ~unpack_bitmask(source[start : start + _CHUNK], covered)
        for k, row in enumerate(which[start : start + _CHUNK].tolist()):
            np.copyto(logits_2d[row, :covered], -np.inf, where=dropped[k])  # a view: in place
    if banned is not None:
        logits_2d[:, banned:] = -np.inf
    return logits
