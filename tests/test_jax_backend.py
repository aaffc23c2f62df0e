"""JAX-specific behaviour: jit/donation, no materialised unpacking, static shapes, staging,
and the host-aliasing trap of ``jax.device_put`` on the CPU platform."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import xgrammar as xgr  # noqa: E402
from _oracle import ProtocolMatcher, Request, expected_mask  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec,
    SingleDeviceSharding,
)
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


def _platform_devices(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:
        return []


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_unpacking_is_fused_not_materialised(platform):
    """The compiled apply needs no temporary buffer and writes into the donated logits:
    no [rows, words, 32] (or [rows, vocab] int) array exists. Compiled for each platform
    present (``JAX_PLATFORMS=cuda,cpu`` or ``tpu,cpu`` runs it there too)."""
    devices = _platform_devices(platform)
    if not devices:
        pytest.skip(f"no JAX {platform} device here")
    on = SingleDeviceSharding(devices[0])
    rows, vocab = 64, 131072
    f = jax.jit(apply_vocab_mask_jax, donate_argnums=0)
    compiled = f.lower(
        jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=on),
        jax.ShapeDtypeStruct((rows, vocab // 32), jnp.int32, sharding=on),
    ).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip(f"JAX on {platform} reports no memory analysis")
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
    cpu = jax.devices("cpu")[0]  # the trap is the CPU platform's
    tree = ps.GrammarTree.from_linear_chain(jax.device_put(np.array([[0, brace]], np.int32), cpu))
    first = ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled)], tree, smollm2.size)
    assert first.devices() == {cpu}
    want = expected_mask([Request(compiled)], *tree.resolve(), smollm2.size, smollm2.words)
    pointer = first.unsafe_buffer_pointer()
    assert any(b.ctypes.data <= pointer < b.ctypes.data + b.nbytes for b in blocks)
    assert backend.pool.stats()["lent"] == 1  # the mask's host block is still lent to JAX
    for _ in range(10):
        other = ps.GrammarTree.from_linear_chain(jax.device_put(np.array([[0, 5]], np.int32), cpu))
        ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled)], other, smollm2.size)
    np.testing.assert_array_equal(np.asarray(first), want)


def test_staging_reads_one_replica_and_shards():
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


# -- helpers for the sharded tests ---------------------------------------------------------------
def _cpu8() -> list:
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return devices[:8]


def _placement(kind: str):
    if kind == "default-device":  # the accelerator when JAX_PLATFORMS puts one first
        return jax.devices()[0]
    if kind == "one-device":
        return jax.devices("cpu")[0]
    mesh = Mesh(np.array(_cpu8()), ("b",))
    return NamedSharding(mesh, PartitionSpec("b") if kind == "batch-sharded" else PartitionSpec())


def _json_case(smollm2, batch: int):
    """``batch`` requests of a small JSON tree: root -> "{" -> '"' and root -> "x" (rejected);
    odd requests unconstrained."""
    brace, quote, x = (smollm2.tokens.index(t) for t in ("{", '"', "x"))
    nt = np.tile([1, 2, -1, -1], (batch, 1))
    ns = np.tile([-1, 3, -1, -1], (batch, 1))
    dt = np.tile([0, brace, quote, x], (batch, 1))
    compiled = smollm2.grammars["builtin_json"]
    requests = [Request(compiled) if b % 2 == 0 else None for b in range(batch)]
    want = expected_mask(requests, nt, ns, dt, smollm2.size, smollm2.words)
    return requests, (nt, ns, dt), want


def _fresh(requests):
    return [None if r is None else r.fresh() for r in requests]


def _untouched(requests):
    """Recording matchers: a check that raises before any matcher moves leaves them empty."""
    return [None if r is None else ProtocolMatcher(r.fresh()) for r in requests]


# -- issue 14 item 12: donated tree arrays ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["default-device", "one-device", "batch-sharded", "replicated"])
def test_tree_arrays_donated_right_after_from_device(kind, smollm2):
    """Engines donate the tree arrays to their next jit right after ``from_device``. On the
    CPU the donated buffers are reused for that jit's outputs, so their memory is overwritten;
    the build still sees what the arrays held at ``from_device``."""
    requests, host, want = _json_case(smollm2, 8)
    place = _placement(kind)
    arrays = [jax.device_put(a.astype(np.int32), place) for a in host]
    tree = ps.GrammarTree.from_device(*arrays)
    scramble = jax.jit(lambda *xs: tuple(x + 1000 for x in xs), donate_argnums=(0, 1, 2))
    outs = jax.block_until_ready(scramble(*arrays))
    assert all(a.is_deleted() for a in arrays)
    for out, a in zip(outs, host, strict=True):
        np.testing.assert_array_equal(np.asarray(out), a + 1000)
    mask = ps.build_grammar_vocab_mask(_fresh(requests), tree, smollm2.size)
    np.testing.assert_array_equal(np.asarray(mask), want)


def test_staging_copy_is_a_real_device_copy():
    """The jitted device-side copy is not forwarded or aliased: other buffers, which outlive
    the caller's deleted arrays."""
    data = np.arange(24, dtype=np.int32).reshape(4, 6)
    x = jax.device_put(data, jax.devices("cpu")[0])
    staged = JaxBackend().stage([x, x])
    copies = [value for _, value in staged._parts]
    pointers = {c.unsafe_buffer_pointer() for c in copies}
    assert x.unsafe_buffer_pointer() not in pointers and len(pointers) == 2
    x.delete()
    for got in staged.resolve():
        np.testing.assert_array_equal(got, data)


