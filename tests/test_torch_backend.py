"""torch-specific behaviour. The CUDA traps (reading a host copy before its event, rewriting a
pinned buffer under an in-flight upload) need a GPU and skip without one."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import xgrammar as xgr  # noqa: E402
from _oracle import Request, expected_mask  # noqa: E402

import portable_spec as ps  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _slow_kernel_then(values: torch.Tensor) -> torch.Tensor:
    """Queue enough GPU work that a copy issued now completes well after the host moves on,
    then produce ``values`` at the end of it."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    return values.to("cuda", non_blocking=True) + (x[0, 0] * 0).to(values.dtype)


@cuda
def test_resolve_waits_for_the_copy_event():
    """The trap: a pinned host tensor filled by a non_blocking copy is garbage until the
    copy's event fires. resolve() must wait for exactly that event."""
    values = torch.arange(64 * 64, dtype=torch.int64).reshape(64, 64) % 61 - 1
    device_values = _slow_kernel_then(values)
    tree = ps.GrammarTree.from_device(device_values, device_values, device_values)
    got = tree.resolve()
    for a in got:
        np.testing.assert_array_equal(a, values.numpy())


@cuda
def test_pinned_buffer_not_rewritten_under_inflight_upload(smollm2):
    """Upload step A's mask behind slow GPU work, build step B at once: B must not land in
    A's pinned buffer while A's copy is still pending."""
    compiled = smollm2.grammars["builtin_json"]
    brace = smollm2.tokens.index("{")
    masks = []
    for token in (brace, 5, brace, 7):
        _slow_kernel_then(torch.zeros(1))  # delays the upload queued next on this stream
        dt = torch.tensor([[0, token]], device="cuda")
        tree = ps.GrammarTree.from_linear_chain(dt)
        mask = ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled)], tree, smollm2.size)
        want = expected_mask([Request(compiled)], *tree.resolve(), smollm2.size, smollm2.words)
        masks.append((mask, want))
    torch.cuda.synchronize()
    for mask, want in masks:
        np.testing.assert_array_equal(mask.cpu().numpy(), want)


@cuda
def test_mixed_cpu_and_cuda_inputs(smollm2):
    nt = torch.tensor([[1, -1]])
    ns = torch.tensor([[-1, -1]], device="cuda")
    dt = torch.tensor([[0, smollm2.tokens.index("{")]], device="cuda")
    tree = ps.GrammarTree.from_device(nt, ns, dt)
    assert tree.device.type == "cuda"
    mask = ps.build_grammar_vocab_mask(
        [xgr.GrammarMatcher(smollm2.grammars["builtin_json"])], tree, smollm2.size
    )
    assert mask.device.type == "cuda"


def test_cpu_tensors_need_no_event():
    t = torch.tensor([[1, -1]])
    staged = ps.get_backend("cuda").stage([t])
    assert staged._event is None
    np.testing.assert_array_equal(staged.resolve()[0], t.numpy())


def test_from_host_refuses_device_tensors_and_accepts_cpu_ones():
    nt = torch.tensor([[1, -1]])
    tree = ps.GrammarTree.from_host(nt, torch.tensor([[-1, -1]]), torch.tensor([[0, 3]]))
    np.testing.assert_array_equal(tree.resolve()[0], [[1, -1]])
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match="not a host array"):
            ps.GrammarTree.from_host(nt.cuda(), nt.cuda(), nt.cuda())


def test_strided_float64_logits_in_place():
    base = torch.randn(100, 3, dtype=torch.float64)
    logits = base.t()  # [3, 100], not contiguous
    mask = torch.tensor(np.random.default_rng(0).integers(-(2**31), 2**31, (3, 4)).astype(np.int32))
    want = logits.clone().numpy()
    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :100]
    want[bits == 0] = -np.inf
    out = ps.apply_vocab_mask(logits, mask)
    assert out is logits
    np.testing.assert_array_equal(base.t().numpy(), want)  # written through to the base


def test_mask_device_mismatch_is_an_error():
    if not torch.cuda.is_available():
        with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
            ps.apply_vocab_mask(torch.zeros(2, 32), np.zeros((2, 1), np.int32))
        return
    with pytest.raises(ValueError, match="mask is on cpu but logits are on cuda"):
        ps.apply_vocab_mask(torch.zeros(2, 32, device="cuda"), torch.zeros(2, 1, dtype=torch.int32))
