"""Upload a host bitmask to a torch device without blocking, on a dedicated copy stream.

Ordering, for an engine that launches its verify forward and then builds the mask::

    compute stream   | verify forward ............................ | wait(ready) | sampler |
    copy stream      |        (host builds the mask) | H2D mask copy ^ ready   |

The copy runs on the library's copy stream, so it overlaps the forward instead of queueing
behind it. The stream that was current at upload time waits on the copy's ``ready`` event
(enqueued, not blocking the host), so every kernel queued on it afterwards (the sampler)
sees the mask. ``apply_vocab_mask`` on another stream makes that stream wait too.
"""

from __future__ import annotations

from typing import Any

import torch

from portable_spec.hostbuffers import HostBuffer, HostBufferPool
from portable_spec.masks import CompactMask, rebase_compact

from .buffers import PinnedPool, as_tensor
from .devices import copy_stream, device_module

__all__ = [
    "mark_ready",
    "mask_ready_event",
    "resolve_device",
    "upload_compact_mask",
    "upload_mask",
    "wait_until_ready",
]

# Attributes set on an uploaded mask tensor: the event after its copy, and the stream that
# was made to wait on it.
_READY = "_portable_spec_ready"
_WAITER = "_portable_spec_waiter"


def upload_mask(
    buffer: HostBuffer, device: torch.device, pinned: PinnedPool, pageable: HostBufferPool
) -> torch.Tensor:
    """Start the copy of ``buffer`` to ``device`` and return the device tensor at once.

    ``buffer`` comes from ``pinned`` (accelerator destinations) or ``pageable`` (CPU). For an
    accelerator, the copy is queued with ``non_blocking=True`` on the device's copy stream
    (:func:`portable_spec.backends.cuda.devices.copy_stream`); an event recorded after it
    returns the pinned buffer to its pool once it fired, the current stream is made to wait
    for it, and the mask is ``record_stream``-ed on the current stream. For the CPU, the
    pageable buffer itself is returned (no copy); it goes back to its pool when the tensor
    and all its views are gone. If this raises, the buffer is back in its pool.
    """
    if device.type == "cpu":
        if buffer.owner is not None:  # a pinned block: never hand one to the caller
            host = torch.from_numpy(pageable_copy(buffer, pageable))
            pinned.release(buffer)
            return host
        return torch.from_numpy(pageable.lend(buffer))
    module = device_module(device)
    if buffer.owner is None:  # a pageable block for an accelerator: a synchronous copy
        try:
            return torch.from_numpy(buffer.array).to(device)
        finally:
            pageable.release(buffer)
    try:
        host = as_tensor(buffer)
        stream = copy_stream(device) if module is not None else None
        if stream is None:  # no streams: the copy is synchronous
            mask = host.to(device)
            pinned.release(buffer)
            return mask
        consumer = module.current_stream(device)  # type: ignore[union-attr]
        with module.stream(stream):  # type: ignore[union-attr]
            mask = host.to(device, non_blocking=True)
            ready = module.Event()  # type: ignore[union-attr]
            ready.record(stream)
    except BaseException:
        pinned.release(buffer)
        raise
    pinned.after(buffer, ready.query, ready.synchronize)
    consumer.wait_event(ready)
    mask.record_stream(consumer)
    mark_ready(mask, ready, consumer)
    return mask


def pageable_copy(buffer: HostBuffer, pool: HostBufferPool) -> Any:
    """A copy of ``buffer.array`` in a block of ``pool``, lent to the caller."""
    target = pool.acquire(buffer.array.shape, buffer.array.dtype)
    target.array[...] = buffer.array
    return pool.lend(target)


def mark_ready(mask: torch.Tensor, ready: Any, waiter: Any) -> None:
    """Remember on ``mask`` the event after its upload and the stream already waiting."""
    setattr(mask, _READY, ready)
    setattr(mask, _WAITER, waiter)


def mask_ready_event(mask: torch.Tensor) -> Any | None:
    """The event recorded after ``mask``'s upload (None for masks this backend did not upload
    to an accelerator). An engine consuming the mask on a stream of its own can
    ``stream.wait_event(event)``; :func:`apply_vocab_mask_torch` does it by itself."""
    return getattr(mask, _READY, None)