def test_array_deleted_before_from_device_is_named():
    ok = jnp.zeros((2, 3), jnp.int32)
    gone = jnp.zeros((2, 3), jnp.int32)
    gone.delete()
    with pytest.raises(ValueError, match="retrieve_next_sibling: .*deleted"):
        ps.GrammarTree.from_device(ok, gone, ok)
    with pytest.raises(ValueError, match="draft_tokens: .*deleted"):
        ps.GrammarTree.from_linear_chain(gone)


# -- items 13 and 20: no None with a static capacity -------------------------------------------------
def test_no_grammar_with_row_capacity_gives_the_all_allowed_mask(smollm2):
    """A step where no request has a grammar: with ``row_capacity`` the mask has the same
    shape and placement as on other steps, so the engine's jitted sampler compiles once."""
    rows = NamedSharding(Mesh(np.array(_cpu8()), ("b",)), PartitionSpec("b"))
    sampler = jax.jit(lambda logits, mask: jnp.argmax(apply_vocab_mask_jax(logits, mask), -1))
    compiled = smollm2.grammars["regex"]
    capacity, batch, nodes = 64, 8, 4
    logits = jax.device_put(np.zeros((capacity, smollm2.size), np.float32), rows)
    masks = []
    for constrained in (True, False, True):
        tree = ps.GrammarTree.from_linear_chain(
            jax.device_put(np.zeros((batch, nodes), np.int32), rows)
        )
        grammars = [xgr.GrammarMatcher(compiled) if constrained else None for _ in range(batch)]
        mask = ps.build_grammar_vocab_mask(grammars, tree, smollm2.size, row_capacity=capacity)
        assert mask is not None and mask.shape == (capacity, smollm2.words)
        assert mask.sharding == rows
        sampler(logits, mask)
        masks.append(mask)
    assert (np.asarray(masks[1]) == -1).all()
    assert sampler._cache_size() == 1
    # without a capacity, a single-process build still says "no mask this step"
    assert ps.build_grammar_vocab_mask([None] * batch, tree, smollm2.size) is None


