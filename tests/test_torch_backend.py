"""torch-specific behaviour. The CUDA traps (reading a host copy before its event, rewriting a
pinned buffer under an in-flight upload) need a GPU and skip without one."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import xgrammar as xgr  # noqa: E402
from _oracle import Request, expected_mask  # noqa: E402

import portable_spec as ps  # noqa: E402


def test_cpu_tensors_need_no_event():
    t = torch.tensor([[1, -1]])
    staged = ps.get_backend("cuda").stage([t])
    assert staged._event is None
    np.testing.assert_array_equal(staged.resolve()[0], t.numpy())


def test_from_host_accepts_cpu_tensors():
    nt = torch.tensor([[1, -1]])
    tree = ps.GrammarTree.from_host(nt, torch.tensor([[-1, -1]]), torch.tensor([[0, 3]]))
    np.testing.assert_array_equal(tree.resolve()[0], [[1, -1]])


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


def test_mask_must_be_a_tensor():
    """A mask of another framework is refused with the way to get the right one."""
    with pytest.raises(TypeError, match="mask must be a torch.Tensor") as refused:
        ps.apply_vocab_mask(torch.zeros(2, 32), np.zeros((2, 1), np.int32))
    assert "device=logits.device" in str(refused.value)
    assert "torch.from_numpy(mask)" in str(refused.value)
    with pytest.raises(TypeError, match="mask must be a numpy array") as refused:
        ps.apply_vocab_mask(np.zeros((2, 32), np.float32), torch.zeros((2, 1), dtype=torch.int32))
    assert "mask.numpy()" in str(refused.value)


@pytest.mark.parametrize("constructor", ["from_host", "from_device", "from_linear_chain",
                                         "from_packed_chains", "from_host_mixed"])  # fmt: skip
def test_every_constructor_of_cpu_tensors_gives_a_torch_mask(smollm2, constructor):
    """The mask is of the framework of the arrays the tree was made of, whichever
    constructor made it: torch CPU tensors give a torch CPU mask (numpy arrays among them do
    not change that), one that applies to torch logits; the rows are the replay's."""
    draft = torch.tensor([[0, 90, 91], [0, 90, 92]])
    links = torch.tensor([[1, 2, -1]] * 2), torch.full((2, 3), -1)
    if constructor == "from_host":
        tree = ps.GrammarTree.from_host(*links, draft)
    elif constructor == "from_host_mixed":
        tree = ps.GrammarTree.from_host(links[0].numpy(), links[1].tolist(), draft)
    elif constructor == "from_device":
        tree = ps.GrammarTree.from_device(*links, draft)
    elif constructor == "from_linear_chain":
        tree = ps.GrammarTree.from_linear_chain(draft)
    else:
        tree = ps.GrammarTree.from_packed_chains(draft.reshape(-1), np.array([0, 3, 6]))
    assert tree.backend.name == "torch"
    grammar = smollm2.grammars["json_schema"]
    mask = ps.build_grammar_vocab_mask(
        [xgr.GrammarMatcher(grammar) for _ in range(2)], tree, smollm2.size
    )
    assert isinstance(mask, torch.Tensor) and mask.device.type == "cpu"
    requests = [Request(grammar)] * 2
    want = expected_mask(requests, links[0].numpy(), links[1].numpy(), draft.numpy(),
                         smollm2.size, smollm2.words)  # fmt: skip
    np.testing.assert_array_equal(mask.numpy(), want)
    ps.apply_vocab_mask(torch.zeros(6, smollm2.size), mask)
    numpy_tree = ps.GrammarTree.from_host(links[0].numpy(), links[1].numpy(), draft.numpy())
    assert numpy_tree.backend.name == "numpy"


def test_one_row_logits_and_masks():
    """[vocab] logits with a [words] mask (the CUDA kernels need them as one row)."""
    rng = np.random.default_rng(4)
    mask = torch.from_numpy(rng.integers(-(2**31), 2**31, 40, dtype=np.int64).astype(np.int32))
    logits = torch.randn(1270)
    want = logits.numpy().copy()
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:1270]
    want[bits == 0] = -np.inf
    ps.apply_vocab_mask(logits, mask)
    np.testing.assert_array_equal(logits.numpy(), want)


