"""The torch backend: CUDA (the reference target), other torch accelerators, and CPU tensors.

stage   pinned ``non_blocking`` device-to-host copies on the current stream + one event
upload  pooled pinned buffer -> ``non_blocking`` copy on a dedicated copy stream; the current
        stream waits on its event; the buffer is reused after that event
apply   xgrammar's ``apply_token_bitmask_inplace`` kernels, in place
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from portable_spec.backend import ArrayInfo, Backend
from portable_spec.hostbuffers import HostBuffer, HostBufferPool
from portable_spec.masks import CompactMask

from .apply import apply_compact_mask_torch, apply_vocab_mask_torch
from .buffers import PinnedPool
from .devices import device_module
from .staging import TorchStaged, stage_tensors
from .upload import mask_ready_event, resolve_device, upload_compact_mask, upload_mask

__all__ = [
    "TorchBackend",
    "apply_compact_mask_torch",
    "apply_vocab_mask_torch",
    "mask_ready_event",
]


def _check_readable(tensor: torch.Tensor) -> None:
    """Raise ``TypeError`` for a tensor without data to copy (the ``meta`` device), not
    strided (sparse layouts), or carrying a lazy negation or conjugation bit (``_neg_view``,
    ``conj()``): its memory does not hold its values."""
    if tensor.device.type == "meta":
        raise TypeError("a tensor on the meta device has no data to copy")
    if tensor.layout != torch.strided:
        raise TypeError(f"a tensor with layout {tensor.layout} is not a dense array")
    if tensor.is_neg() or tensor.is_conj():
        raise TypeError(
            "a tensor with the negative or conjugate bit set does not hold its values in "
            "memory; pass tensor.resolve_neg() / tensor.resolve_conj()"
        )


class TorchBackend(Backend):
    """Backend for ``torch.Tensor`` (registered as ``"torch"``, alias ``"cuda"``)."""

    name = "torch"
    framework = "torch"

    def __init__(self) -> None:
        #: page-locked blocks: staging copies and uploads to accelerators
        self.pool = PinnedPool()
        #: pageable blocks: masks whose destination is the CPU
        self.host_pool = HostBufferPool()

    def owns(self, obj: Any) -> bool:
        return isinstance(obj, (torch.Tensor, torch.device))

    def array_info(self, array: Any) -> ArrayInfo:
        """Shape and dtype; ``TypeError`` for tensors whose values cannot be copied out as they
        are (see :func:`_check_readable`)."""
        _check_readable(array)
        dtype = array.dtype
        is_integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        return ArrayInfo(tuple(array.shape), dtype, is_integer)

    def device_of(self, array: Any) -> Any:
        return None if array.device.type == "cpu" else array.device

    def stage(self, arrays: Sequence[Any]) -> TorchStaged:
        """Non-blocking: see :func:`portable_spec.backends.cuda.staging.stage_tensors`."""
        return stage_tensors(arrays, self.pool)

    def to_host(self, array: Any) -> np.ndarray:
        _check_readable(array)
        if array.device.type != "cpu":
            raise TypeError(
                f"a tensor on {array.device} is not a host array; use GrammarTree.from_device"
            )
        return array.detach().numpy()

    def host_view(self, array: Any) -> np.ndarray | None:
        # torch's numpy() refuses what to_host refuses (meta and sparse tensors, negative or
        # conjugate bits) and tensors that require grad; one call instead of five checks
        try:
            return array.numpy() if array.device.type == "cpu" else None
        except (RuntimeError, TypeError, AttributeError):
            return None

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

    def host_mask(self, array: np.ndarray, device: Any = None) -> torch.Tensor | None:
        """A CPU tensor over ``array`` for the CPU (``None``); None for an accelerator, or a
        device argument :meth:`upload` would refuse (it names what is wrong)."""
        try:
            target = resolve_device(device)
        except (TypeError, ValueError):
            return None
        return torch.from_numpy(array) if target.type == "cpu" else None

    def apply_vocab_mask(
        self, logits: Any, mask: Any, vocab_size: int | None = None
    ) -> torch.Tensor:
        """In place, asynchronous on accelerators (queued on the logits' device's current
        stream, after the mask's upload); returns ``logits``."""
        return apply_vocab_mask_torch(logits, mask, vocab_size=vocab_size)

    def upload_compact(
        self, buffer: HostBuffer, mask: CompactMask, device: Any = None
    ) -> CompactMask:
        """The index and the ``count`` listed rows, non-blocking on the copy stream; see
        :func:`portable_spec.backends.cuda.upload.upload_compact_mask`."""
        try:
            target = resolve_device(device)
        except BaseException:
            self.release_host_mask(buffer)
            raise
        return upload_compact_mask(buffer, mask, target, self.pool, self.host_pool)

    def apply_compact_mask(
        self, logits: Any, mask: CompactMask, vocab_size: int | None = None
    ) -> torch.Tensor:
        """In place on the listed rows, through xgrammar's kernels with ``indices=``; see
        :func:`portable_spec.backends.cuda.apply.apply_compact_mask_torch`."""
        return apply_compact_mask_torch(logits, mask, vocab_size=vocab_size)

    def capture_context(self, device: Any = None) -> Callable[[], AbstractContextManager[Any]]:
        """The caller's current stream on ``device`` (per thread in torch): the background
        upload makes that stream wait for the mask, as a blocking call would."""
        try:
            target = resolve_device(device)
        except (TypeError, ValueError):
            return nullcontext
        module = device_module(target)
        if module is None or not hasattr(module, "stream"):
            return nullcontext
        if target.index is None:
            target = torch.device(target.type, module.current_device())
        stream = module.current_stream(target)
        return lambda: module.stream(stream)

    def describe(self) -> str:
        accel = "CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
        return f"torch {torch.__version__} ({accel}; pinned memory: {self.pool.pinned})"
