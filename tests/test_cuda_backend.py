"""CUDA-only behaviour of the torch backend: the traps of asynchronous copies, streams and
xgrammar's GPU kernels. Everything here needs a CUDA device and skips without one (this file
is part 1 of ``scripts/device-check.sh``).

Several tests first run an *unsafe* variant of the library's mechanism (a control) and
assert that it does corrupt the result: that shows the scenario really exercises the race,
so the safe run passing means something.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import xgrammar as xgr  # noqa: E402
from _oracle import Request, expected_mask  # noqa: E402
from portable_spec.backends.cuda import (  # noqa: E402
    apply_compact_mask_torch,
    apply_vocab_mask_torch,
    mask_ready_event,
)
from portable_spec.backends.cuda.apply import MAX_KERNEL_ELEMENTS  # noqa: E402
from portable_spec.backends.cuda.devices import copy_stream  # noqa: E402
from portable_spec.backends.cuda.staging import stage_tensors  # noqa: E402

import portable_spec as ps  # noqa: E402

CUDA = torch.device("cuda", 0)
# GPU clock cycles for torch.cuda._sleep: about 0.25 to 0.5 s on current GPUs, far longer
# than any host work a test does in the meantime.
LONG = 1_000_000_000


def _reference(logits: torch.Tensor, mask: np.ndarray) -> np.ndarray:
    """Masked logits computed on the host in float64 (kept logits exact, dropped -inf)."""
    host = logits.detach().float().cpu().numpy().astype(np.float64)
    host_2d = host.reshape(1, -1) if host.ndim == 1 else host
    mask_2d = mask.reshape(1, -1) if mask.ndim == 1 else mask
    covered = min(host_2d.shape[1], 32 * mask_2d.shape[1])
    bits = np.unpackbits(mask_2d.view(np.uint8), axis=1, bitorder="little")[:, :covered]
    host_2d[:, :covered][bits == 0] = -np.inf
    return host


def _random_mask(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, shape, dtype=np.int64).astype(np.int32)


def _xgrammar_cuda_kernel_loads() -> str | None:
    try:
        import xgrammar.kernels.apply_token_bitmask_inplace_cuda  # noqa: F401
    except Exception as exc:  # nvcc missing, compile failure: say why
        return f"xgrammar's CUDA kernel does not build here: {exc!r}"[:300]
    return None


def _kernel(name: str) -> str:
    if name == "cuda":
        reason = _xgrammar_cuda_kernel_loads()
        if reason:
            pytest.skip(reason)
    return name


# -- apply ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [100, 49155, 131072 + 7])
def test_apply_kernels_match_the_reference(kernel, dtype, vocab):
    """xgrammar's Triton and CUDA kernels through apply_vocab_mask_torch, odd widths."""
    kernel = _kernel(kernel)
    rng = np.random.default_rng(vocab)
    mask = _random_mask(rng, (37, -(-vocab // 32)))
    logits = torch.randn(37, vocab, device=CUDA).to(dtype)
    want = _reference(logits, mask)
    out = apply_vocab_mask_torch(logits, torch.from_numpy(mask).to(CUDA), kernel=kernel)
    assert out is logits
    np.testing.assert_array_equal(logits.float().cpu().numpy().astype(np.float64), want)


@pytest.mark.parametrize("kernel", ["auto", "triton", "cuda"])
def test_apply_one_row_masks(kernel):
    """Item 1: a [vocab] logits row with a [words] mask. The Triton kernel reads the mask's
    row stride as its width, 1 for a 1-D mask: without the reshape only tokens < 32 are
    masked correctly."""
    kernel = _kernel(kernel)
    rng = np.random.default_rng(1)
    vocab = 49152
    mask = _random_mask(rng, (vocab // 32,))
    logits = torch.randn(vocab, device=CUDA)
    want = _reference(logits, mask)
    if kernel == "auto":
        ps.apply_vocab_mask(logits, torch.from_numpy(mask).to(CUDA))
    else:
        apply_vocab_mask_torch(logits, torch.from_numpy(mask).to(CUDA), kernel=kernel)
    np.testing.assert_array_equal(logits.cpu().numpy().astype(np.float64), want)


@pytest.mark.parametrize("kernel", ["triton", "cuda"])
def test_apply_strided_logits(kernel):
    """Row-padded views go to the kernels as they are; column-strided ones through a copy;
    both write through to the caller's tensor."""
    kernel = _kernel(kernel)
    rng = np.random.default_rng(2)
    vocab = 1000
    mask = _random_mask(rng, (8, -(-vocab // 32)))
    padded = torch.randn(8, vocab + 64, device=CUDA, dtype=torch.bfloat16)
    view = padded[:, :vocab]
    tail = padded[:, vocab:].clone()
    want = _reference(view, mask)
    apply_vocab_mask_torch(view, torch.from_numpy(mask).to(CUDA), kernel=kernel)
    np.testing.assert_array_equal(view.float().cpu().numpy().astype(np.float64), want)
    assert torch.equal(padded[:, vocab:], tail)  # the padding columns are untouched
    base = torch.randn(vocab, 8, device=CUDA)
    transposed = base.t()
    want = _reference(transposed, mask)
    apply_vocab_mask_torch(transposed, torch.from_numpy(mask).to(CUDA), kernel=kernel)
    np.testing.assert_array_equal(base.t().cpu().numpy().astype(np.float64), want)


def test_apply_on_a_device_that_is_not_current():
    """Item 2: Triton launches on the current device; the apply must make the logits' device
    current. Needs two GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    other = torch.device("cuda", 1)
    rng = np.random.default_rng(3)
    mask = _random_mask(rng, (4, 64))
    logits = torch.randn(4, 2048, device=other)
    want = _reference(logits, mask)
    with torch.cuda.device(0):
        ps.apply_vocab_mask(logits, torch.from_numpy(mask).to(other))
    torch.cuda.synchronize(other)
    np.testing.assert_array_equal(logits.cpu().numpy().astype(np.float64), want)


# -- staging ------------------------------------------------------------------------------------
def _slow_then(values: torch.Tensor) -> torch.Tensor:
    """``values`` on the GPU, produced only after a long GPU sleep on the current stream."""
    torch.cuda._sleep(LONG)
    return values.to(CUDA, non_blocking=True) + 0


def test_resolve_waits_for_the_copy_event():
    """The trap: a pinned host tensor filled by a non_blocking copy is garbage until the
    copy's event fires. resolve() must wait for exactly that event."""
    values = torch.arange(64 * 64, dtype=torch.int64).reshape(64, 64) % 61 - 1
    device_values = _slow_then(values)
    tree = ps.GrammarTree.from_device(device_values, device_values, device_values)
    for got in tree.resolve():
        np.testing.assert_array_equal(got, values.numpy())


def test_staging_from_a_side_stream():
    """Tree arrays produced on a non-default stream, staged on that stream."""
    side = torch.cuda.Stream()
    values = torch.arange(32 * 16, dtype=torch.int32).reshape(32, 16) % 13 - 1
    with torch.cuda.stream(side):
        produced = _slow_then(values)
        tree = ps.GrammarTree.from_device(produced, produced, produced)
    for got in tree.resolve():
        np.testing.assert_array_equal(got, values.numpy())


def test_freed_source_cannot_be_reused_under_the_copy():
    """Item 4: the tree tensor was allocated on a side stream, the copy is queued on the
    (busy) current stream, and the caller drops the tensor at once. Without the library
    keeping it, the allocator hands its block to the next allocation on the side stream,
    which overwrites it before the copy runs."""
    side = torch.cuda.Stream()
    values = (torch.arange(256 * 64, dtype=torch.int64) % 97).reshape(256, 64)
    expected = values.numpy().copy()

    def scenario(keep_alive: bool) -> np.ndarray:
        with torch.cuda.stream(side):
            source = values.to(CUDA)
        side.synchronize()
        torch.cuda._sleep(LONG)  # the current stream is busy: the copy waits behind this
        if keep_alive:
            tree = ps.GrammarTree.from_device(source, source, source)
            staged = None
        else:  # control: a copy that neither records the stream nor holds the tensor
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(source, non_blocking=True)
            staged = torch.cuda.Event()
            staged.record()
        del source
        with torch.cuda.stream(side):
            torch.full(values.shape, -7, dtype=values.dtype, device=CUDA)  # reuses the block?
        if keep_alive:
            return tree.resolve()[2]
        staged.synchronize()
        return host.numpy()

    assert not np.array_equal(scenario(keep_alive=False), expected), (
        "control: the allocator did not reuse the freed block; the scenario proves nothing"
    )
    np.testing.assert_array_equal(scenario(keep_alive=True), expected)


@pytest.mark.parametrize("bits", [16, 32, 64])
def test_unsigned_tree_dtypes(bits):
    """Item 5: unsigned tree dtypes travel as raw bits of the signed type of their width."""
    raw = np.array([[1, 2, 2**bits - 1], [0, 3, 5]], dtype=np.uint64).astype(f"uint{bits}")
    signed = torch.from_numpy(raw.view(f"int{bits}")).to(CUDA)
    unsigned = signed.view(getattr(torch, f"uint{bits}"))
    tree = ps.GrammarTree.from_device(unsigned, unsigned, unsigned)
    want = raw.view(np.int64) if bits == 64 else raw.astype(np.int64)
    for got in tree.resolve():
        np.testing.assert_array_equal(got, want)


def test_failed_staging_returns_its_buffers():
    """Item 10: a staging that fails half way gives back what it took."""
    backend = ps.get_backend("cuda")
    before = backend.pool.stats()["lent"]
    good = torch.zeros(4, 4, dtype=torch.int64, device=CUDA)
    bad = torch.zeros(4, 4, dtype=torch.float32, device=CUDA)
    with pytest.raises(TypeError):
        stage_tensors([good, bad], backend.pool)
    assert backend.pool.stats()["lent"] == before


def test_pinned_blocks_are_counted_as_torch_holds_them():
    """Item 10: torch rounds pinned allocations up to a power of two; the pool allocates
    (and counts) exactly that."""
    backend = ps.get_backend("cuda")
    buffer = backend.pool.acquire((3, 1000 + 1), np.int32)  # an odd size
    try:
        assert buffer.block.nbytes & (buffer.block.nbytes - 1) == 0
        assert buffer.owner.is_pinned()
    finally:
        backend.pool.release(buffer)


# -- upload -------------------------------------------------------------------------------------
def _json_case(smollm2, token: int, batch: int = 2):
    compiled = smollm2.grammars["builtin_json"]
    requests = [Request(compiled) for _ in range(batch)]
    dt = np.zeros((batch, 3), dtype=np.int64)
    dt[:, 1] = token
    dt[:, 2] = smollm2.tokens.index('"')
    tree = ps.GrammarTree.from_linear_chain(torch.from_numpy(dt).to(CUDA))
    want = expected_mask(requests, *tree.resolve(), smollm2.size, smollm2.words)
    return [r.fresh() for r in requests], tree, want


def test_upload_overlaps_the_forward(smollm2):
    """Item 7: the upload runs on the copy stream while the current stream is still busy
    (with a same-stream upload it would wait behind the forward)."""
    matchers, tree, want = _json_case(smollm2, smollm2.tokens.index("{"))
    torch.cuda._sleep(LONG)  # the verify forward
    mask = ps.build_grammar_vocab_mask(matchers, tree, smollm2.size)
    ready = mask_ready_event(mask)
    assert ready is not None
    deadline = time.monotonic() + 5
    while not ready.query():
        assert time.monotonic() < deadline, "the upload did not finish while the forward ran"
        time.sleep(0.0005)
    assert not torch.cuda.current_stream().query(), "the forward ended first: inconclusive"
    torch.cuda.synchronize()
    np.testing.assert_array_equal(mask.cpu().numpy(), want)


def test_sampler_waits_for_a_slow_upload(smollm2):
    """The current stream (and another stream that applies the mask) wait for the upload's
    event: with the copy stream held up, the sampler still reads the finished mask."""
    logits_host = np.random.default_rng(5).standard_normal((6, smollm2.size)).astype(np.float32)
    for consumer in ("current", "other"):
        matchers, tree, want = _json_case(smollm2, smollm2.tokens.index("["), batch=2)
        with torch.cuda.stream(copy_stream(CUDA)):
            torch.cuda._sleep(LONG)  # delays the upload queued next on the copy stream
        mask = ps.build_grammar_vocab_mask(matchers, tree, smollm2.size)
        logits = torch.from_numpy(logits_host).to(CUDA)
        if consumer == "other":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())  # logits are ready on it
            with torch.cuda.stream(side):
                ps.apply_vocab_mask(logits, mask)
            side.synchronize()
        else:
            ps.apply_vocab_mask(logits, mask)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(
            logits.cpu().numpy().astype(np.float64), _reference(torch.from_numpy(logits_host), want)
        )


def test_pinned_buffer_not_rewritten_under_an_inflight_upload(smollm2, monkeypatch):
    """Item 6: build step A with its upload held up on the copy stream, then build step B at
    once. B must not land in A's pinned buffer while A's copy is pending. The control
    (returning buffers to the pool as soon as the upload is queued) must corrupt A."""
    backend = ps.get_backend("cuda")
    brace, bracket = smollm2.tokens.index("{"), smollm2.tokens.index("[")

    def two_steps() -> bool:
        matchers_a, tree_a, want_a = _json_case(smollm2, brace)
        matchers_b, tree_b, want_b = _json_case(smollm2, bracket)
        assert not np.array_equal(want_a, want_b)
        with torch.cuda.stream(copy_stream(CUDA)):
            torch.cuda._sleep(LONG)
        mask_a = ps.build_grammar_vocab_mask(matchers_a, tree_a, smollm2.size)
        mask_b = ps.build_grammar_vocab_mask(matchers_b, tree_b, smollm2.size)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(mask_b.cpu().numpy(), want_b)
        return np.array_equal(mask_a.cpu().numpy(), want_a)

    with monkeypatch.context() as patch:
        patch.setattr(
            backend.pool, "after", lambda buffer, done, wait: backend.pool.release(buffer)
        )
        assert not two_steps(), "control: reuse-on-release did not corrupt; test is vacuous"
    assert two_steps()


def test_a_thousand_steps_with_the_sampler_reading_each_mask(smollm2):
    """Upload, apply, drop: 1000 steps reusing the pool while the sampler kernel reads the
    previous step's mask. Every step's greedy pick equals the host reference."""
    compiled = smollm2.grammars["builtin_json"]
    patterns = [smollm2.tokens.index(t) for t in ("{", "[", '"', "1")]
    rng = np.random.default_rng(6)
    batch, nodes = 4, 3
    logits_host = rng.standard_normal((batch * nodes, smollm2.size)).astype(np.float32)
    logits_dev = torch.from_numpy(logits_host).to(CUDA)
    steps = {}
    for token in patterns:
        requests = [Request(compiled) for _ in range(batch)]
        dt = np.zeros((batch, nodes), dtype=np.int64)
        dt[:, 1] = token
        dt[:, 2] = rng.choice(patterns, batch)
        links = ps.GrammarTree.from_linear_chain(dt).resolve()
        want = expected_mask(requests, *links, smollm2.size, smollm2.words)
        pick = _reference(torch.from_numpy(logits_host), want).argmax(axis=1)
        matchers = [r.fresh() for r in requests]  # builds never move them: reused each step
        steps[token] = (matchers, torch.from_numpy(dt).to(CUDA), pick)
    picks = []
    backend = ps.get_backend("cuda")
    for step in range(1000):
        token = patterns[step % len(patterns)]
        matchers, drafts, _ = steps[token]
        tree = ps.GrammarTree.from_linear_chain(drafts)
        mask = ps.build_grammar_vocab_mask(matchers, tree, smollm2.size)
        logits = logits_dev.clone()
        ps.apply_vocab_mask(logits, mask)
        picks.append((token, logits.argmax(dim=1)))
        del mask  # the pool may hand its buffer to the next step at once
    torch.cuda.synchronize()
    for token, pick in picks:
        np.testing.assert_array_equal(pick.cpu().numpy(), steps[token][2])
    assert backend.pool.stats()["lent"] == 0


def test_cpu_masks_are_not_pinned_pool_memory(smollm2):
    """Item 9: a mask for the CPU is pageable memory of its own, never a pinned block that
    returns to the pool while the caller's own non_blocking copy may still read it."""
    backend = ps.get_backend("cuda")
    matchers, tree, want = _json_case(smollm2, smollm2.tokens.index("{"))
    mask = ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, device="cpu")
    assert mask.device.type == "cpu" and not mask.is_pinned()
    on_gpu = mask.to(CUDA, non_blocking=True)
    del mask
    for _ in range(5):  # later builds may reuse the CPU mask's block at once
        m, t, _ = _json_case(smollm2, smollm2.tokens.index("["))
        ps.build_grammar_vocab_mask(m, t, smollm2.size, device="cpu")
    torch.cuda.synchronize()
    np.testing.assert_array_equal(on_gpu.cpu().numpy(), want)
    assert backend.pool.stats()["lent"] == 0


def test_mixed_cpu_and_cuda_inputs(smollm2):
    """Item 3: a CPU tensor listed first must not send the mask to the CPU."""
    nt = torch.tensor([[1, -1]])
    ns = torch.tensor([[-1, -1]], device=CUDA)
    dt = torch.tensor([[0, smollm2.tokens.index("{")]], device=CUDA)
    tree = ps.GrammarTree.from_device(nt, ns, dt)
    assert tree.device.type == "cuda"
    mask = ps.build_grammar_vocab_mask(
        [xgr.GrammarMatcher(smollm2.grammars["builtin_json"])], tree, smollm2.size
    )
    assert mask.device.type == "cuda"


def test_from_host_refuses_device_tensors():
    nt = torch.tensor([[1, -1]], device=CUDA)
    with pytest.raises(TypeError, match="not a host array"):
        ps.GrammarTree.from_host(nt, nt, nt)


def test_mask_device_mismatch_is_an_error():
    with pytest.raises(ValueError, match="mask is on cpu but logits are on cuda"):
        ps.apply_vocab_mask(torch.zeros(2, 32, device=CUDA), torch.zeros(2, 1, dtype=torch.int32))


# -- compact masks ----------------------------------------------------------------------------
def _random_compact(rng, num_rows, words, listed, capacity, last=None):
    """A compact mask of ``listed`` random rows (``last``: force the last logits row in or
    out) and ``capacity - listed`` padding entries, on the host and on the GPU."""
    choice = rng.choice(num_rows - 1, size=listed - 1, replace=False)
    extra = num_rows - 1 if last or (last is None and rng.random() < 0.5) else None
    if extra is None:
        extra = int(rng.choice(np.setdiff1d(np.arange(num_rows - 1), choice)))
    rows = np.sort(np.append(choice, extra)).astype(np.int32)
    rows = np.concatenate([rows, np.full(capacity - listed, num_rows, np.int32)])
    bits = _random_mask(rng, (capacity, words))
    host = ps.CompactMask(rows, bits, num_rows, count=listed)
    on = ps.CompactMask(
        torch.from_numpy(rows).to(CUDA), torch.from_numpy(bits).to(CUDA), num_rows, listed
    )
    return host, on


@pytest.mark.parametrize("kernel", ["auto", "triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [100, 49155, 131072 + 7])
def test_compact_apply_kernels_match_the_dense_result(kernel, dtype, vocab):
    """xgrammar's kernels with indices=: listed rows masked, unlisted rows untouched, padding
    entries (row num_rows) a no-op whether the last logits row is listed or not."""
    kernel = _kernel(kernel)
    rng = np.random.default_rng(vocab)
    for last in (False, True):
        host, mask = _random_compact(rng, 37, -(-vocab // 32), 20, 26, last=last)
        logits = torch.randn(37, vocab, device=CUDA).to(dtype)
        before = logits.clone()
        want = _reference(logits, host.to_dense())
        out = apply_compact_mask_torch(logits, mask, kernel=kernel)
        assert out is logits
        np.testing.assert_array_equal(logits.float().cpu().numpy().astype(np.float64), want)
        unlisted = sorted(set(range(37)) - set(host.rows[:20].tolist()))
        assert torch.equal(logits[unlisted], before[unlisted])


@pytest.mark.parametrize("kernel", ["triton", "cuda"])
def test_compact_apply_strided_and_one_row(kernel):
    kernel = _kernel(kernel)
    rng = np.random.default_rng(7)
    vocab = 1000
    host, mask = _random_compact(rng, 8, -(-vocab // 32), 5, 6)
    padded = torch.randn(8, vocab + 64, device=CUDA, dtype=torch.bfloat16)
    view = padded[:, :vocab]
    tail = padded[:, vocab:].clone()
    want = _reference(view, host.to_dense())
    apply_compact_mask_torch(view, mask, kernel=kernel)
    np.testing.assert_array_equal(view.float().cpu().numpy().astype(np.float64), want)
    assert torch.equal(padded[:, vocab:], tail)
    one_host, one = _random_compact(rng, 1, -(-vocab // 32), 1, 3)
    row = torch.randn(vocab, device=CUDA)
    want = _reference(row, one_host.to_dense()[0])
    ps.apply_vocab_mask(row, one)
    np.testing.assert_array_equal(row.cpu().numpy().astype(np.float64), want)


def test_compact_upload_sends_the_listed_rows_and_orders_the_sampler(smollm2):
    """A compact mask built from a CUDA tree: only count rows (plus the index) on the device,
    the apply on the current stream and on another stream waits for the upload held up on the
    copy stream, and the logits equal the dense mask's."""
    logits_host = np.random.default_rng(8).standard_normal((6, smollm2.size)).astype(np.float32)
    for consumer in ("current", "other"):
        matchers, tree, want = _json_case(smollm2, smollm2.tokens.index("["), batch=2)
        with torch.cuda.stream(copy_stream(CUDA)):
            torch.cuda._sleep(LONG)
        mask = ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, layout="compact")
        assert mask.bits.device.type == "cuda" and mask.rows.device.type == "cuda"
        assert mask.bits.shape == (mask.count, smollm2.words)
        assert mask_ready_event(mask.bits) is not None
        logits = torch.from_numpy(logits_host).to(CUDA)
        if consumer == "other":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                ps.apply_vocab_mask(logits, mask)
            side.synchronize()
        else:
            ps.apply_vocab_mask(logits, mask)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(
            logits.cpu().numpy().astype(np.float64), _reference(torch.from_numpy(logits_host), want)
        )


def test_compact_max_rows_shapes_and_padding_on_the_device(smollm2):
    matchers, tree, want = _json_case(smollm2, smollm2.tokens.index("{"), batch=2)
    mask = ps.build_grammar_vocab_mask(
        matchers, tree, smollm2.size, layout="compact", max_rows=6, row_capacity=8
    )
    torch.cuda.synchronize()
    assert mask.rows.shape == (6,) and mask.bits.shape == (6, smollm2.words)
    rows = mask.rows.cpu().numpy()
    assert (rows[mask.count :] == 8).all()
    dense = ps.CompactMask(rows, mask.bits.cpu().numpy(), 8, mask.count).to_dense()
    np.testing.assert_array_equal(dense[:6], want)
    assert (dense[6:] == -1).all()


def test_wait_false_uploads_for_the_callers_stream(smollm2):
    """The stream current on the calling thread at call time (not the background thread's
    default stream) is the one made to wait for the upload."""
    logits_host = np.random.default_rng(9).standard_normal((6, smollm2.size)).astype(np.float32)
    for layout in ("dense", "compact"):
        matchers, tree, want = _json_case(smollm2, smollm2.tokens.index("{"), batch=2)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy_stream(CUDA)):
            torch.cuda._sleep(LONG)  # holds the upload back
        with torch.cuda.stream(side):
            handle = ps.build_grammar_vocab_mask(
                matchers, tree, smollm2.size, layout=layout, wait=False
            )
        mask = handle.result(timeout=600)
        tensor = mask.bits if layout == "compact" else mask
        assert tensor._portable_spec_waiter == side
        logits = torch.from_numpy(logits_host).to(CUDA)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ps.apply_vocab_mask(logits, mask)  # no wait of its own: the upload ordered it
        side.synchronize()
        np.testing.assert_array_equal(
            logits.cpu().numpy().astype(np.float64), _reference(torch.from_numpy(logits_host), want)
        )


# Last: an out-of-bounds write here would poison the CUDA context for every later test.
def test_apply_logits_past_two_to_the_31_elements():
    """Item 8: the kernels' offsets are 32-bit; 16400 x 131072 bf16 logits (2^31 + 2M
    elements) are applied in row chunks. The last rows are the ones an overflow breaks."""
    rows, vocab = 16400, 131072
    assert rows * vocab > MAX_KERNEL_ELEMENTS
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * rows * vocab * 2:
        pytest.skip("not enough GPU memory for 2^31-element logits")
    logits = torch.zeros(rows, vocab, device=CUDA, dtype=torch.bfloat16)
    words = vocab // 32
    mask = torch.full((rows, words), -1, dtype=torch.int32, device=CUDA)
    mask[-1] = 0  # last row: everything banned
    mask[-2, : words // 2] = 0  # first half banned
    mask[rows // 2, -1] = 0  # a middle row: the last 32 tokens banned
    ps.apply_vocab_mask(logits, mask)
    assert torch.isinf(logits[-1]).all()
    assert torch.isinf(logits[-2, : vocab // 2]).all()
    assert (logits[-2, vocab // 2 :] == 0).all()
    assert torch.isinf(logits[rows // 2, -32:]).all() and (logits[rows // 2, :-32] == 0).all()
    assert (logits[:-2] == 0).sum().item() == (rows - 2) * vocab - 32


def test_compact_apply_logits_past_two_to_the_31_elements():
    """The compact apply on 2^31+ element logits goes through the dense row chunks."""
    rows, vocab = 16400, 131072
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * rows * vocab * 2:
        pytest.skip("not enough GPU memory for 2^31-element logits")
    logits = torch.zeros(rows, vocab, device=CUDA, dtype=torch.bfloat16)
    words = vocab // 32
    bits = torch.full((3, words), -1, dtype=torch.int32, device=CUDA)
    bits[1] = 0  # row rows - 1: everything banned
    bits[0, -1] = 0  # row rows // 2: the last 32 tokens banned
    index = torch.tensor([rows // 2, rows - 1, rows], dtype=torch.int32, device=CUDA)
    ps.apply_vocab_mask(logits, ps.CompactMask(index, bits, rows, count=2))
    assert torch.isinf(logits[-1]).all()
    assert torch.isinf(logits[rows // 2, -32:]).all() and (logits[rows // 2, :-32] == 0).all()
    assert (logits[:-1] == 0).sum().item() == (rows - 1) * vocab - 32
