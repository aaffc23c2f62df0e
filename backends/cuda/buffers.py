"""Pinned host memory for staging and uploads, pooled (no ``cudaHostAlloc`` per step)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from portable_spec.hostbuffers import HostBuffer, HostBufferPool

from .devices import pinned_memory_available

__all__ = ["PinnedPool", "as_tensor"]

_TORCH_OF_NUMPY = {
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
}
_NUMPY_OF_TORCH = {v: k for k, v in _TORCH_OF_NUMPY.items()}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch integer dtype (unsigned wide types included)."""
    found = _NUMPY_OF_TORCH.get(dtype)
    if found is None:
        found = torch.empty(0, dtype=dtype).numpy().dtype
    return found


class PinnedPool(HostBufferPool):
    """A :class:`HostBufferPool` whose blocks are page-locked torch tensors when an
    accelerator exists (plain host tensors otherwise, e.g. on CPU-only machines)."""

    def __init__(self) -> None:
        self.pinned = pinned_memory_available()

        def allocate(nbytes: int) -> tuple[np.ndarray, Any]:
            tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            return tensor.numpy(), tensor

        super().__init__(allocate)


def as_tensor(buffer: HostBuffer) -> torch.Tensor:
    """A torch view of a pooled buffer's array, on the pinned block itself (no copy)."""
    owner: torch.Tensor = buffer.owner
    array = buffer.array
    dtype = _TORCH_OF_NUMPY[array.dtype]
    return owner[: array.nbytes].view(dtype).view(array.shape)
