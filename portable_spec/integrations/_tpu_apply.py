"""The grammar mask on tpu-inference's logits, one jitted function per logits shape (JAX).

Imported only once tpu-inference's runner is being patched, where JAX is already loaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import portable_spec as ps

__all__ = ["apply_flagged", "apply_rows"]


@jax.jit
def apply_rows(index: jax.Array, bits: jax.Array, logits: jax.Array) -> jax.Array:
    """``logits`` with ``-inf`` where each row's grammar row disallows a token.

    ``index``: int32 ``[rows]``, per logits row the row of ``bits`` that masks it, or any
    value ``>= len(bits)`` for a row left as it is; ``bits``: int32 ``[capacity, words]``
    (vLLM's bitmask rows, ``32 * words >= vocab``); ``logits``: ``[rows, vocab]`` floating
    (bfloat16 and float32 exact). Returns a new array of the logits' shape and dtype. Every
    shape is static, so the batch's mix (which requests are constrained, how many drafts
    each has) never recompiles it: one compile per logits shape, like tpu-inference's sampler.
    Does not block.
    """
    mask = jnp.take(bits, index, axis=0, mode="fill", fill_value=-1)
    return ps.apply_vocab_mask(logits, mask)


@jax.jit
def _index_of_flags(flags: jax.Array) -> jax.Array:
    rows = flags.shape[0]
    return jnp.where(flags.reshape(rows), jnp.arange(rows, dtype=jnp.int32), jnp.int32(rows))


def apply_flagged(flags: jax.Array, bits: jax.Array, logits: jax.Array) -> jax.Array:
    """tpu-inference's own form of the inputs (bool ``[rows, 1]`` flags, int32
    ``[rows, words]`` rows aligned with the logits) through :func:`apply_rows`: what its
    start-up precompilation passes, so that it compiles the function the steps use. Returns
    the masked logits; does not block."""
    return apply_rows(_index_of_flags(flags), bits, logits)
