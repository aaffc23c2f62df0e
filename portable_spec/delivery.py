"""Delivery: where a mask goes, and the one way a host mask gets there.

Every mask the library returns on a device goes through the same steps, whoever built its
rows (:func:`portable_spec.build_grammar_vocab_mask`, :class:`portable_spec.DraftSession`):

::

    resolve_target   device / backend arguments      -> (backend, placement)
    plan             placement + row capacity        -> MaskLayout (checked before any work)
    deliver          acquire a pooled host buffer -> fill the built rows -> settle them
                     (arrange into the layout's blocks) -> start the upload (the buffer goes
                     back to its pool if anything before the upload raises)

The arrangement moves the built rows (``b * nodes + j``, at the start of the host buffer) to
where the backend's placement wants them and makes every other row all-allowed (-1).

A :class:`portable_spec.DraftSession` whose masks stay in host memory (numpy, a CPU tensor:
:meth:`Backend.host_mask`) makes one call per drafted level; it fills and settles each mask the
same way but in rows carved from one lent block per session, with nothing to upload.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Integral
from time import perf_counter
from typing import Any, TypeVar

import numpy as np

from portable_spec.backend import Backend, MaskLayout
from portable_spec.hostbuffers import HostBuffer
from portable_spec.masks import ALL_ALLOWED, CompactMask, index_words
from portable_spec.registry import backend_for, get_backend

__all__ = [
    "arrange",
    "built_rows",
    "check_capacity",
    "check_mask_layout",
    "compact_rows",
    "deliver",
    "move_rows",
    "plan",
    "resolve_target",
    "settle_compact",
    "settle_dense",
]

T = TypeVar("T")


# -- where the mask goes --------------------------------------------------------------------------
def resolve_target(
    device: Any, backend: str | Backend | None = None, *, default: tuple[Backend, Any] | None = None
) -> tuple[Backend, Any]:
    """The backend and placement a mask is uploaded with.

    Args:
        device: a framework device or placement object (``torch.device``, ``jax.Device``,
            ``jax.sharding.Sharding``): its own backend; a device string: understood by
            ``backend``, else by the default's backend; ``None``: the default's placement
            (or that backend's default device when ``backend`` is given).
        backend: a backend name or object, or ``None`` (the backend of ``device``).
        default: ``(backend, placement)`` used when neither names one (the tree's own
            target); ``None``: numpy host arrays.

    Returns:
        ``(backend, placement)``; the placement is ``device`` itself (or the default's).

    Raises:
        TypeError: ``backend`` is neither a name nor a :class:`Backend`; a device object of
            another framework than ``backend`` (objects no framework claims, such as a device
            index, are left to ``backend``); a device string with nothing to say which
            framework it belongs to. Raised before anything is built.
        ValueError: an unknown backend name.
    """
    if backend is not None:
        if isinstance(backend, str):
            backend = get_backend(backend)
        elif not isinstance(backend, Backend):
            raise TypeError(f"backend must be a name or a Backend, got {type(backend).__name__}")
        if device is not None and not isinstance(device, str) and not backend.owns(device):
            other = _claimed_by(device)
            if other is not None:
                raise TypeError(
                    f"device {device!r} is a {other.name!r} device and does not belong to "
                    f"backend {backend.name!r}: pass a device of that framework, a device "
                    "string, or leave out backend="
                )
        return backend, device
    if device is None:
        return default if default is not None else (get_backend("numpy"), None)
    if isinstance(device, str):
        if default is None:
            raise TypeError(
                f"device={device!r} is a string: pass backend= too (e.g. backend='torch'), or "
                "a device object (torch.device, jax.Device, jax.sharding.Sharding)"
            )
        return default[0], device
    return backend_for(device), device


def _claimed_by(device: Any) -> Backend | None:
    """The registered backend whose framework ``device`` belongs to, or None when no
    framework the caller imported claims it (a device index: the named backend's to read)."""
    try:
        return backend_for(device)
    except TypeError:
        return None


def check_capacity(row_capacity: Any, rows: int) -> int:
    """``row_capacity`` as an int of at least ``rows``; ``TypeError``/``ValueError`` otherwise."""
    if isinstance(row_capacity, bool) or not isinstance(row_capacity, Integral):
        raise TypeError(f"row_capacity must be an int, got {type(row_capacity).__name__}")
    if row_capacity < 1:
        raise ValueError(f"row_capacity must be positive, got {row_capacity}")
    if row_capacity < rows:
        raise ValueError(
            f"row_capacity = {row_capacity} is smaller than the mask's {rows} rows (batch * nodes)"
        )
    return int(row_capacity)


def plan(
    backend: Backend,
    placement: Any,
    batch: int,
    nodes: int,
    vocab_size: int,
    row_capacity: int | None,
    *,
    packed_rows: int | None = None,
) -> MaskLayout:
    """Check a mask's capacity and placement and say where its ``batch * nodes`` built rows go
    (the backend's :meth:`Backend.mask_layout`, checked by :func:`check_mask_layout`). Never
    blocks; raises ``TypeError``/``ValueError`` before anything is built.

    ``packed_rows``: the rows of packed chains (not split by request), instead of
    ``batch * nodes``: the placement must keep the mask whole on this process (one device,
    or replicated).
    """
    packed = packed_rows is not None
    rows = packed_rows if packed_rows is not None else batch * nodes
    capacity = None if row_capacity is None else check_capacity(row_capacity, rows)
    if not packed:
        layout = backend.mask_layout(placement, batch, nodes, vocab_size, capacity)
    else:
        layout = backend.mask_layout(placement, 1, rows, vocab_size, capacity)
        if layout.collective or layout.blocks != ((0, rows, 0),):
            raise ValueError(
                "packed chains (GrammarTree.from_packed_chains) need a placement that keeps "
                "the mask's rows together on this process (one device); shard by requests "
                "with a [batch, nodes] tree instead"
            )
    check_mask_layout(layout, rows, backend)
    return layout


def check_mask_layout(layout: MaskLayout, rows: int, backend: Backend) -> None:
    """A backend's layout must cover the built rows once, in order, moving rows only forward
    (so that :func:`arrange` can move them in place) and within the host buffer;
    ``ValueError`` otherwise."""
    built = host = 0
    for src, count, dst in layout.blocks:
        if src != built or count < 0 or dst < src or dst < host:
            break
        built, host = src + count, dst + count
    else:
        if built == rows and host <= layout.host_rows:
            return
    raise ValueError(f"backend {backend.name!r} returned an invalid mask layout {layout}")


# -- arranging the built rows ----------------------------------------------------------------------
def arrange(host: np.ndarray, blocks: tuple[tuple[int, int, int], ...]) -> None:
    """Move the built rows (at the start of ``host``, int32 ``[host_rows, words]``) to their
    blocks, last block first (each moves forward, so no block overwrites rows not yet moved),
    and set the rest to all-allowed (-1). In place; never blocks."""
    for src, count, dst in reversed(blocks):
        if dst != src and count:
            host[dst : dst + count] = host[src : src + count]
    end = 0
    for _src, count, dst in blocks:
        if dst > end:
            host[end:dst] = ALL_ALLOWED
        end = dst + count
    if end < host.shape[0]:
        host[end:] = ALL_ALLOWED


def move_rows(index: np.ndarray, blocks: tuple[tuple[int, int, int], ...]) -> None:
    """Built row numbers (int32 ``[k]``, in place) -> rows of the host mask, block by block
    (see :class:`MaskLayout`): what :func:`arrange` does to rows, for a compact mask's index."""
    if all(src == dst for src, _count, dst in blocks) or not index.size:
        return
    starts = np.array([src for src, _count, _dst in blocks], dtype=np.int64)
    shift = np.array([dst - src for src, _count, dst in blocks], dtype=np.int64)
    block = np.searchsorted(starts, index, side="right") - 1
    index += shift[block].astype(np.int32)


# -- the one delivery sequence ---------------------------------------------------------------------
def deliver(
    backend: Backend,
    layout: MaskLayout,
    words: int,
    fill: Callable[[np.ndarray], T | None],
    *,
    rows: int | None = None,
    send: Callable[[HostBuffer, T], Any] | None = None,
) -> tuple[Any, float]:
    """Acquire a pooled host buffer, ``fill`` it, and start its upload: the one sequence every
    returned mask goes through.

    Args:
        backend, layout: from :func:`resolve_target` and :func:`plan`.
        words: int32 words per row.
        fill: gets the int32 ``[rows, words]`` host array (contents undefined) and fills it:
            the built rows at its start, then :func:`settle_dense` (or
            :func:`settle_compact`); returns what to send, or ``None`` when there is nothing
            to send (no request has a grammar and no mask is owed).
        rows: rows of the host buffer (default: ``layout.host_rows``, a dense mask).
        send: starts the upload of the filled buffer (default: ``backend.upload`` to the
            layout's placement, a dense mask).

    Returns:
        ``(uploaded, seconds the upload call took)``; ``(None, 0.0)`` when ``fill`` returned
        ``None``. The upload is started without blocking; the host buffer is the backend's
        from then on, and goes back to its pool if ``fill`` raises or returns ``None``.
    """
    placement = layout.placement
    buffer = backend.acquire_host_mask(layout.host_rows if rows is None else rows, words, placement)
    try:
        filled = fill(buffer.array)
    except BaseException:
        backend.release_host_mask(buffer)
        raise
    if filled is None:
        backend.release_host_mask(buffer)
        return None, 0.0
    uploading = perf_counter()
    uploaded = backend.upload(buffer, placement) if send is None else send(buffer, filled)
    return uploaded, perf_counter() - uploading


def built_rows(layout: MaskLayout) -> int:
    """The built rows a (checked) layout places: its blocks cover them in order."""
    blocks = layout.blocks
    return blocks[-1][0] + blocks[-1][1] if blocks else 0


def settle_dense(
    host: np.ndarray, layout: MaskLayout, constrained: bool, always: bool
) -> np.ndarray | None:
    """After the built rows were written at the start of ``host`` (int32
    ``[host_rows, words]``): arranged into the layout's blocks when ``constrained``; else
    all-allowed when a mask is owed anyway (``always``: a fixed row capacity, or a placement
    spanning processes), else ``None`` (nothing to send). Returns ``host`` otherwise."""
    if constrained:
        arrange(host, layout.blocks)
    elif always:
        host.fill(ALL_ALLOWED)
    else:
        return None
    return host


def compact_rows(entries: int, words: int) -> int:
    """Rows of the host block of a compact mask of ``entries`` entries: the bits, then the
    int32 row index packed into whole rows."""
    return entries + index_words(entries, words)


def settle_compact(
    host: CompactMask | None,
    index: np.ndarray,
    bits: np.ndarray,
    layout: MaskLayout,
    *,
    max_rows: int | None,
    always: bool,
) -> CompactMask | None:
    """The compact mask to send once the build filled ``host`` (over ``index``/``bits``, the
    views of the block; ``None``: no request has a grammar): row numbers moved to the
    layout's rows, padding entries pointed past the logits (``layout.host_rows``). ``None``
    when nothing is owed (no grammar, not ``always``, no ``max_rows``)."""
    if host is None and not always and max_rows is None:
        return None
    num_rows = layout.host_rows
    count = 0 if host is None else host.count
    size = (0 if max_rows is None else max_rows) if host is None else host.capacity
    move_rows(index[:count], layout.blocks)
    index[count:size] = num_rows  # padding: a row past the logits
    return CompactMask(index[:size], bits[:size], num_rows, count)
