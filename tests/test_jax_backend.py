"""JAX-specific behaviour: jit/donation, no materialised unpacking, static shapes, staging,
and the host-aliasing trap of ``jax.device_put`` on the CPU platform."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import xgrammar as xgr  # noqa: E402
from _oracle import Request, expected_mask  # noqa: E402
from portable_spec.backends.jax import JaxBackend, apply_vocab_mask_jax  # noqa: E402

import portable_spec as ps  # noqa: E402


def _reference(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    out = logits.copy()
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, : out.shape[1]]
    out[:, : bits.shape[1]][bits == 0] = -np.inf
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_apply_inside_donating_jit(dtype):
    rows, vocab = 16, 131072 + 7
    rng = np.random.default_rng(0)
    mask = rng.integers(-(2**31), 2**31, (rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    host = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits = jnp.asarray(host, dtype=dtype)
    want = _reference(np.asarray(logits).astype(np.float32), mask)

    @jax.jit
    def sample(logits, mask):  # an engine's sampler: mask, then greedy pick
        masked = ps.apply_vocab_mask(logits, mask)
        return masked, jnp.argmax(masked, axis=-1)

    sample_donating = jax.jit(sample, donate_argnums=0)
    masked, picked = sample_donating(logits, jnp.asarray(mask))
    assert logits.is_deleted()  # the logits buffer was donated and reused
    np.testing.assert_array_equal(np.asarray(masked).astype(np.float32), want)
    np.testing.assert_array_equal(np.asarray(picked), np.argmax(want, axis=-1))


def test_unpacking_is_fused_not_materialised():
    """The compiled apply needs no temporary buffer and writes into the donated logits:
    no [rows, words, 32] (or [rows, vocab] int) array exists."""
    rows, vocab = 64, 131072
    f = jax.jit(apply_vocab_mask_jax, donate_argnums=0)
    compiled = f.lower(
        jax.ShapeDtypeStruct((rows, vocab), jnp.float32),
        jax.ShapeDtypeStruct((rows, vocab // 32), jnp.int32),
    ).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("this JAX platform reports no memory analysis")
    assert stats.temp_size_in_bytes < rows * vocab  # not even one byte per logit
    assert stats.alias_size_in_bytes == rows * vocab * 4


def test_row_capacity_keeps_one_compiled_sampler(smollm2):
    """A changing batch padded to a fixed row capacity: the engine's jitted sampler compiles
    once."""
    compiled = smollm2.grammars["regex"]
    sampler = jax.jit(lambda logits, mask: jnp.argmax(apply_vocab_mask_jax(logits, mask), -1))
    capacity, nodes = 32, 4
    for batch in (1, 3, 8, 5):
        dt = jnp.zeros((batch, nodes), dtype=jnp.int32)
        tree = ps.GrammarTree.from_linear_chain(dt)
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        mask = ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, row_capacity=capacity)
        assert mask.shape == (capacity, smollm2.words)
        picked = sampler(jnp.zeros((capacity, smollm2.size)), mask)
        assert np.asarray(picked)[: batch * nodes].min() >= 0
    assert sampler._cache_size() == 1


def test_device_put_aliasing_is_real_and_handled(smollm2, monkeypatch):
    """The trap: on the CPU platform ``jax.device_put`` wraps suitably aligned numpy memory
    without copying, so a reused host buffer would change an uploaded mask. The control shows
    the aliasing happens; the library's masks alias their pooled buffer and still survive
    later builds because the pool lends, not reuses, memory JAX still holds."""
    from portable_spec.hostbuffers import aligned_empty

    raw = aligned_empty(4 * 64).view(np.int32).reshape(8, 8)
    raw[:] = 1
    x = jax.device_put(raw, jax.devices("cpu")[0])
    raw[:] = 2
    assert int(np.asarray(x)[0, 0]) == 2, "control: JAX no longer aliases host memory here"

    from portable_spec.hostbuffers import HostBufferPool

    blocks = []

    def recording_allocate(nbytes):
        block = aligned_empty(nbytes)
        blocks.append(block)
        return block, None

    backend = ps.get_backend("jax")
    monkeypatch.setattr(backend, "pool", HostBufferPool(recording_allocate))
    compiled = smollm2.grammars["builtin_json"]
    brace = smollm2.tokens.index("{")
    tree = ps.GrammarTree.from_linear_chain(jnp.asarray([[0, brace]], dtype=jnp.int32))
    first = ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled)], tree, smollm2.size)
    want = expected_mask([Request(compiled)], *tree.resolve(), smollm2.size, smollm2.words)
    pointer = first.unsafe_buffer_pointer()
    assert any(b.ctypes.data <= pointer < b.ctypes.data + b.nbytes for b in blocks)
    assert backend.pool.stats()["lent"] == 1  # the mask's host block is still lent to JAX
    for _ in range(10):
        other = ps.GrammarTree.from_linear_chain(jnp.asarray([[0, 5]], dtype=jnp.int32))
        ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled)], other, smollm2.size)
    np.testing.assert_array_equal(np.asarray(first), want)


def test_staging_reads_one_replica_and_shards():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(devices[:8]), ("b",))
    data = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    replicated = jax.device_put(data, NamedSharding(mesh, PartitionSpec()))
    sharded = jax.device_put(data, NamedSharding(mesh, PartitionSpec("b")))
    staged = JaxBackend().stage([replicated, sharded, jnp.asarray(data)])
    assert [kind for kind, _ in staged._parts] == ["one", "whole", "whole"]
    for got in staged.resolve():
        np.testing.assert_array_equal(got, data)
    along_nodes = jax.device_put(
        np.zeros((2, 8), np.int32), NamedSharding(mesh, PartitionSpec(None, "b"))
    )
    tree = ps.GrammarTree.from_device(along_nodes, along_nodes, along_nodes)  # addressable: ok
    assert tree.resolve()[0].shape == (2, 8)


def test_jax_default_int32_and_strings_for_devices(smollm2):
    compiled = smollm2.grammars["regex"]
    dt = jnp.zeros((2, 3))
    with pytest.raises(TypeError, match="integer dtype, got float32"):
        ps.GrammarTree.from_linear_chain(dt)
    tree = ps.GrammarTree.from_linear_chain(jnp.zeros((2, 3), dtype=jnp.int32))
    mask = ps.build_grammar_vocab_mask(
        [xgr.GrammarMatcher(compiled), None], tree, smollm2.size, device="cpu:1"
    )
    assert mask.devices() == {jax.devices("cpu")[1]}
