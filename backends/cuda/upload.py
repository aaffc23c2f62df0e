"""Upload a pinned host bitmask to a torch device without blocking."""

from __future__ import annotations

from typing import Any

import torch

from portable_spec.hostbuffers import HostBuffer

from .buffers import PinnedPool, as_tensor
from .devices import current_stream_event

__all__ = ["upload_mask"]


def upload_mask(buffer: HostBuffer, device: torch.device, pool: PinnedPool) -> torch.Tensor:
    """Copy ``buffer`` to ``device`` with ``non_blocking=True`` on the current stream.

    The copy is ordered before any kernel queued after it on that stream (the sampler that
    applies the mask). The pinned buffer is reused only once an event recorded after the copy
    has completed. For ``device`` = CPU the pinned tensor itself is returned (no copy); it
    returns to the pool when that tensor and all its views are gone.
    """
    if device.type == "cpu":
        return torch.from_numpy(pool.lend(buffer))
    host = as_tensor(buffer)
    mask = host.to(device, non_blocking=True)
    event = current_stream_event(device)
    if event is None:  # no events: the copy above was synchronous
        pool.release(buffer)
    else:
        pool.after(buffer, event.query, event.synchronize)
    return mask


def resolve_device(device: Any) -> torch.device:
    """``torch.device`` of a device argument (None means the current accelerator or CPU)."""
    if device is None:
        return torch.device("cpu")
    return device if isinstance(device, torch.device) else torch.device(device)