# -- item 14: row capacity per row shard -------------------------------------------------------------
def test_row_capacity_pads_each_row_shard(smollm2):
    """Padding went to the global end, moving 28 of 32 rows off their request's device. Now
    every row shard holds its own requests' rows first, then its padding."""
    mesh = Mesh(np.array(_cpu8()).reshape(4, 2), ("data", "model"))
    batch_sharded = NamedSharding(mesh, PartitionSpec("data"))
    requests, host, want = _json_case(smollm2, 8)
    arrays = [jax.device_put(a.astype(np.int32), batch_sharded) for a in host]
    tree = ps.GrammarTree.from_device(*arrays)
    capacity = 48  # 4 row shards of 12 rows: 2 requests of 4 nodes (8 rows) + 4 padding
    mask = ps.build_grammar_vocab_mask(_fresh(requests), tree, smollm2.size, row_capacity=capacity)
    assert mask.shape == (capacity, smollm2.words) and mask.sharding == batch_sharded
    tree_blocks = {s.device: s.index[0].start // 2 for s in arrays[2].addressable_shards}
    for shard in mask.addressable_shards:
        block = shard.index[0].start // 12
        assert tree_blocks[shard.device] == block  # the device holding these requests
        rows = np.asarray(shard.data)
        np.testing.assert_array_equal(rows[:8], want[8 * block : 8 * block + 8])
        assert (rows[8:] == -1).all()


def test_row_capacity_the_placement_cannot_divide_is_refused(smollm2):
    rows = NamedSharding(Mesh(np.array(_cpu8()), ("b",)), PartitionSpec("b"))
    requests, host, _ = _json_case(smollm2, 8)
    tree = ps.GrammarTree.from_device(*(jax.device_put(a.astype(np.int32), rows) for a in host))
    matchers = _untouched(requests)
    with pytest.raises(ValueError, match="row_capacity = 36 cannot be split evenly .* 8"):
        ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, row_capacity=36)
    six = ps.GrammarTree.from_host(*(a[:6] for a in host))
    with pytest.raises(ValueError, match="batch of 6 requests cannot be split evenly"):
        ps.build_grammar_vocab_mask(matchers[:6], six, smollm2.size, device=rows, row_capacity=64)
    three = ps.GrammarTree.from_host(*(a[:3, :3] for a in host))
    with pytest.raises(ValueError, match="9 rows .* cannot be split evenly .* row_capacity"):
        ps.build_grammar_vocab_mask(matchers[:3], three, smollm2.size, device=rows)
    assert all(m is None or m.calls == [] for m in matchers)


# -- item 15: device strings -------------------------------------------------------------------------
def test_device_strings_name_local_devices(smollm2):
    """Strings are read by the tree's framework; JAX resolves them among this process's
    devices (``jax.local_devices``; the multi-process test checks another process's view)."""
    requests, host, want = _json_case(smollm2, 2)
    cpu0 = jax.devices("cpu")[0]
    tree = ps.GrammarTree.from_device(*(jax.device_put(a.astype(np.int32), cpu0) for a in host))
    mask = ps.build_grammar_vocab_mask(_fresh(requests), tree, smollm2.size, device="cpu:1")
    assert mask.devices() == {jax.local_devices(backend="cpu")[1]}
    np.testing.assert_array_equal(np.asarray(mask), want)
    matchers = _untouched(requests)
    for bad, message in [
        ("cpu:99", "this process has .* local cpu device"),
        ("cpu:x", "expected 'platform' or 'platform:index'"),
        ("nosuchplatform", "no 'nosuchplatform' platform here"),
    ]:
        with pytest.raises(ValueError, match=message):
            ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, device=bad)
    assert all(m is None or m.calls == [] for m in matchers)


# -- item 16: shardings other than NamedSharding ------------------------------------------------------
def _gspmd(named):
    try:
        from jax._src.sharding_impls import GSPMDSharding
    except ImportError:  # pragma: no cover - private path moved
        pytest.skip("this JAX has no GSPMDSharding")
    return GSPMDSharding(named._device_assignment, named._to_xla_hlo_sharding(2))


def test_other_shardings_place_the_mask_like_the_tree(smollm2):
    """A tree sharded by a ``GSPMDSharding`` (devices in a shuffled order): the mask's rows
    live with their requests; ``device=`` takes such a sharding too, with per-shard padding."""
    devices = _cpu8()
    shuffled = [devices[i] for i in (3, 0, 7, 5, 1, 6, 2, 4)]
    named = NamedSharding(Mesh(np.array(shuffled), ("b",)), PartitionSpec("b"))
    sharding = _gspmd(named)
    requests, host, want = _json_case(smollm2, 8)
    arrays = [jax.device_put(a.astype(np.int32), sharding) for a in host]
    assert not isinstance(arrays[0].sharding, NamedSharding)
    tree = ps.GrammarTree.from_device(*arrays)
    mask = ps.build_grammar_vocab_mask(_fresh(requests), tree, smollm2.size)
    np.testing.assert_array_equal(np.asarray(mask), want)
    tree_blocks = {s.device: s.index[0].start for s in arrays[0].addressable_shards}
    for shard in mask.addressable_shards:
        assert shard.index[0].start == 4 * tree_blocks[shard.device]  # 4 nodes per request
    padded = ps.build_grammar_vocab_mask(
        _fresh(requests),
        ps.GrammarTree.from_host(*host),
        smollm2.size,
        device=sharding,
        row_capacity=40,
    )
    assert padded.sharding == sharding
    for shard in padded.addressable_shards:
        block = shard.index[0].start // 5
        rows = np.asarray(shard.data)
        np.testing.assert_array_equal(rows[:4], want[4 * block : 4 * block + 4])
        assert (rows[4:] == -1).all()