def test_large_logits_are_applied_in_row_chunks(monkeypatch):
    """The kernels' offsets are 32-bit; past the bound, rows go in chunks (bound lowered here
    so the chunking itself is exercised on the CPU)."""
    import portable_spec.backends.cuda.apply as apply_module

    monkeypatch.setattr(apply_module, "MAX_KERNEL_ELEMENTS", 3 * 100)
    rng = np.random.default_rng(5)
    mask_np = rng.integers(-(2**31), 2**31, (10, 4), dtype=np.int64).astype(np.int32)
    logits = torch.randn(10, 100)
    want = logits.numpy().copy()
    bits = np.unpackbits(mask_np.view(np.uint8), axis=1, bitorder="little")[:, :100]
    want[bits == 0] = -np.inf
    ps.apply_vocab_mask(logits, torch.from_numpy(mask_np))
    np.testing.assert_array_equal(logits.numpy(), want)


@pytest.mark.parametrize("bits", [16, 32, 64])
def test_unsigned_dtypes_map_to_numpy_and_carriers(bits):
    """Unsigned tree dtypes: a numpy dtype for the host copy and a signed carrier of the same
    width for the device copy (the pinned path raised KeyError for them)."""
    from portable_spec.backends.cuda.buffers import (
        PinnedPool,
        as_tensor,
        carrier_dtype,
        numpy_dtype,
    )

    unsigned = getattr(torch, f"uint{bits}")
    assert numpy_dtype(unsigned) == np.dtype(f"uint{bits}")
    assert carrier_dtype(unsigned) == getattr(torch, f"int{bits}")
    pool = PinnedPool()
    buffer = pool.acquire((2, 3), numpy_dtype(unsigned))
    try:
        top = 2**bits - 1
        values = np.array([[top, top - 1, 0], [1, 2, 3]], dtype=np.uint64).astype(f"uint{bits}")
        buffer.array[...] = values
        view = as_tensor(buffer)
        assert view.dtype == unsigned and view.shape == (2, 3)
        raw = as_tensor(buffer, carrier_dtype(unsigned))
        assert raw.view(unsigned).view(raw.dtype).equal(raw)
        np.testing.assert_array_equal(raw.numpy().view(f"uint{bits}"), buffer.array)
    finally:
        pool.release(buffer)
    with pytest.raises(TypeError, match="not supported"):
        numpy_dtype(torch.float32)


def test_cpu_destination_uses_pageable_memory(smollm2):
    """A mask for the CPU comes from the pageable pool, never a pinned block (which the
    caller's own non_blocking copy could still read after the block went back)."""
    backend = ps.get_backend("cuda")
    compiled = smollm2.grammars["builtin_json"]
    tree = ps.GrammarTree.from_linear_chain(torch.tensor([[0, smollm2.tokens.index("{")]]))
    pinned_before = backend.pool.stats()["lent"]
    mask = ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled)], tree, smollm2.size)
    assert mask.device.type == "cpu"
    assert backend.host_pool.stats()["lent"] == 1
    assert backend.pool.stats()["lent"] == pinned_before
    want = expected_mask([Request(compiled)], *tree.resolve(), smollm2.size, smollm2.words)
    np.testing.assert_array_equal(mask.numpy(), want)
    del mask
    assert backend.host_pool.stats()["lent"] == 0


def test_failed_upload_returns_its_buffer(smollm2):
    """A mask sent to a device that cannot take it raises, and its host buffer is back in
    the pool (the lent count does not drift)."""
    backend = ps.get_backend("cuda")
    compiled = smollm2.grammars["builtin_json"]
    tree = ps.GrammarTree.from_linear_chain(torch.tensor([[0, 5]]))
    before = (backend.pool.stats()["lent"], backend.host_pool.stats()["lent"])
    bad = "cuda:99" if torch.cuda.is_available() else "cuda:0"
    with pytest.raises((RuntimeError, AssertionError, ValueError)):
        ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled)], tree, smollm2.size, device=bad)
    assert (backend.pool.stats()["lent"], backend.host_pool.stats()["lent"]) == before
    with pytest.raises(ValueError, match="not a torch device"):
        ps.build_grammar_vocab_mask(
            [xgr.GrammarMatcher(compiled)], tree, smollm2.size, device="nonsense:x"
        )
    with pytest.raises(TypeError, match="no portable_spec backend handles builtins.float"):
        ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled)], tree, smollm2.size, device=1.5)
    assert (backend.pool.stats()["lent"], backend.host_pool.stats()["lent"]) == before
