"""Host memory for staging and uploads, pooled (no ``cudaHostAlloc`` per step).

Two pools serve the torch backend: page-locked blocks for copies to and from an accelerator
(:class:`PinnedPool`), and ordinary pageable blocks for masks whose destination is the CPU
(a pinned block handed to the caller could be read by a later ``non_blocking`` copy the
library never hears of, after the block went back to the pool).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from portable_spec.hostbuffers import HostBuffer, HostBufferPool

from .devices import pinned_memory_available

__all__ = ["PinnedPool", "as_tensor", "numpy_dtype"]

_TORCH_OF_NUMPY = {
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
}
for _bits in (16, 32, 64):  # torch's unsigned wide types (torch >= 2.3)
    _unsigned = getattr(torch, f"uint{_bits}", None)
    if _unsigned is not None:
        _TORCH_OF_NUMPY[np.dtype(f"uint{_bits}")] = _unsigned
_NUMPY_OF_TORCH = {v: k for k, v in _TORCH_OF_NUMPY.items()}
# Same-width signed carriers: raw bits move through these, so no copy kernel of an unsigned
# wide type (thinly supported on CUDA) is ever needed.
_SIGNED_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch integer dtype (unsigned wide types included).

    Raises ``TypeError`` for a dtype numpy has no equivalent of.
    """
    found = _NUMPY_OF_TORCH.get(dtype)
    if found is None:
        raise TypeError(f"tree arrays of dtype {dtype} are not supported; use an integer dtype")
    return found


def carrier_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype of the same width, used to move ``dtype``'s raw bits."""
    return _SIGNED_OF_SIZE[dtype.itemsize]


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's caching host allocator really reserves for a pinned request of
    ``nbytes``: the next power of two (its default rounding). Allocating exactly that makes
    the pool's byte count true and the whole block usable."""
    return 1 << max(nbytes - 1, 0).bit_length()


class PinnedPool(HostBufferPool):
    """A :class:`HostBufferPool` whose blocks are page-locked torch tensors when an
    accelerator exists (plain host tensors otherwise, e.g. on CPU-only machines)."""

    def __init__(self) -> None:
        self.pinned = pinned_memory_available()

        def allocate(nbytes: int) -> tuple[np.ndarray, Any]:
            if self.pinned:
                nbytes = pinned_block_bytes(nbytes)
            tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            return tensor.numpy(), tensor

        super().__init__(allocate)


def as_tensor(buffer: HostBuffer, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A torch view of a pooled buffer's array, on its block itself (no copy).

    ``dtype`` reinterprets the bytes (same item size); by default the array's own dtype.
    Needs a block owned by a torch tensor (from :class:`PinnedPool`).
    """
    owner: torch.Tensor = buffer.owner
    array = buffer.array
    if dtype is None:
        dtype = _TORCH_OF_NUMPY[array.dtype]
    return owner[: array.nbytes].view(dtype).view(array.shape)
