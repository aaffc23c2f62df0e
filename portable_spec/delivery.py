"""Delivery: where a mask goes, and the one way a host mask gets there.

Every mask the library returns on a device goes through the same steps, whoever built its
rows (:func:`portable_spec.build_grammar_vocab_mask`, :class:`portable_spec.DraftSession`):

::

    resolve_target   device / backend arguments      -> (backend, placement)
    plan             placement + row capacity        -> MaskLayout (checked before any work)
    deliver          acquire a pooled host buffer -> fill the built rows -> arrange them into
                     the layout's blocks -> start the upload (the buffer goes back to its pool
                     if anything before the upload raises)

The arrangement moves the built rows (``b * nodes + j``, at the start of the host buffer) to
where the backend's placement wants them and makes every other row all-allowed (-1).
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Integral
from time import perf_counter
from typing import Any, TypeVar

import numpy as np

from portable_spec.backend import Backend, MaskLayout
from portable_spec.hostbuffers import HostBuffer
from portable_spec.masks import ALL_ALLOWED, CompactMask, compact_views, index_words
from portable_spec.registry import backend_for, get_backend

__all__ = [
    "arrange",
    "check_capacity",
    "check_mask_layout",
    "deliver",
    "deliver_compact",
    "move_rows",
    "plan",
    "resolve_target",
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
def _send(
    backend: Backend,
    placement: Any,
    rows: int,
    words: int,
    fill: Callable[[np.ndarray], T | None],
    upload: Callable[[HostBuffer, T], Any],
) -> tuple[Any, float]:
    """Acquire a pooled int32 ``[rows, words]`` host buffer, ``fill`` it, and start its
    ``upload``; the buffer goes back to the pool if ``fill`` raises or returns ``None``
    (nothing to send: ``(None, 0.0)``). Returns ``(uploaded, seconds the upload call took)``."""
    buffer = backend.acquire_host_mask(rows, words, placement)
    try:
        filled = fill(buffer.array)
    except BaseException:
        backend.release_host_mask(buffer)
        raise
    if filled is None:
        backend.release_host_mask(buffer)
        return None, 0.0
    uploading = perf_counter()
    uploaded = upload(buffer, filled)
    return uploaded, perf_counter() - uploading


def deliver(
    backend: Backend,
    layout: MaskLayout,
    words: int,
    build: Callable[[np.ndarray], bool],
    *,
    always: bool,
) -> tuple[Any, float]:
    """Build a dense mask into a pooled host buffer and start its upload.

    Args:
        backend, layout: from :func:`resolve_target` and :func:`plan`.
        words: int32 words per row.
        build: writes the built rows into the int32 ``[batch * nodes, words]`` array it gets
            (the start of the host buffer); returns False when no row is constrained (no
            request has a grammar: what it wrote is ignored).
        always: upload an all-allowed mask when ``build`` returns False (a fixed row
            capacity, or a placement spanning processes); else nothing is uploaded.

    Returns:
        ``(mask, upload seconds)``: the backend's int32 ``[host_rows, words]`` array, or
        ``None`` (nothing constrained and not ``always``). The upload is started without
        blocking; the host buffer is the backend's from then on.
    """
    built = sum(count for _src, count, _dst in layout.blocks)

    def fill(host: np.ndarray) -> np.ndarray | None:
        if build(host[:built]):
            arrange(host, layout.blocks)
        elif always:
            host.fill(ALL_ALLOWED)
        else:
            return None
        return host

    def upload(buffer: HostBuffer, _host: np.ndarray) -> Any:
        return backend.upload(buffer, layout.placement)

    return _send(backend, layout.placement, layout.host_rows, words, fill, upload)


def deliver_compact(
    backend: Backend,
    layout: MaskLayout,
    words: int,
    rows: int,
    build: Callable[[CompactMask], CompactMask | None],
    *,
    max_rows: int | None,
    always: bool,
) -> tuple[Any, float]:
    """Build a compact mask into one pooled host block (its bits, then its row index) and
    start its upload.

    Args:
        backend, layout, words: as for :func:`deliver`; ``layout.host_rows`` is the number
            of logits rows the mask applies to.
        rows: the built rows (``batch * nodes``).
        build: fills the :class:`CompactMask` it gets (entries for ``max_rows`` rows, else
            ``rows``; row numbers of the built rows) and returns the filled one, or ``None``
            when no request has a grammar.
        max_rows: the fixed number of entries of the returned mask, or ``None`` (exactly the
            rows listed).
        always: send an empty (or ``max_rows`` padding) mask rather than ``None`` when
            nothing is constrained; ``max_rows`` implies it.

    Returns:
        ``(compact mask of the backend's arrays or None, upload seconds)``; row indices are
        those of the dense mask of ``layout``, padding entries point past the logits.
    """
    num_rows = layout.host_rows
    entries = rows if max_rows is None else max_rows
    block_rows = entries + index_words(entries, words)

    def fill(block: np.ndarray) -> CompactMask | None:
        index, bits = compact_views(block, entries)
        host = build(CompactMask(index, bits, rows))
        if host is None and not always and max_rows is None:
            return None
        count = 0 if host is None else host.count
        size = (0 if max_rows is None else max_rows) if host is None else host.capacity
        move_rows(index[:count], layout.blocks)  # type: ignore[misc]
        index[count:size] = num_rows  # padding: a row past the logits
        return CompactMask(index[:size], bits[:size], num_rows, count)

    def upload(buffer: HostBuffer, mask: CompactMask) -> Any:
        return backend.upload_compact(buffer, mask, layout.placement)

    return _send(backend, layout.placement, block_rows, words, fill, upload)
