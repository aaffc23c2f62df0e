"""The backend contract: what every array framework provides to the portable core.

A backend is the small piece of framework-specific code between the host mask builder and an
accelerator. The core calls it at these points of one decoding step, always in this order::

    stage    tree arrays on the device  ->  host copies, started without blocking
    layout   placement + row capacity   ->  where each row goes in the host buffer (checks)
    resolve  wait for that copy only    ->  numpy int64 arrays
    (the core builds the bitmask into a host buffer the backend lent it)
    upload   host bitmask               ->  device array, started without blocking
    apply    logits + device bitmask    ->  logits with disallowed tokens at -inf

Backends never import their framework at module import time unless the framework is already
the reason the module is imported (the registry only loads a backend whose framework the
caller has imported, or one the caller asked for by name).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from portable_spec.hostbuffers import HostBuffer
from portable_spec.masks import CompactMask

__all__ = ["ArrayInfo", "Backend", "MaskLayout", "StagedArrays"]


@dataclass(frozen=True)
class ArrayInfo:
    """Metadata of an array, read without touching its data (no device synchronization).

    Attributes:
        shape: the array's shape.
        dtype: the framework's dtype object (printed in error messages).
        is_integer: whether the dtype is a (signed or unsigned) integer type; bool is not.
    """

    shape: tuple[int, ...]
    dtype: Any
    is_integer: bool


@dataclass(frozen=True)
class MaskLayout:
    """Where this process's mask rows go in the host buffer, and where the buffer is uploaded.

    Built by :meth:`Backend.mask_layout` before any matcher moves. The core builds the rows of
    the process's tree (row ``b * nodes + j`` for node ``j`` of request ``b``) at the start of
    the host buffer, then moves each block to its place and sets every row no block covers to
    all-allowed (-1).

    Attributes:
        host_rows: rows of the host buffer: the part of the mask this process uploads (the whole
            mask unless the placement spans several processes).
        blocks: ``(first built row, rows, first host row)`` triples, in ascending order, that
            together cover the built rows ``[0, batch * nodes)`` once; each block's host row is
            at or after its built row and the blocks do not overlap in the host buffer.
        placement: what the core passes to :meth:`Backend.upload` (and
            :meth:`Backend.acquire_host_mask`).
        collective: whether the mask is one array over several processes. Every process then
            returns a mask (all-allowed when none of its requests has a grammar), so that all
            of them run the same program.
    """

    host_rows: int
    blocks: tuple[tuple[int, int, int], ...]
    placement: Any = None
    collective: bool = False


class StagedArrays(Protocol):
    """Host copies of device arrays whose transfer may still be in flight."""

    def resolve(self) -> list[np.ndarray]:
        """Wait for the transfer (and nothing else) and return the host arrays.

        Blocks until the copies started by :meth:`Backend.stage` have landed. The returned
        arrays are numpy arrays in the order they were staged, with the staged arrays' shapes
        and (integer) dtypes; they may be read-only and need not be contiguous.
        """
        ...


class Backend(ABC):
    """One array framework's staging, host buffers, upload and apply.

    Subclasses set :attr:`name` (what :func:`portable_spec.get_backend` takes) and
    :attr:`framework` (the top-level module whose presence in ``sys.modules`` lets
    :func:`portable_spec.registry.backend_for` consider this backend without importing anything).
    """

    name: str = ""
    framework: str = ""

    # -- ownership ---------------------------------------------------------------------------
    @abstractmethod
    def owns(self, obj: Any) -> bool:
        """Whether ``obj`` (an array, or a device/placement object) belongs to this framework.

        Must not import anything and must not synchronize a device.
        """

    @abstractmethod
    def array_info(self, array: Any) -> ArrayInfo:
        """Shape and dtype facts of one of this framework's arrays, without reading its data."""

    def device_of(self, array: Any) -> Any:
        """Where ``array`` lives, as :meth:`upload` accepts it (``None`` for host arrays).

        A mask built for a tree staged from ``array`` is uploaded there by default.
        """
        return None

    # -- stage / resolve -----------------------------------------------------------------------
    @abstractmethod
    def stage(self, arrays: Sequence[Any]) -> StagedArrays:
        """Start copying ``arrays`` to the host without blocking the caller.

        Returns a handle whose ``resolve()`` waits for exactly these copies. Arrays already on
        the host are wrapped without a copy.
        """

    def to_host(self, array: Any) -> np.ndarray:
        """Return a host (numpy) view of an array that already lives in host memory.

        Raises ``TypeError`` when the array lives on an accelerator: host trees must not hide
        a device synchronization. The default implementation accepts nothing.
        """
        raise TypeError(
            f"{type(array).__name__} from backend {self.name!r} is not a host array; "
            "use GrammarTree.from_device for a framework's device arrays (JAX arrays on the "
            "CPU included)"
        )

    def host_view(self, array: Any) -> np.ndarray | None:
        """A numpy view of ``array`` when it lives in host memory and its memory holds its
        values (a CPU tensor: nothing to stage, no copy to wait for); ``None`` otherwise
        (device arrays, arrays that may still be computing, anything :meth:`to_host`
        refuses). Never blocks, never raises for this framework's arrays."""
        try:
            if self.device_of(array) is not None:
                return None
            return self.to_host(array)
        except (TypeError, ValueError, AttributeError):
            return None

    # -- mask layout ---------------------------------------------------------------------------
    def mask_layout(
        self,
        placement: Any,
        batch: int,
        nodes: int,
        vocab_size: int,
        row_capacity: int | None,
    ) -> MaskLayout:
        """Check a mask's placement and capacity and say where its rows go; before any matcher
        moves, so it must not block or touch device data.

        Args:
            placement: the ``device`` the mask goes to (as given to
                :func:`portable_spec.build_grammar_vocab_mask`, or the tree's device).
            batch, nodes: the shape of this process's tree (the mask's built rows are
                ``batch * nodes``).
            vocab_size: the logits' width (the mask has ``ceil(vocab_size / 32)`` words).
            row_capacity: the number of rows of the returned mask (``None``: the built rows).
                For a placement that spans several processes it counts the rows of the whole
                (global) mask.

        Returns:
            The default: the built rows first, padding at the end, ``placement`` unchanged, not
            collective. Backends whose placements split the mask's rows over devices override
            it so that every device holds its own requests' rows first, then its padding.

        Raises:
            ValueError: ``row_capacity`` is smaller than ``batch * nodes`` (or cannot be split
                the way the placement needs), or the placement cannot hold the mask.
        """
        rows = batch * nodes
        capacity = rows if row_capacity is None else row_capacity
        if capacity < rows:
            raise ValueError(
                f"row_capacity = {capacity} is smaller than the mask's {rows} rows (batch * nodes)"
            )
        return MaskLayout(capacity, ((0, rows, 0),), placement)

    # -- host buffers / upload -------------------------------------------------------------------
    @abstractmethod
    def acquire_host_mask(self, rows: int, words: int, device: Any = None) -> HostBuffer:
        """Lend an int32 host buffer of shape ``[rows, words]`` suited to an upload to ``device``.

        ``device`` is the placement the buffer will be passed to :meth:`upload` with (so a
        backend can pick pinned memory for accelerators and pageable memory for host
        destinations). The buffer's contents are undefined. It comes from a pool and is never
        one that a previous :meth:`upload` may still be reading, or that a previously returned
        array may still alias. Return it with :meth:`release_host_mask` if it is not uploaded.
        """

    @abstractmethod
    def release_host_mask(self, buffer: HostBuffer) -> None:
        """Give back a buffer from :meth:`acquire_host_mask` that was not uploaded."""

    @abstractmethod
    def upload(self, buffer: HostBuffer, device: Any = None) -> Any:
        """Send a filled host mask to ``device`` without blocking; take ownership of ``buffer``.

        Returns this framework's array of shape ``[rows, words]``, dtype int32. The buffer is
        reused for a later step only once the transfer has completed and no returned array
        aliases it any more. ``device=None`` means the framework's default placement.

        If it raises, the buffer has gone back to the pool (the caller must not release it).
        """

    def host_mask(self, array: np.ndarray, device: Any = None) -> Any:
        """This framework's array sharing the memory of ``array`` (a filled int32
        ``[rows, words]`` host mask the caller lends for good: it never writes it again) when
        ``device`` keeps masks in host memory, so that nothing has to be transferred; ``None``
        otherwise (the caller uploads a buffer from :meth:`acquire_host_mask` instead). Never
        blocks. The default: ``None``."""
        return None

    # -- apply -----------------------------------------------------------------------------------
    @abstractmethod
    def apply_vocab_mask(self, logits: Any, mask: Any, vocab_size: int | None = None) -> Any:
        """Set ``logits[i, t]`` to ``-inf`` where bit ``t`` of ``mask[i]`` is 0.

        ``logits`` is ``[rows, vocab]`` (or ``[vocab]`` for one row) of a floating dtype;
        ``mask`` is int32 ``[rows, words]`` covering every column (``32 * words >= vocab``;
        wider masks are allowed), or ``None`` when ``vocab_size`` is given. With
        ``vocab_size``, every column at or past it is ``-inf`` in every row and the mask
        need only cover ``vocab_size`` tokens (see :func:`portable_spec.masks.apply_columns`,
        which decides both and raises ``ValueError`` for a mask that does not cover the
        logits). Returns the masked logits; whether that is the same array (in place) or a
        new one is the backend's to document.
        """

    # -- compact masks (optional) -----------------------------------------------------------------
    def upload_compact(self, buffer: HostBuffer, mask: CompactMask, device: Any = None) -> Any:
        """Send a host :class:`CompactMask` to ``device`` without blocking; take ownership of
        ``buffer`` (whose array ``mask.rows`` and ``mask.bits`` are views of).

        ``mask`` has ``mask.capacity`` entries, ``mask.count`` of them real; the bits of the
        padding entries were never written and need not travel (a backend that needs a fixed
        device shape may still send them). Returns a ``CompactMask`` of this framework's arrays
        with the same entries, ``num_rows`` and ``count``. The buffer is reused only once the
        transfer has completed and nothing aliases it. If this raises, the buffer is back in
        its pool. Backends without compact masks leave this unimplemented: the layout is then
        refused (``TypeError``) before any matcher moves.
        """
        raise NotImplementedError(f"backend {self.name!r} has no compact mask layout")

    def apply_compact_mask(
        self, logits: Any, mask: CompactMask, vocab_size: int | None = None
    ) -> Any:
        """Set ``logits[mask.rows[k], t]`` to ``-inf`` where bit ``t`` of ``mask.bits[k]`` is 0,
        for the real entries; leave every other row alone (but for the columns at or past
        ``vocab_size``, ``-inf`` in every row). ``logits`` has ``mask.num_rows`` rows
        (``[vocab]`` when it is 1). Same in-place/functional behaviour and width rules as
        :meth:`apply_vocab_mask`, and the same result as applying ``mask.to_dense()``."""
        raise TypeError(f"backend {self.name!r} cannot apply a CompactMask")

    @classmethod
    def supports_compact(cls) -> bool:
        """Whether this backend implements :meth:`upload_compact`."""
        return cls.upload_compact is not Backend.upload_compact

    # -- builds that do not wait -------------------------------------------------------------------
    def capture_context(self, device: Any = None) -> Callable[[], AbstractContextManager[Any]]:
        """Called on the caller's thread by ``build_grammar_vocab_mask(..., wait=False)``;
        returns a factory of the context the background build runs its upload in, so that
        the upload behaves as if the caller had made it (torch: the caller's current stream
        on ``device``, which is the stream made to wait for the upload; JAX: its default
        device). The default captures nothing."""
        return nullcontext

    # -- capabilities ----------------------------------------------------------------------------
    def describe(self) -> str:
        """A one-line description for ``portable-spec`` output and test reports."""
        return self.name

    def __repr__(self) -> str:
        return f"<portable_spec backend {self.name!r}>"
