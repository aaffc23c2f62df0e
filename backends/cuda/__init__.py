"""The torch backend: CUDA (the reference target), other torch accelerators, and CPU tensors.

stage   pinned ``non_blocking`` device-to-host copies on the current stream + one event
upload  pooled pinned buffer -> ``non_blocking`` copy on a dedicated copy stream; the current
        stream waits on its event; the buffer is reused after that event
apply   xgrammar's ``apply_token_bitmask_inplace`` kernels, in place
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from portable_spec.backend import ArrayInfo, Backend
from portable_spec.hostbuffers import HostBuffer, HostBufferPool

from .apply import apply_vocab_mask_torch
from .buffers import PinnedPool
from .staging import TorchStaged, stage_tensors
from .upload import mask_ready_event, resolve_device, upload_mask

__all__ = ["TorchBackend", "apply_vocab_mask_torch", "mask_ready_event"]


class TorchBackend(Backend):
    """Backend for ``torch.Tensor`` (registered as ``"cuda"``, alias ``"torch"``)."""

    name = "cuda"
    framework = "torch"

    def __init__(self) -> None:
        #: page-locked blocks: staging copies and uploads to accelerators
        self.pool = PinnedPool()
        #: pageable blocks: masks whose destination is the CPU
        self.host_pool = HostBufferPool()

    def owns(self, obj: Any) -> bool:
        return isinstance(obj, (torch.Tensor, torch.device))

    def array_info(self, array: Any) -> ArrayInfo:
        dtype = array.dtype
        is_integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        return ArrayInfo(tuple(array.shape), dtype, is_integer)

    def device_of(self, array: Any) -> Any:
        return None if array.device.type == "cpu" else array.device

    def stage(self, arrays: Sequence[Any]) -> TorchStaged:
        """Non-blocking: see :func:`portable_spec.backends.cuda.staging.stage_tensors`."""
        return stage_tensors(arrays, self.pool)

    def to_host(self, array: Any) -> np.ndarray:
        if array.device.type != "cpu":
            raise TypeError(
                f"a tensor on {array.device} is not a host array; use GrammarTree.from_device"
            )
        return array.detach().numpy()

    def acquire_host_mask(self, rows: int, words: int, device: Any = None) -> HostBuffer:
        """Pinned for an accelerator ``device``, pageable for the CPU (``None``)."""
        pool = self.host_pool if resolve_device(device).type == "cpu" else self.pool
        return pool.acquire((rows, words), np.int32)

    def release_host_mask(self, buffer: HostBuffer) -> None:
        (self.host_pool if buffer.owner is None else self.pool).release(buffer)

    def upload(self, buffer: HostBuffer, device: Any = None) -> torch.Tensor:
        """Non-blocking copy on the device's copy stream, ordered before later work on the
        current stream; see :func:`portable_spec.backends.cuda.upload.upload_mask`.
        ``device=None``: the CPU (the pageable buffer itself, no copy)."""
        try:
            target = resolve_device(device)
        except BaseException:
            self.release_host_mask(buffer)
            raise
        return upload_mask(buffer, target, self.pool, self.host_pool)

    def apply_vocab_mask(self, logits: Any, mask: Any) -> torch.Tensor:
        """In place, asynchronous on accelerators (queued on the logits' device's current
        stream, after the mask's upload); returns ``logits``."""
        return apply_vocab_mask_torch(logits, mask)

    def describe(self) -> str:
        accel = "CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
        return f"torch {torch.__version__} ({accel}; pinned memory: {self.pool.pinned})"
