"""Device facts for torch: which devices have events and pinned host memory."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["current_stream_event", "device_module", "pinned_memory_available"]


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


def pinned_memory_available() -> bool:
    """Whether page-locked host memory can be allocated (a CUDA-like accelerator exists)."""
    try:
        return bool(torch.cuda.is_available()) or (
            hasattr(torch, "accelerator") and torch.accelerator.is_available()
        )
    except RuntimeError:
        return False
