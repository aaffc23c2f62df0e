"""Compact masks in JAX: a pytree through ``jax.jit`` (donation, one compilation for a fixed
``max_rows``), the apply fused (no logits-sized temporary), and the dense apply's bitwise
select exact for every float dtype."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import xgrammar as xgr  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402
from portable_spec.backends.jax import apply_compact_mask_jax, apply_vocab_mask_jax  # noqa: E402

import portable_spec as ps  # noqa: E402


def _random_compact(rng, num_rows, words, listed, capacity):
    rows = np.sort(rng.choice(num_rows, size=listed, replace=False)).astype(np.int32)
    rows = np.concatenate([rows, np.full(capacity - listed, num_rows, np.int32)])
    bits = rng.integers(-(2**31), 2**31, (capacity, words), dtype=np.int64).astype(np.int32)
    return ps.CompactMask(rows, bits, num_rows, count=listed)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_compact_inside_donating_jit(dtype):
    rows, vocab = 24, 4096 + 7
    rng = np.random.default_rng(0)
    host = _random_compact(rng, rows, -(-vocab // 32), 10, 16)
    mask = ps.CompactMask(jnp.asarray(host.rows), jnp.asarray(host.bits), rows)
    logits = jnp.asarray(rng.standard_normal((rows, vocab)), dtype=dtype)
    want = np.asarray(apply_vocab_mask_jax(logits, jnp.asarray(host.to_dense())))

    @jax.jit
    def sample(logits, mask):
        masked = ps.apply_vocab_mask(logits, mask)
        return masked, jnp.argmax(masked, axis=-1)

    masked, picked = jax.jit(sample, donate_argnums=0)(logits, mask)
    assert logits.is_deleted()
    np.testing.assert_array_equal(np.asarray(masked), want)
    np.testing.assert_array_equal(np.asarray(picked), np.argmax(want.astype(np.float32), -1))


def test_max_rows_keeps_one_compiled_sampler(smollm2):
    """Batches of changing size and acceptance, one row capacity and one max_rows: the
    sampler taking the compact mask compiles once, and picks what the dense mask gives."""
    compiled = smollm2.grammars["regex"]
    sampler = jax.jit(lambda logits, mask: jnp.argmax(ps.apply_vocab_mask(logits, mask), -1))
    capacity, nodes = 32, 4
    rng = np.random.default_rng(1)
    for batch in (1, 3, 8, 5):
        dt = rng.integers(0, smollm2.size, (batch, nodes)).astype(np.int32)
        tree = ps.GrammarTree.from_linear_chain(jnp.asarray(dt))
        mask = ps.build_grammar_vocab_mask(
            [xgr.GrammarMatcher(compiled) for _ in range(batch)],
            tree,
            smollm2.size,
            row_capacity=capacity,
            layout="compact",
            max_rows=capacity,
        )
        dense = ps.build_grammar_vocab_mask(
            [xgr.GrammarMatcher(compiled) for _ in range(batch)],
            tree,
            smollm2.size,
            row_capacity=capacity,
        )
        assert mask.rows.shape == (capacity,) and mask.bits.shape == (capacity, smollm2.words)
        logits = jnp.asarray(rng.standard_normal((capacity, smollm2.size)), jnp.float32)
        np.testing.assert_array_equal(sampler(logits, mask), sampler(logits, dense))
    assert sampler._cache_size() == 2  # one for the compact signature, one for the dense


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_compact_apply_is_fused(platform):
    """The compact apply's only temporary is the int32 [rows, words] mask it scatters into
    (1/32 of float32 logits); the logits are written in place when donated."""
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if not devices:
        pytest.skip(f"no JAX {platform} device here")
    on = SingleDeviceSharding(devices[0])
    rows, vocab, entries = 64, 131072, 40
    f = jax.jit(apply_compact_mask_jax, donate_argnums=0)
    mask = ps.CompactMask(
        jax.ShapeDtypeStruct((entries,), jnp.int32, sharding=on),
        jax.ShapeDtypeStruct((entries, vocab // 32), jnp.int32, sharding=on),
        rows,
    )
    compiled = f.lower(jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=on), mask)
    stats = compiled.compile().memory_analysis()
    if stats is None:
        pytest.skip(f"JAX on {platform} reports no memory analysis")
    assert stats.temp_size_in_bytes <= rows * vocab // 8 + (1 << 16)
    assert stats.alias_size_in_bytes == rows * vocab * 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dense_apply_is_a_bitwise_select(dtype):
    """Special values survive exactly where allowed (NaN, infinities, -0.0, subnormals) and
    become -inf where dropped, as a select would give; vocab not a multiple of 32 and a mask
    narrower than the logits (vocab_size=96: the columns past it -inf)."""
    vocab = 100
    finfo = jnp.finfo(dtype)
    specials = np.array(
        [np.nan, np.inf, -np.inf, -0.0, 0.0, float(finfo.tiny) / 2, float(finfo.max), -1.5],
        dtype=np.float32,
    )
    host = np.resize(specials, (3, vocab))
    logits = jnp.asarray(host, dtype=dtype)
    rng = np.random.default_rng(2)
    mask = rng.integers(-(2**31), 2**31, (3, 3), dtype=np.int64).astype(np.int32)  # 96 tokens
    out = np.asarray(apply_vocab_mask_jax(logits, jnp.asarray(mask), vocab_size=96))
    raw = np.asarray(logits)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
    for r in range(3):
        for t in range(vocab):
            if t >= 96 or not bits[r, t]:
                assert out[r, t] == -np.inf
            else:
                assert raw[r, t].tobytes() == out[r, t].tobytes()  # bit-identical


def test_compact_apply_checks():
    logits = jnp.zeros((4, 64), jnp.float32)
    rows = jnp.asarray(np.array([0, 4], np.int32))
    bits = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="same rows"):
        ps.apply_vocab_mask(logits, ps.CompactMask(rows, bits, 5))
    one = ps.CompactMask(jnp.asarray(np.array([0], np.int32)), jnp.zeros((1, 2), jnp.int32), 1)
    assert (np.asarray(ps.apply_vocab_mask(jnp.zeros(64), one)) == -np.inf).all()
