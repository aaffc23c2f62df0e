"""``apply_vocab_mask`` for torch logits: xgrammar's kernels (CPU, Triton/CUDA, torch)."""

from __future__ import annotations

import torch

__all__ = ["apply_vocab_mask_torch"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply_vocab_mask_torch(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Set ``logits[i, t] = -inf`` where bit ``t`` of ``mask[i]`` is 0, in place.

    ``logits``: ``[rows, vocab]`` or ``[vocab]``, any floating dtype, any strides. ``mask``:
    int32 ``[rows, words]`` or ``[words]`` on the same device. Columns past
    ``32 * words`` are left unchanged; mask words past the logits' width are ignored.
    float32/float16/bfloat16 use xgrammar's native kernels (C++ on CPU, Triton on CUDA);
    other dtypes (float64) use xgrammar's torch implementation. Asynchronous on accelerators.
    Returns ``logits``.
    """
    import xgrammar as xgr

    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor for torch logits, got {type(mask).__name__}")
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
    covered = min(logits.shape[-1], 32 * mask.shape[-1])
    backend = "auto" if logits.dtype in _KERNEL_DTYPES else "torch_native"
    # xgrammar 0.2.9's CPU kernel reads both tensors as if they were contiguous (it ignores
    # the strides it is given), so strided inputs go through contiguous copies.
    work = logits if logits.is_contiguous() else logits.contiguous()
    xgr.apply_token_bitmask_inplace(work, mask.contiguous(), vocab_size=covered, backend=backend)
    if work is not logits:
        logits.copy_(work)
    return logits
