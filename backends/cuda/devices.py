"""Device facts for torch: streams, events, device guards and pinned host memory.

Every helper takes the device explicitly: streams and "current device" are per thread in
torch, and the library must never act on whatever device happens to be current when the
tensors it was handed live elsewhere.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "copy_stream",
    "current_stream_event",
    "device_guard",
    "device_module",
    "pinned_memory_available",
]


def device_module(device: torch.device) -> Any | None:
    """The ``torch.<type>`` module of an accelerator (``torch.cuda``, ``torch.xpu``, ...), or
    None for the CPU and for accelerators without streams and events."""
    if device.type == "cpu":
        return None
    try:
        module = torch.get_device_module(device)
    except (AttributeError, RuntimeError):
        return None
    if not hasattr(module, "Event") or not hasattr(module, "current_stream"):
        return None
    return module


def current_stream_event(device: torch.device) -> Any | None:
    """Record an event on ``device``'s current stream (None where events do not exist)."""
    module = device_module(device)
    if module is None:
        return None
    event = module.Event()
    event.record(module.current_stream(device))
    return event


_copy_streams: dict[torch.device, Any] = {}
_copy_streams_lock = threading.Lock()


def copy_stream(device: torch.device) -> Any | None:
    """The library's dedicated host-to-device copy stream on ``device`` (created once per
    device and shared by all threads), or None where the device has no streams.

    Uploads queued there run on the copy engine while the compute stream is busy with the
    verify forward, instead of waiting behind it.
    """
    module = device_module(device)
    if module is None or not hasattr(module, "Stream"):
        return None
    if device.index is None:
        device = torch.device(device.type, module.current_device())
    stream = _copy_streams.get(device)
    if stream is None:
        with _copy_streams_lock:
            stream = _copy_streams.get(device)
            if stream is None:
                stream = _copy_streams[device] = module.Stream(device=device)
    return stream


@contextlib.contextmanager
def device_guard(device: torch.device) -> Iterator[None]:
    """Make ``device`` the current device of its type for the block (no-op for the CPU and
    for accelerators without a device context).

    Kernels launched through Triton (xgrammar's apply) go to the *current* device's current
    stream, whatever device their tensors are on.
    """
    module = device_module(device)
    guard = getattr(module, "device", None) if module is not None else None
    if guard is None or device.index is None:
        yield
        return
    with guard(device):
        yield


def pinned_memory_available() -> bool:
    """Whether page-locked host memory can be allocated (a CUDA-like accelerator exists)."""
    try:
        return bool(torch.cuda.is_available()) or (
            hasattr(torch, "accelerator") and torch.accelerator.is_available()
        )
    except RuntimeError:
        return False
