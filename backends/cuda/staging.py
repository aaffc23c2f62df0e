"""Stage tree arrays from torch tensors: pinned, ``non_blocking`` copies plus one event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from portable_spec.hostbuffers import HostBuffer

from .buffers import PinnedPool, as_tensor, carrier_dtype, numpy_dtype
from .devices import device_module

__all__ = ["TorchStaged", "stage_tensors"]


class TorchStaged:
    """Host copies of torch tensors; ``resolve`` synchronizes only the recorded event."""

    __slots__ = ("_arrays", "_event", "_sources")

    def __init__(self, arrays: list[np.ndarray], event: Any, sources: list[torch.Tensor]) -> None:
        self._arrays = arrays
        self._event = event
        # The device tensors being copied: held until the copy is known to be done, so the
        # caller dropping them cannot hand their memory to another allocation meanwhile.
        self._sources = sources

    def resolve(self) -> list[np.ndarray]:
        """Block until the copies have landed (``event.synchronize()``; nothing else is waited
        for), then return the host arrays. Later calls return at once."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._sources = []
        return self._arrays


def _accelerator_device(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The one accelerator the tensors live on (None when all are host tensors)."""
    devices = []
    for tensor in tensors:
        if device_module(tensor.device) is not None and tensor.device not in devices:
            devices.append(tensor.device)
    if len(devices) > 1:
        raise ValueError(
            f"tree arrays live on several devices ({', '.join(map(str, devices))}); "
            "stage them from one device"
        )
    return devices[0] if devices else None


def stage_tensors(tensors: Sequence[torch.Tensor], pool: PinnedPool) -> TorchStaged:
    """Start copying ``tensors`` to the host without blocking the caller.

    CPU tensors are wrapped (no copy). Each accelerator tensor is copied with
    ``non_blocking=True`` on its device's *current stream* into a pooled pinned buffer, after
    the work already queued there (so call this on the stream that produced the tensors, or
    after making the current stream wait for it), and one event is recorded after the last
    copy. The source tensors are recorded on that stream (``record_stream``) and held until
    the copy is known to be done: freeing them early, even when they were allocated on
    another stream, cannot hand their memory to another allocation under the copy. A pinned
    buffer returns to the pool only after the event has fired and the arrays handed out by
    ``resolve`` are gone. Any integer dtype, unsigned ones included (their bits travel
    through a signed type of the same width).
    """
    device = _accelerator_device(tensors)
    module = device_module(device) if device is not None else None
    stream = module.current_stream(device) if module is not None else None
    arrays: list[np.ndarray | None] = []
    copied: list[tuple[int, HostBuffer]] = []
    sources: list[torch.Tensor] = []
    try:
        for i, tensor in enumerate(tensors):
            source = tensor.detach()
            if device_module(source.device) is None:
                # CPU tensors (and accelerators without events, which copy synchronously)
                arrays.append(source.cpu().numpy())
                continue
            buffer = pool.acquire(tuple(source.shape), numpy_dtype(source.dtype))
            copied.append((i, buffer))
            carrier = carrier_dtype(source.dtype)
            as_tensor(buffer, carrier).copy_(source.view(carrier), non_blocking=True)
            source.record_stream(stream)
            sources.append(source)
            arrays.append(None)  # replaced by the lent array below
    except BaseException:
        _give_back(copied, pool, device)
        raise
    event = None
    if copied:
        event = module.Event()  # type: ignore[union-attr]
        event.record(stream)
        for i, buffer in copied:
            arrays[i] = pool.lend(buffer, event.query, event.synchronize)
    return TorchStaged(arrays, event, sources)  # type: ignore[arg-type]


def _give_back(copied: list[tuple[int, HostBuffer]], pool: PinnedPool, device: Any) -> None:
    """Return the buffers of a staging that failed half way; those whose copy was already
    queued come back only after an event behind it."""
    if not copied:
        return
    module = device_module(device) if device is not None else None
    if module is None:
        for _, buffer in copied:
            pool.release(buffer)
        return
    event = module.Event()
    event.record(module.current_stream(device))
    for _, buffer in copied:
        pool.after(buffer, event.query, event.synchronize)
