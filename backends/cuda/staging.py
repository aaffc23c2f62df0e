"""Stage tree arrays from torch tensors: pinned, ``non_blocking`` copies plus one event."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .buffers import PinnedPool, as_tensor, numpy_dtype
from .devices import current_stream_event, device_module

__all__ = ["TorchStaged", "stage_tensors"]


class TorchStaged:
    """Host copies of torch tensors; ``resolve`` synchronizes only the recorded event."""

    __slots__ = ("_arrays", "_event")

    def __init__(self, arrays: list[np.ndarray], event: object | None) -> None:
        self._arrays = arrays
        self._event = event

    def resolve(self) -> list[np.ndarray]:
        """Block until the copies have landed (``event.synchronize()``; nothing else is waited
        for), then return the host arrays. Later calls return at once."""
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
            self._event = None
        return self._arrays


def stage_tensors(tensors: Sequence[torch.Tensor], pool: PinnedPool) -> TorchStaged:
    """Start copying ``tensors`` to the host without blocking the caller.

    CPU tensors are wrapped (no copy). Each accelerator tensor is copied with
    ``non_blocking=True`` on its device's current stream into a pooled pinned buffer, after the
    work already queued there (the draft kernels that produced it), and one event is recorded
    after the last copy. A pinned buffer returns to the pool only after that event has fired
    and the arrays handed out by ``resolve`` are gone.
    """
    arrays: list[np.ndarray] = []
    pending: list[tuple[int, object, torch.Tensor]] = []
    devices: list[torch.device] = []
    for i, tensor in enumerate(tensors):
        if tensor.device.type == "cpu" or device_module(tensor.device) is None:
            # CPU tensors (and accelerators without events, which copy synchronously)
            arrays.append(tensor.detach().cpu().numpy())
            continue
        buffer = pool.acquire(tuple(tensor.shape), numpy_dtype(tensor.dtype))
        as_tensor(buffer).copy_(tensor.detach(), non_blocking=True)
        pending.append((i, buffer, tensor))
        arrays.append(np.empty(0))  # placeholder, replaced below
        if tensor.device not in devices:
            devices.append(tensor.device)
    event = None
    if pending:
        if len(devices) > 1:
            raise ValueError(
                f"tree arrays live on several devices ({', '.join(map(str, devices))}); "
                "stage them from one device"
            )
        event = current_stream_event(devices[0])
        done = event.query  # type: ignore[union-attr]
        wait = event.synchronize  # type: ignore[union-attr]
        for i, buffer, _ in pending:
            arrays[i] = pool.lend(buffer, done, wait)  # type: ignore[arg-type]
    return TorchStaged(arrays, event)
