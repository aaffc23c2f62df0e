"""Pooled host buffers for bitmasks, reused only when nothing can still read them.

A mask buffer can be read after the build by two kinds of consumers:

* an asynchronous host-to-device copy still in flight (CUDA ``non_blocking`` copies from
  pinned memory; PJRT transfers started by ``jax.device_put``), and
* an array that aliases the host memory (numpy results, torch CPU tensors, and
  ``jax.device_put`` on the CPU platform, which may wrap a numpy buffer without copying).

The pool covers both with one rule: a buffer goes back to the free list only when every
array created from it has been garbage collected (frameworks keep the source array alive
while a transfer reads it or while they alias it) and, where the backend recorded one, the
completion event of its last copy has fired.

Returns of lent blocks happen in ``weakref.finalize`` callbacks, and plain releases in
finalisers (``__del__``), which the garbage collector may run at any allocation, also in a
thread that holds the pool's lock. They therefore take no lock: they append to a queue that
the next locked operation drains.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["HostBuffer", "HostBufferPool"]


@dataclass(eq=False)
class HostBuffer:
    """A pooled block of host memory presented as a C-contiguous numpy array.

    Attributes:
        array: the view callers write into (shape and dtype as acquired).
        block: the pool's raw uint8 storage behind ``array``.
        owner: a framework object that owns the memory (a pinned ``torch.Tensor``), or None.
    """

    array: np.ndarray
    block: np.ndarray
    owner: Any


class _Lease:
    """An ``__array_interface__`` carrier: arrays built from it keep it as their ``base``.

    numpy stops collapsing ``base`` chains at non-ndarray objects, so every view derived from
    the lent array (slices, reshapes, ``torch.from_numpy``, JAX's aliasing) holds this object
    alive. Its death is therefore the moment the memory is unreferenced.
    """

    __slots__ = ("__array_interface__", "__weakref__", "keepalive")

    def __init__(self, array: np.ndarray, keepalive: Any) -> None:
        self.__array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (array.__array_interface__["data"][0], False),
            "strides": None,
            "version": 3,
        }
        self.keepalive = keepalive


_ALIGNMENT = 64  # cache line; also what XLA's CPU client needs to use host memory in place


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 array of ``nbytes`` whose data is 64-byte aligned."""
    raw = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
    offset = (-raw.__array_interface__["data"][0]) % _ALIGNMENT
    return raw[offset : offset + nbytes]


def _round_capacity(nbytes: int) -> int:
    """Round a request up so that nearby batch sizes share blocks (at most 12.5% slack)."""
    nbytes = max(nbytes, 4096)
    step = 1 << max(nbytes.bit_length() - 4, 12)
    return -(-nbytes // step) * step


class HostBufferPool:
    """Thread-safe pool of host blocks for bitmask staging.

    Args:
        allocate: returns ``(uint8 numpy array of exactly nbytes, owner)`` for a new block;
            ``owner`` keeps foreign memory alive (for example a pinned torch tensor).
        max_free: how many idle blocks to keep; more are dropped (freed) on release.
        max_in_flight: how many blocks may wait on completion events before ``acquire``
            waits for the oldest instead of allocating another.
    """

    def __init__(
        self,
        allocate: Callable[[int], tuple[np.ndarray, Any]] | None = None,
        *,
        max_free: int = 8,
        max_in_flight: int = 16,
    ) -> None:
        self._allocate = allocate or (lambda n: (aligned_empty(n), None))
        self._max_free = max_free
        self._max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._free: list[tuple[np.ndarray, Any]] = []
        # blocks whose last upload may still be reading them: (block, owner, done, wait)
        self._in_flight: list[tuple[np.ndarray, Any, Callable[[], bool], Callable[[], None]]] = []
        self._lent = 0
        self._allocated_bytes = 0
        self._allocations = 0
        # lent blocks whose arrays died: (block, owner, done, wait); appended without a lock
        self._returned: deque[tuple[np.ndarray, Any, Any, Any]] = deque()

    # -- lending -------------------------------------------------------------------------------
    def acquire(self, shape: tuple[int, ...], dtype: Any = np.int32) -> HostBuffer:
        """Lend a buffer for a C-contiguous array of ``shape`` and ``dtype``; contents undefined.

        Never blocks, except to wait for the oldest in-flight transfer when ``max_in_flight``
        are pending.
        """
        dtype = np.dtype(dtype)
        count = 1
        for n in shape:
            count *= n
        nbytes = max(count * dtype.itemsize, 1)
        with self._lock:
            self._drain_returned_locked()
            self._collect_finished_locked()
            block, owner = self._take_free_locked(nbytes)
            oldest = None
            if block is None and len(self._in_flight) >= self._max_in_flight:
                oldest = self._in_flight.pop(0)
            self._lent += 1
        if oldest is not None:
            oldest[3]()  # wait for its transfer; it is ours now
            block, owner = oldest[0], oldest[1]
            if block.nbytes < nbytes:
                self._give_back(block, owner)
                block = None
        if block is None:
            block, owner = self._allocate(_round_capacity(nbytes))
            with self._lock:
                self._allocated_bytes += block.nbytes
                self._allocations += 1
        array = block[: count * dtype.itemsize].view(dtype).reshape(shape)
        return HostBuffer(array=array, block=block, owner=owner)

    def release(self, buffer: HostBuffer) -> None:
        """Return a buffer nobody else has seen (not uploaded, not lent).

        Takes no lock (the buffer joins the queue of returned blocks that the next locked
        operation drains): finalisers such as an unclosed ``DraftSession``'s ``__del__``
        release buffers, and the garbage collector may run them inside this pool's lock."""
        self._returned.append((buffer.block, buffer.owner, None, None))

    def lend(
        self,
        buffer: HostBuffer,
        done: Callable[[], bool] | None = None,
        wait: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Hand ``buffer.array``'s memory to the caller as a new array.

        The block returns to the pool once that array and everything derived from it are
        garbage collected and, if ``done`` is given (the completion check of a transfer that
        writes or reads the block), once ``done()`` is true; ``wait()`` blocks until it is.
        """
        lease = _Lease(buffer.array, (buffer.block, buffer.owner))
        lent = np.asarray(lease)
        weakref.finalize(lease, self._return_lent, buffer.block, buffer.owner, done, wait)
        return lent

    def after(self, buffer: HostBuffer, done: Callable[[], bool], wait: Callable[[], None]) -> None:
        """Return ``buffer`` once ``done()`` is true (an upload's completion event).

        ``wait()`` blocks until ``done()`` would be true; it is used when too many uploads are
        in flight.
        """
        with self._lock:
            self._lent -= 1
            self._in_flight.append((buffer.block, buffer.owner, done, wait))

    def stats(self) -> dict[str, int]:
        """Counters: blocks free, lent, in flight, bytes allocated so far, allocations."""
        with self._lock:
            self._drain_returned_locked()
            return {
                "free": len(self._free),
                "lent": self._lent,
                "in_flight": len(self._in_flight),
                "allocated_bytes": self._allocated_bytes,
                "allocations": self._allocations,
            }

    # -- internals -----------------------------------------------------------------------------
    def _return_lent(
        self,
        block: np.ndarray,
        owner: Any,
        done: Callable[[], bool] | None,
        wait: Callable[[], None] | None,
    ) -> None:
        # A finaliser: may run inside any locked section of this thread. No lock here.
        self._returned.append((block, owner, done, wait))

    def _drain_returned_locked(self) -> None:
        while self._returned:
            block, owner, done, wait = self._returned.popleft()
            self._lent -= 1
            if done is not None and wait is not None:
                self._in_flight.append((block, owner, done, wait))
            else:
                self._give_back_locked(block, owner)

    def _give_back(self, block: np.ndarray, owner: Any) -> None:
        with self._lock:
            self._give_back_locked(block, owner)

    def _give_back_locked(self, block: np.ndarray, owner: Any) -> None:
        self._free.append((block, owner))
        if len(self._free) > self._max_free:
            # drop the smallest idle block: large ones are the expensive ones to fault in
            smallest = min(range(len(self._free)), key=lambda i: self._free[i][0].nbytes)
            dropped = self._free.pop(smallest)
            self._allocated_bytes -= dropped[0].nbytes

    def _take_free_locked(self, nbytes: int) -> tuple[np.ndarray | None, Any]:
        best = -1
        for i, (block, _owner) in enumerate(self._free):
            size = block.nbytes
            if size >= nbytes and (best < 0 or size < self._free[best][0].nbytes):
                best = i
        if best < 0:
            return None, None
        return self._free.pop(best)

    def _collect_finished_locked(self) -> None:
        if not self._in_flight:
            return
        still = []
        for entry in self._in_flight:
            if entry[2]():
                self._free.append((entry[0], entry[1]))
            else:
                still.append(entry)
        self._in_flight = still
