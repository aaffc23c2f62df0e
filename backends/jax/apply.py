"""``apply_vocab_mask`` for JAX: one jitted function, inlined into the caller's ``jax.jit``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["apply_vocab_mask_jax"]


def _apply_vocab_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Return ``logits`` with ``-inf`` where bit ``t`` of ``mask[i]`` is 0.

    ``logits``: ``[rows, vocab]`` or ``[vocab]`` of any floating dtype (float32, bfloat16 and
    float16 are exact: every kept logit is bit-identical, every dropped one is ``-inf``).
    ``mask``: int32 ``[rows, words]`` or ``[words]``. Columns past ``32 * words`` are kept.

    Pure and shape-static, and itself a ``jax.jit`` function: called eagerly it runs as one
    compiled computation (compiled once per shape and dtype), and inside the engine's own
    ``jax.jit`` it is inlined into the caller's computation. Each logit reads its word through
    a broadcast of the mask along a new minor axis of 32, which XLA fuses into the single
    elementwise select: no ``[rows, words, 32]`` (or ``[rows, vocab]`` integer) array is
    materialised. Donating ``logits`` to the enclosing ``jit`` pays only if that ``jit``
    returns the masked logits (or another array of their shape and dtype).

    Raises:
        TypeError: ``logits`` not floating or ``mask`` not int32 (when traced).
        ValueError: shapes that are not ``[rows, vocab]`` / ``[rows, words]`` with the same
            rows (when traced).
    """
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"logits must have a floating dtype, got {logits.dtype}")
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
    words = mask_2d.shape[1]
    covered = min(vocab, 32 * words)
    used_words = -(-covered // 32)
    # word of every token: broadcast each word over its 32 tokens, then flatten (no gather)
    per_token = jnp.broadcast_to(mask_2d[:, :used_words, None], (rows, used_words, 32)).reshape(
        rows, used_words * 32
    )[:, :covered]
    shift = jnp.broadcast_to(jnp.arange(covered, dtype=jnp.int32) & 31, (rows, covered))
    allowed = (jax.lax.shift_right_logical(per_token, shift) & 1).astype(jnp.bool_)
    if covered < vocab:
        allowed = jnp.concatenate(
            (allowed, jnp.ones((rows, vocab - covered), dtype=jnp.bool_)), axis=1
        )
    masked = jnp.where(allowed, logits_2d, jnp.asarray(-jnp.inf, dtype=logits.dtype))
    return masked[0] if one_row else masked


apply_vocab_mask_jax = jax.jit(_apply_vocab_mask, inline=True)
apply_vocab_mask_jax.__doc__ = _apply_vocab_mask.__doc__
