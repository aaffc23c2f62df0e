"""``apply_vocab_mask`` for JAX: one jitted function, inlined into the caller's ``jax.jit``."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from portable_spec.masks import CompactMask, apply_columns

__all__ = ["apply_compact_mask_jax", "apply_vocab_mask_jax"]

_SAME_WIDTH_INT = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _apply_vocab_mask(
    logits: jax.Array, mask: jax.Array | None, vocab_size: int | None = None
) -> jax.Array:
    """Return ``logits`` with ``-inf`` where bit ``t`` of ``mask[i]`` is 0.

    ``logits``: ``[rows, vocab]`` or ``[vocab]`` of any floating dtype (float32, bfloat16 and
    float16 are exact: every kept logit is bit-identical, every dropped one is ``-inf``).
    ``mask``: int32 ``[rows, words]`` or ``[words]`` covering every column
    (``32 * words >= vocab``), or ``None`` with ``vocab_size``. ``vocab_size`` (static): the
    columns at or past it are ``-inf`` in every row (the mask then needs to cover only
    ``vocab_size`` tokens); see :func:`portable_spec.apply_vocab_mask`.

    Pure and shape-static, and itself a ``jax.jit`` function: called eagerly it runs as one
    compiled computation (compiled once per shape and dtype), and inside the engine's own
    ``jax.jit`` it is inlined into the caller's computation. Each logit reads its word through
    a broadcast of the mask along a new minor axis of 32, which XLA fuses into a single
    elementwise pass: no ``[rows, words, 32]`` (or ``[rows, vocab]`` integer) array is
    materialised. Donating ``logits`` to the enclosing ``jit`` pays only if that ``jit``
    returns the masked logits (or another array of their shape and dtype).

    The select is written on the logits' bits (``(x & keep) | (-inf & ~keep)``, ``keep`` all
    ones or zeros per token) rather than as ``where(allowed, x, -inf)``: in a donating jit,
    LLVM turns the latter into a masked store of ``-inf`` on XLA's CPU backend, which runs at
    about half the speed of a plain pass over the logits; the bitwise form is one load, a few
    integer operations and one full store, at the speed of an elementwise select.

    Raises:
        TypeError: ``logits`` not floating or ``mask`` not int32 (when traced).
        ValueError: shapes that are not ``[rows, vocab]`` / ``[rows, words]`` with the same
            rows, or logits wider than the mask covers without ``vocab_size`` (when traced).
    """
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"logits must have a floating dtype, got {logits.dtype}")
    if mask is None:
        _, banned = apply_columns(logits.shape[-1], None, vocab_size)
        if banned is None:
            return logits
        return logits.at[..., banned:].set(-jnp.inf)
    if mask.dtype != jnp.int32:
        raise TypeError(f"mask must have dtype int32, got {mask.dtype}")
    one_row = logits.ndim == 1
    logits_2d = logits[None] if one_row else logits
    mask_2d = mask[None] if mask.ndim == 1 else mask
    if logits_2d.ndim != 2 or mask_2d.ndim != 2 or logits_2d.shape[0] != mask_2d.shape[0]:
        raise ValueError(
            f"logits {logits.shape} and mask {mask.shape} must be [rows, vocab] and "
            "[rows, words] with the same rows"
        )
    rows, vocab = logits_2d.shape
    covered, _ = apply_columns(vocab, mask_2d.shape[1], vocab_size)
    used_words = -(-covered // 32)
    # word of every token: broadcast each word over its 32 tokens, then flatten (no gather)
    per_token = jnp.broadcast_to(mask_2d[:, :used_words, None], (rows, used_words, 32)).reshape(
        rows, used_words * 32
    )[:, :covered]
    # token t's bit moved to the sign bit, then spread: -1 (allowed) or 0 (dropped)
    to_sign = jnp.broadcast_to(31 - (jnp.arange(covered, dtype=jnp.int32) & 31), (rows, covered))
    keep = jax.lax.shift_right_arithmetic(jax.lax.shift_left(per_token, to_sign), jnp.int32(31))
    if covered < vocab:  # only past vocab_size: banned
        keep = jnp.concatenate((keep, jnp.zeros((rows, vocab - covered), jnp.int32)), axis=1)
    carrier = _SAME_WIDTH_INT[jnp.dtype(logits.dtype).itemsize]
    keep = keep.astype(carrier)
    raw = jax.lax.bitcast_convert_type(logits_2d, carrier)
    dropped = jax.lax.bitcast_convert_type(jnp.asarray(-jnp.inf, dtype=logits.dtype), carrier)
    masked = jax.lax.bitcast_convert_type((raw & keep) | (dropped & ~keep), logits.dtype)
    return masked[0] if one_row else masked


apply_vocab_mask_jax = jax.jit(_apply_vocab_mask, inline=True, static_argnames=("vocab_size",))
apply_vocab_mask_jax.__doc__ = _apply_vocab_mask.__doc__


def _dense_of(rows: jax.Array, bits: jax.Array, num_rows: int) -> jax.Array:
    """The dense int32 ``[num_rows, words]`` mask of a compact one (padding dropped)."""
    dense = jnp.full((num_rows, bits.shape[1]), -1, dtype=jnp.int32)
    return dense.at[rows].set(bits, mode="drop", indices_are_sorted=True)


@partial(jax.jit, static_argnums=(3, 4), inline=True)
def _apply_compact(
    logits: jax.Array, rows: jax.Array, bits: jax.Array, num_rows: int, vocab_size: int | None
) -> jax.Array:
    return _apply_vocab_mask(logits, _dense_of(rows, bits, num_rows), vocab_size)


def apply_compact_mask_jax(
    logits: jax.Array, mask: CompactMask, vocab_size: int | None = None
) -> jax.Array:
    """Return ``logits`` with ``-inf`` where the compact ``mask`` disallows a token.

    ``logits``: ``[mask.num_rows, vocab]`` (or ``[vocab]`` when ``num_rows`` is 1) of a
    floating dtype; ``mask``: a :class:`CompactMask` of ``jax.Array`` (a pytree: it passes
    into ``jax.jit`` as it is). The ``K`` listed rows are scattered into an all-allowed int32
    ``[num_rows, words]`` mask (1/32 of the logits in float32; padding entries, whose row is
    ``num_rows``, are dropped), then applied like a dense mask, so the result is identical and
    the select fuses into the caller's sampler as for a dense mask. Pure and jit-traceable;
    eagerly, one compiled computation per shape. ``vocab_size``: as for a dense mask (columns
    at or past it ``-inf`` in every row).

    Raises:
        TypeError: ``logits`` not floating, or the mask's arrays not int32.
        ValueError: ``logits`` rows other than ``mask.num_rows``.
    """
    rows_of = 1 if logits.ndim == 1 else logits.shape[0]
    if logits.ndim not in (1, 2) or rows_of != mask.num_rows:
        raise ValueError(
            f"logits {logits.shape} must be [rows, vocab] with the mask's num_rows = "
            f"{mask.num_rows} rows (the same rows)"
        )
    if mask.rows.dtype != jnp.int32 or mask.bits.dtype != jnp.int32:
        raise TypeError("a CompactMask's rows and bits must have dtype int32")
    vocab_size = None if vocab_size is None else int(vocab_size)
    return _apply_compact(logits, mask.rows, mask.bits, mask.num_rows, vocab_size)
