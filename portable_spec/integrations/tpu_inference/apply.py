"""The grammar mask on tpu-inference's logits, one jitted function per logits shape (JAX).

Imported only once tpu-inference's runner is being patched, where JAX is already loaded.

A step's mask travels as one int32 array ``packed`` of shape ``[rows, 1 + words]`` (one
host-to-device transfer per step): column 0 holds, per logits row, the row of the packed mask
that masks it (``rows`` or more: the row is left as it is); columns ``1 ..`` hold vLLM's
grammar rows of the batch's structured requests, in vLLM's order, from row 0 on (the rows
past them are never read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import portable_spec as ps

__all__ = ["apply_flagged", "apply_packed"]


def _apply_packed(packed: jax.Array, logits: jax.Array) -> jax.Array:
    """``logits`` with ``-inf`` where each row's grammar row disallows a token.

    ``packed``: int32 ``[rows, 1 + words]`` (see the module docstring; ``32 * words >=
    vocab``); ``logits``: ``[rows, vocab]`` floating (bfloat16 and float32 exact),
    **donated**: the result takes their buffer (the caller's array is deleted;
    tpu-inference's ``sample_tokens`` rebinds its ``logits`` to the result). Returns an array
    of the logits' shape, dtype and sharding. Every shape is static, so the batch's mix
    (which requests are constrained, how many drafts each has) never recompiles it: one
    compile per logits shape, like tpu-inference's sampler. Does not block.
    """
    mask = jnp.take(packed[:, 1:], packed[:, 0], axis=0, mode="fill", fill_value=-1)
    return ps.apply_vocab_mask(logits, mask)


apply_packed = jax.jit(_apply_packed, donate_argnums=1)
apply_packed.__doc__ = _apply_packed.__doc__


@jax.jit
def _pack_flags(flags: jax.Array, bits: jax.Array) -> jax.Array:
    rows = flags.shape[0]
    index = jnp.where(flags.reshape(rows), jnp.arange(rows, dtype=jnp.int32), jnp.int32(rows))
    return jnp.concatenate([index[:, None], bits.astype(jnp.int32)], axis=1)


def apply_flagged(flags: jax.Array, bits: jax.Array, logits: jax.Array) -> jax.Array:
    """tpu-inference's own form of the inputs (bool ``[rows, 1]`` flags, int32
    ``[rows, words]`` rows aligned with the logits) through :func:`apply_packed`: what its
    start-up precompilation passes, so that it compiles the function the steps use. The
    caller's logits are not donated (a copy is). Returns the masked logits; does not block."""
    return apply_packed(_pack_flags(flags, bits), jnp.copy(logits))
