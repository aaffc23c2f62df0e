"""``apply_vocab_mask`` for torch logits: xgrammar's kernels (CPU, Triton, CUDA, torch)."""

from __future__ import annotations

from typing import Literal

import torch

from portable_spec.masks import CompactMask, apply_columns

from .devices import device_guard, device_module
from .upload import wait_until_ready

__all__ = ["MAX_KERNEL_ELEMENTS", "apply_compact_mask_torch", "apply_vocab_mask_torch"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# xgrammar's Triton and CUDA kernels compute element offsets in 32-bit integers
# (row * row_stride + column): larger logits are applied in row chunks below this bound.
MAX_KERNEL_ELEMENTS = 2**31 - 1

Kernel = Literal["auto", "triton", "cuda", "cpu", "torch_native"]


def apply_vocab_mask_torch(
    logits: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    kernel: Kernel = "auto",
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Set ``logits[i, t] = -inf`` where bit ``t`` of ``mask[i]`` is 0, in place.

    Args:
        logits: ``[rows, vocab]`` or ``[vocab]``, any floating dtype, any strides.
        mask: int32 ``[rows, words]`` or ``[words]`` on the same device, covering every
            column (``32 * words >= vocab``; mask words past the logits' width are ignored),
            or ``None`` with ``vocab_size``.
        vocab_size: columns at or past it are set to ``-inf`` in every row (the mask then
            needs to cover only ``vocab_size`` tokens); see
            :func:`portable_spec.apply_vocab_mask`.
        kernel: xgrammar's implementation to use: ``"auto"`` (C++ on CPU, Triton on CUDA,
            xgrammar's torch code for dtypes its kernels lack, such as float64), or one of
            ``"triton"``, ``"cuda"`` (compiled with nvcc on first use), ``"cpu"``,
            ``"torch_native"``.

    Returns:
        ``logits``. Asynchronous on accelerators: queued on the current stream of the
        logits' device (made current for the launch, whatever device is current), after the
        mask's upload if the mask came from this backend. Logits of 2^31 elements or more
        are processed in row chunks (the kernels' offsets are 32-bit).
    """
    import xgrammar as xgr

    if mask is None:
        if not logits.is_floating_point():
            raise TypeError(f"logits must have a floating dtype, got {logits.dtype}")
        _, banned = apply_columns(logits.shape[-1], None, vocab_size)
        if banned is not None:
            with device_guard(logits.device):
                logits[..., banned:].fill_(float("-inf"))
        return logits
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"mask must be a torch.Tensor for torch logits, got {type(mask).__name__}: a mask "
            "is of the framework of the tree it was built over (a tree of torch tensors, CPU "
            "ones included, gives torch masks); pass device=logits.device to "
            "build_grammar_vocab_mask for a torch mask whatever the tree, or convert this one "
            "(torch.from_numpy(mask) for a numpy mask)"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must have a floating dtype, got {logits.dtype}")
    if mask.dtype != torch.int32:
        raise TypeError(f"mask must have dtype torch.int32, got {mask.dtype}")
    if mask.device != logits.device:
        raise ValueError(f"mask is on {mask.device} but logits are on {logits.device}")
    logits_rows = 1 if logits.dim() == 1 else logits.shape[0]
    mask_rows = 1 if mask.dim() == 1 else mask.shape[0]
    if logits.dim() not in (1, 2) or mask.dim() not in (1, 2) or logits_rows != mask_rows:
        raise ValueError(
            f"logits {tuple(logits.shape)} and mask {tuple(mask.shape)} must be [rows, vocab] "
            "and [rows, words] with the same rows"
        )
    if kernel not in ("auto", "triton", "cuda", "cpu", "torch_native"):
        raise ValueError(f"unknown kernel {kernel!r}")
    # The kernels read a [words] mask with its row stride (1) as its width: one row each.
    logits_2d = logits.unsqueeze(0) if logits.dim() == 1 else logits
    mask_2d = mask.unsqueeze(0) if mask.dim() == 1 else mask
    covered, banned = apply_columns(logits_2d.shape[1], mask_2d.shape[1], vocab_size)
    if banned is not None and logits_rows:
        with device_guard(logits.device):
            logits_2d[:, banned:].fill_(float("-inf"))
    if covered == 0 or logits_rows == 0:
        return logits
    mask_2d = mask_2d[:, : -(-covered // 32)]  # the CUDA kernel refuses wider masks
    if kernel == "auto" and logits.dtype not in _KERNEL_DTYPES:
        kernel = "torch_native"
    accelerator = device_module(logits.device)
    if accelerator is not None:
        wait_until_ready(mask, accelerator.current_stream(logits.device))
    with device_guard(logits.device):
        work = _kernel_layout(logits_2d, kernel)
        if mask_2d.stride(-1) != 1 or (logits.device.type == "cpu" and not mask_2d.is_contiguous()):
            mask_2d = mask_2d.contiguous()
        step = max(1, MAX_KERNEL_ELEMENTS // max(work.stride(0), work.shape[1], 1))
        for start in range(0, work.shape[0], step):
            xgr.apply_token_bitmask_inplace(
                work[start : start + step],
                mask_2d[start : start + step],
                vocab_size=covered,
                backend=kernel,
            )
        if work is not logits_2d:
            logits_2d.copy_(work)
    return logits


def _kernel_layout(logits: torch.Tensor, kernel: str) -> torch.Tensor:
    """``logits`` itself when the kernel can read its strides, else a contiguous copy.

    The GPU kernels take a row stride and need unit column stride; xgrammar 0.2.9's CPU
    kernel reads both tensors as if they were contiguous (it ignores the strides it is
    given).
    """
    if logits.device.type == "cpu" or kernel in ("cpu", "torch_native"):
        return logits if logits.is_contiguous() else logits.contiguous()
    return logits if logits.stride(1) == 1 else logits.contiguous()


def apply_compact_mask_torch(
    logits: torch.Tensor,
    mask: CompactMask,
    *,
    kernel: Kernel = "auto",
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Set ``logits[mask.rows[k], t] = -inf`` where bit ``t`` of ``mask.bits[k]`` is 0, in
    place, through xgrammar's kernels with ``indices=``; rows not listed are not touched.

    Args:
        logits: ``[mask.num_rows, vocab]`` (or ``[vocab]`` when ``num_rows`` is 1), any
            floating dtype, any strides.
        mask: a :class:`CompactMask` of int32 tensors on the logits' device.
        kernel: as for :func:`apply_vocab_mask_torch`.
        vocab_size: as for :func:`apply_vocab_mask_torch`: columns at or past it are ``-inf``
            in every row, listed or not; without it the bits must cover every column.

    xgrammar's kernels read bitmask row ``i`` for logits row ``i``. So the ``C`` entries are
    first scattered (``index_copy_``, on the device) into an uninitialised int32
    ``[num_rows + 1, words]`` scratch whose extra row receives the padding entries; the kernel
    then runs over ``indices = min(rows, num_rows - 1)``: every listed row once, and each
    padding entry as a repeat of the last row (whose scratch row holds its own bits, or -1
    written beforehand when it is not listed), a no-op. Only listed rows of the logits are
    read or written, and every shape is fixed by ``C`` (CUDA graphs can capture it). Logits
    of 2^31 elements or more (32-bit kernel offsets) go through the dense path instead.

    Returns:
        ``logits``. Asynchronous on accelerators: queued on the current stream of the logits'
        device, after the mask's upload if the mask came from this backend.
    """
    import xgrammar as xgr

    rows, bits = mask.rows, mask.bits
    if not isinstance(rows, torch.Tensor) or not isinstance(bits, torch.Tensor):
        raise TypeError(
            f"the CompactMask must hold torch tensors for torch logits, got {type(bits).__name__}"
            ": a mask is of the framework of the tree it was built over (a tree of torch "
            "tensors gives torch masks); pass device=logits.device to build_grammar_vocab_mask "
            "for a torch mask whatever the tree"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must have a floating dtype, got {logits.dtype}")
    if rows.dtype != torch.int32 or bits.dtype != torch.int32:
        raise TypeError(f"a CompactMask's rows and bits must be torch.int32, got {bits.dtype}")
    if bits.device != logits.device or rows.device != logits.device:
        raise ValueError(f"mask is on {bits.device} but logits are on {logits.device}")
    num_rows = mask.num_rows
    logits_rows = 1 if logits.dim() == 1 else logits.shape[0]
    if logits.dim() not in (1, 2) or logits_rows != num_rows:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [rows, vocab] with the mask's num_rows = "
            f"{num_rows} rows (the same rows)"
        )
    if kernel not in ("auto", "triton", "cuda", "cpu", "torch_native"):
        raise ValueError(f"unknown kernel {kernel!r}")
    logits_2d = logits.unsqueeze(0) if logits.dim() == 1 else logits
    covered, banned = apply_columns(logits_2d.shape[1], bits.shape[1], vocab_size)
    if banned is not None and num_rows:
        with device_guard(logits.device):
            logits_2d[:, banned:].fill_(float("-inf"))
    if covered == 0 or num_rows == 0 or rows.shape[0] == 0:
        return logits
    used = -(-covered // 32)
    if kernel == "auto" and logits.dtype not in _KERNEL_DTYPES:
        kernel = "torch_native"
    accelerator = device_module(logits.device)
    if accelerator is not None:
        stream = accelerator.current_stream(logits.device)
        wait_until_ready(bits, stream)
        wait_until_ready(rows, stream)
    with device_guard(logits.device):
        scratch = torch.empty((num_rows + 1, used), dtype=torch.int32, device=logits.device)
        huge = logits_2d.shape[0] * max(logits_2d.stride(0), logits_2d.shape[1])
        if huge > MAX_KERNEL_ELEMENTS:
            scratch.fill_(-1)
            scratch.index_copy_(0, rows.long(), bits[:, :used])
            apply_vocab_mask_torch(logits_2d[:, :covered], scratch[:num_rows], kernel=kernel)
            return logits
        scratch[num_rows - 1].fill_(-1)
        scratch.index_copy_(0, rows.long(), bits[:, :used])
        indices = rows.clamp(max=num_rows - 1)
        work = _kernel_layout(logits_2d, kernel)
        xgr.apply_token_bitmask_inplace(
            work, scratch, vocab_size=covered, indices=indices, backend=kernel
        )
        if work is not logits_2d:
            logits_2d.copy_(work)
    return logits