def wait_until_ready(mask: torch.Tensor, stream: Any) -> None:
    """Make ``stream`` wait (on the device, not the host) for ``mask``'s upload, and keep the
    mask's memory from reuse until ``stream``'s work on it is done. No-op for masks that were
    not uploaded by this backend, and for the stream the upload already ordered."""
    ready = getattr(mask, _READY, None)
    if ready is None or stream is None or stream == getattr(mask, _WAITER, None):
        return
    stream.wait_event(ready)
    mask.record_stream(stream)


def resolve_device(device: Any) -> torch.device:
    """``torch.device`` of a device argument (None means the CPU)."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return device
    if isinstance(device, (str, int)) and not isinstance(device, bool):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"{device!r} is not a torch device: {exc}") from None
    raise TypeError(f"device must be a torch.device, a device string or None, got {device!r}")


def upload_compact_mask(
    buffer: HostBuffer,
    mask: CompactMask,
    device: torch.device,
    pinned: PinnedPool,
    pageable: HostBufferPool,
) -> CompactMask:
    """Start the copy of a host compact mask (views of ``buffer``) to ``device``; return the
    device ``CompactMask`` at once.

    To an accelerator: the whole index and the first ``count`` bit rows are copied
    (``non_blocking``, from the pinned block, on the device's copy stream) into a device index
    and a ``[capacity, words]`` bits tensor whose padding rows are left unwritten: exactly
    ``count`` rows and the index travel. The ordering is that of :func:`upload_mask` (one
    event after both copies; the current stream waits on it; both tensors are
    ``record_stream``-ed and marked ready). To the CPU: the arrays themselves, on pageable
    memory (no copy). If this raises, the buffer is back in its pool.
    """
    count = mask.count or 0
    if device.type == "cpu":
        if buffer.owner is not None:  # a pinned block: never hand one to the caller
            try:
                copy = pageable.acquire(buffer.array.shape, buffer.array.dtype)
                host = rebase_compact(mask, buffer.array, copy.array)
                host.rows[...] = mask.rows
                host.bits[:count] = mask.bits[:count]
                lent = rebase_compact(mask, buffer.array, pageable.lend(copy))
            finally:
                pinned.release(buffer)
        else:
            lent = rebase_compact(mask, buffer.array, pageable.lend(buffer))
        return CompactMask(
            torch.from_numpy(lent.rows), torch.from_numpy(lent.bits), mask.num_rows, mask.count
        )
    module = device_module(device)
    shape = tuple(mask.bits.shape)
    if buffer.owner is None:  # a pageable block for an accelerator: synchronous copies
        try:
            rows = torch.from_numpy(mask.rows).to(device)
            bits = torch.empty(shape, dtype=torch.int32, device=device)
            bits[:count].copy_(torch.from_numpy(mask.bits[:count]))
        finally:
            pageable.release(buffer)
        return CompactMask(rows, bits, mask.num_rows, mask.count)
    try:
        host = rebase_compact(mask, buffer.array, as_tensor(buffer))
        stream = copy_stream(device) if module is not None else None
        if stream is None:  # no streams: the copies are synchronous
            rows = host.rows.to(device)
            bits = torch.empty(shape, dtype=torch.int32, device=device)
            bits[:count].copy_(host.bits[:count])
            pinned.release(buffer)
            return CompactMask(rows, bits, mask.num_rows, mask.count)
        consumer = module.current_stream(device)  # type: ignore[union-attr]
        with module.stream(stream):  # type: ignore[union-attr]
            rows = host.rows.to(device, non_blocking=True)
            bits = torch.empty(shape, dtype=torch.int32, device=device)
            if count:
                bits[:count].copy_(host.bits[:count], non_blocking=True)
            ready = module.Event()  # type: ignore[union-attr]
            ready.record(stream)
    except BaseException:
        pinned.release(buffer)
        raise
    pinned.after(buffer, ready.query, ready.synchronize)
    consumer.wait_event(ready)
    for tensor in (rows, bits):
        tensor.record_stream(consumer)
        mark_ready(tensor, ready, consumer)
    return CompactMask(rows, bits, mask.num_rows, mask.count)