def test_a_sharding_that_cannot_hold_a_mask_is_refused(smollm2):
    mesh = Mesh(np.array(_cpu8()), ("b",))
    requests, host, _ = _json_case(smollm2, 8)
    tree = ps.GrammarTree.from_host(*host)
    matchers = _untouched(requests)
    with pytest.raises(ValueError, match="2-D .* cannot place it"):
        ps.build_grammar_vocab_mask(
            matchers, tree, smollm2.size, device=NamedSharding(mesh, PartitionSpec("b", None, None))
        )
    assert all(m is None or m.calls == [] for m in matchers)


# -- item 17: one compiled computation -------------------------------------------------------------
@contextmanager
def _compilations() -> Iterator[list[str]]:
    """The XLA compilations that run inside the block (``jax.log_compiles`` messages)."""
    messages: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Finished XLA compilation"):
                messages.append(record.getMessage())

    handler = Record(level=logging.DEBUG)
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield messages
    finally:
        logger.removeHandler(handler)


def test_eager_apply_is_one_compiled_computation():
    """Called outside any jit on a shape never seen before, the apply compiles one
    executable (not one per primitive, each with its own logits-sized temporaries), and inside
    the engine's jit it is inlined (no nested call)."""
    rows, vocab = 5, 1017  # a shape no other test uses
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(3)
    host_logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    host_mask = rng.integers(-(2**31), 2**31, (rows, 32), dtype=np.int64).astype(np.int32)
    logits, mask = jax.block_until_ready(
        (jax.device_put(host_logits, cpu), jax.device_put(host_mask, cpu))
    )
    with _compilations() as compiled:
        out = jax.block_until_ready(ps.apply_vocab_mask(logits, mask))
    assert len(compiled) == 1, compiled
    np.testing.assert_array_equal(np.asarray(out), _reference(host_logits, host_mask))
    engine_step = jax.jit(lambda lg, m: ps.apply_vocab_mask(lg, m) * 2)
    jaxpr = jax.make_jaxpr(engine_step.__wrapped__)(logits, mask)
    calls = {e.params.get("name") for e in jaxpr.eqns if "name" in e.params}
    assert "_apply_vocab_mask" not in calls  # inlined, not a nested call
    assert "call @_apply_vocab_mask" not in engine_step.lower(logits, mask).as_text()
    with pytest.raises(TypeError, match="floating dtype"):
        ps.apply_vocab_mask(jnp.zeros((rows, vocab), jnp.int32), mask)
    with pytest.raises(ValueError, match="same rows"):
        ps.apply_vocab_mask(logits, mask[:3])


# -- item 24: vocab-sharded logits ------------------------------------------------------------------
def test_vocab_sharded_logits(smollm2):
    """Tensor-parallel logits ``P('data', 'model')``: the default row-sharded mask and a mask
    split along its words too both apply correctly inside a jit; splitting the words needs
    ``(vocab / parts) % 32 == 0``."""
    mesh = Mesh(np.array(_cpu8()).reshape(4, 2), ("data", "model"))
    requests, host, want = _json_case(smollm2, 8)
    tree = ps.GrammarTree.from_device(
        *(
            jax.device_put(a.astype(np.int32), NamedSharding(mesh, PartitionSpec("data")))
            for a in host
        )
    )
    vocab = smollm2.size  # 49152: 24576 per model shard, a multiple of 32
    rng = np.random.default_rng(5)
    host_logits = rng.standard_normal((8 * 4, vocab)).astype(np.float32)
    tp = NamedSharding(mesh, PartitionSpec("data", "model"))
    sample = jax.jit(apply_vocab_mask_jax, out_shardings=tp)
    default = ps.build_grammar_vocab_mask(_fresh(requests), tree, vocab)
    assert default.sharding == NamedSharding(mesh, PartitionSpec("data"))
    split = ps.build_grammar_vocab_mask(_fresh(requests), tree, vocab, device=tp)
    assert split.sharding == tp
    for mask in (default, split):
        masked = sample(jax.device_put(host_logits, tp), mask)
        np.testing.assert_array_equal(np.asarray(masked), _reference(host_logits, want))
    matchers = _untouched(requests)
    with pytest.raises(ValueError, match=r"\(vocab_size / 2\) % 32 == 0"):
        ps.build_grammar_vocab_mask(matchers, tree, vocab + 48, device=tp)
    assert all(m is None or m.calls == [] for m in matchers)
