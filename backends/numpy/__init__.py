"""The numpy backend: host arrays, synchronous staging, zero-copy "upload"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec.backend import ArrayInfo, Backend, StagedArrays
from portable_spec.hostbuffers import HostBuffer, HostBufferPool
from portable_spec.masks import CompactMask, rebase_compact

from .apply import apply_compact_mask_numpy, apply_vocab_mask_numpy, unpack_bitmask

__all__ = ["NumpyBackend", "unpack_bitmask"]


class _HostArrays:
    __slots__ = ("_arrays",)

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self._arrays = arrays

    def resolve(self) -> list[np.ndarray]:
        return self._arrays


class NumpyBackend(Backend):
    """Host-only backend. ``stage`` is immediate, ``upload`` lends the pooled host buffer
    itself (no copy): it returns to the pool when the returned array and every view of it
    are garbage collected, so a later build never overwrites a mask still in use."""

    name = "numpy"
    framework = "numpy"

    def __init__(self) -> None:
        self.pool = HostBufferPool()

    def owns(self, obj: Any) -> bool:
        return isinstance(obj, (np.ndarray, np.generic))

    def array_info(self, array: Any) -> ArrayInfo:
        dtype = array.dtype
        return ArrayInfo(array.shape, dtype, dtype.kind in "iu")

    def stage(self, arrays: Sequence[Any]) -> StagedArrays:
        """Nothing to copy: returns a handle whose ``resolve()`` returns the arrays."""
        return _HostArrays([np.asarray(a) for a in arrays])

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def acquire_host_mask(self, rows: int, words: int, device: Any = None) -> HostBuffer:
        return self.pool.acquire((rows, words), np.int32)

    def release_host_mask(self, buffer: HostBuffer) -> None:
        self.pool.release(buffer)

    def upload(self, buffer: HostBuffer, device: Any = None) -> np.ndarray:
        """Return the mask as a numpy array aliasing the pooled buffer (non-blocking: there is
        nothing to transfer). ``device`` must be None or ``"cpu"``."""
        if device not in (None, "cpu"):
            self.pool.release(buffer)
            raise ValueError(f"the numpy backend has no device {device!r}")
        return self.pool.lend(buffer)

    def host_mask(self, array: np.ndarray, device: Any = None) -> np.ndarray | None:
        """``array`` itself (every numpy mask lives in host memory); None for a device this
        backend does not have (the upload then names it)."""
        return array if device in (None, "cpu") else None

    def apply_vocab_mask(self, logits: Any, mask: Any, vocab_size: int | None = None) -> np.ndarray:
        """In place on ``logits``; returns it. Synchronous."""
        return apply_vocab_mask_numpy(logits, mask, vocab_size)

    def upload_compact(self, buffer: HostBuffer, mask: CompactMask, device: Any = None) -> Any:
        """The host CompactMask itself, its arrays lent from the pooled block (no copy): the
        block returns to the pool once both arrays and every view of them are gone."""
        if device not in (None, "cpu"):
            self.pool.release(buffer)
            raise ValueError(f"the numpy backend has no device {device!r}")
        return rebase_compact(mask, buffer.array, self.pool.lend(buffer))

    def apply_compact_mask(
        self, logits: Any, mask: CompactMask, vocab_size: int | None = None
    ) -> np.ndarray:
        """In place on the listed rows of ``logits`` (every row past ``vocab_size``); returns
        it. Synchronous."""
        return apply_compact_mask_numpy(logits, mask, vocab_size)

    def describe(self) -> str:
        return f"numpy {np.__version__} (host)"
