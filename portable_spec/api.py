"""Device-facing entry points: build and upload a mask, and apply it to logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec.backend import Backend, MaskLayout
from portable_spec.builder import build_host_bitmask
from portable_spec.masks import (
    ALL_ALLOWED,
    CompactMask,
    check_layout,
    check_vocab_size,
    compact_views,
    index_words,
    words_for,
)
from portable_spec.pending import start_pending
from portable_spec.pool import submit
from portable_spec.registry import backend_for
from portable_spec.stats import record_upload
from portable_spec.tree import GrammarTree

__all__ = ["apply_vocab_mask", "build_grammar_vocab_mask"]


def _target(tree: GrammarTree, device: Any) -> tuple[Backend, Any]:
    if device is None:
        return tree.backend, tree.device
    if isinstance(device, str):
        return tree.backend, device
    return backend_for(device), device


def build_grammar_vocab_mask(
    grammars: Sequence[Any],
    tree: GrammarTree,
    vocab_size: int,
    *,
    device: Any = None,
    row_capacity: int | None = None,
    layout: str = "dense",
    max_rows: int | None = None,
    wait: bool = True,
    reasoning: Any = None,
    return_valid: bool = False,
) -> Any:
    """Build the batch's grammar bitmask on the host and start its upload to ``device``.

    Args:
        grammars: one entry per request of this process's tree, as for
            :func:`build_host_bitmask`.
        tree: the batch's verify trees; its backend (the framework of the arrays it was
            staged from) receives the mask unless ``device`` names another framework.
        vocab_size: the model's vocabulary size (the logits' width).
        device: where the mask goes: a framework device or placement object (a
            ``torch.device``, a ``jax.Device`` or ``jax.sharding.Sharding``), a device string
            understood by the tree's framework (JAX: one of this process's devices), or
            ``None`` for where the tree came from (the device of its arrays; a batch-sharded
            JAX tree gives a mask whose rows are sharded the same way).
        row_capacity: the number of rows of the returned mask (all-allowed padding), so that
            engines compiled for a fixed batch capacity see one shape whatever the batch (no
            recompilation of the sampler). At least ``batch * nodes``. It counts the rows of
            the whole mask: when the placement splits the rows over devices (or processes),
            each device gets ``row_capacity / parts`` rows, its own requests' rows first, then
            its padding, so the capacity must divide evenly and leave every part room for its
            requests. With ``layout="compact"``: the logits rows the mask applies to
            (``num_rows``), the row indices being those of the dense mask of that capacity.
        layout: ``"dense"`` (default) or ``"compact"``: a :class:`portable_spec.CompactMask`
            of the backend's arrays, listing only the rows of accepted, non-terminated nodes
            of constrained requests (``K`` of them; every other row is all-allowed). Only
            those ``K`` rows are written on the host and sent to the device, with their int32
            row indices. Single-process placements only (a mask split over devices gets a
            compact mask replicated on them).
        max_rows: compact only: the number of entries of the returned mask (``K`` real ones,
            then padding that applies to nothing), so that XLA and CUDA graphs see one shape.
            ``ValueError`` if a build lists more rows (after the walks; every matcher is back
            in its state). ``None``: exactly ``K`` entries.
        wait: ``True`` (default) blocks until the host mask is built and its upload started.
            ``False`` returns a :class:`portable_spec.PendingMask` at once; the build and the
            upload run on the library's background thread and pool, and ``result()`` returns
            (or raises) what the blocking call would have. **The build owns the matchers
            until ``result()`` returns**: the caller must not touch them, and another build
            over any of them is refused with ``ValueError`` meanwhile. The upload behaves as
            if made by the caller at call time (torch: the stream current on the calling
            thread is the one made to wait for it; JAX: the caller's default device).
        reasoning: a :class:`portable_spec.Reasoning` for reasoning models, as for
            :func:`build_host_bitmask` (dense layout only).
        return_valid: also return which nodes the grammars accept: a host (numpy) bool
            ``[batch, nodes]`` array, as for :func:`build_host_bitmask`.

    Returns:
        The backend's int32 ``[rows, ceil(vocab / 32)]`` array, ``rows`` being
        ``row_capacity`` or ``batch * nodes`` (summed over processes for a multi-process
        placement), with the rows of :func:`build_host_bitmask`; or ``None`` when no request
        has a grammar (the engine should then drop any mask it kept from an earlier step),
        **except** when ``row_capacity`` is given or the placement spans other processes: then
        the all-allowed mask of that shape and placement comes back, so the engine's jitted
        sampler sees one signature and every process runs the same program. With
        ``layout="compact"``, a ``CompactMask`` of the backend's arrays instead (an empty one,
        or ``max_rows`` padding entries, rather than ``None`` when ``row_capacity`` or
        ``max_rows`` is given). With ``wait=False``, a ``PendingMask`` of that result. With
        ``return_valid=True``: ``(mask, valid)``.

    Raises:
        TypeError, ValueError: bad grammars, tree, vocabulary size, ``row_capacity``, layout or
            placement (for example a capacity the placement's row shards cannot divide);
            raised before any matcher moves. With ``wait=False`` only the checks that need no
            matcher and no tree data run in the call (argument types, placement, matchers held
            by a pending build); the rest surface from ``result()``.
        MatcherError: a matcher raised during its walk (every matcher is back in its state).

    Blocks while the host mask is built (after waiting for the tree's staged copy), unless
    ``wait=False``; the upload itself is started without blocking. The host buffer comes from
    the backend's pool (pinned where the platform has pinning) and is reused only after the
    upload finished and no returned array aliases it.
    """
    started = perf_counter()
    if not isinstance(tree, GrammarTree):
        raise TypeError(f"tree must be a portable_spec.GrammarTree, got {type(tree).__name__}")
    if not isinstance(wait, bool):
        raise TypeError(f"wait must be a bool, got {type(wait).__name__}")
    backend, placement = _target(tree, device)
    words = words_for(check_vocab_size(vocab_size))
    max_rows = check_layout(layout, max_rows)
    rows = tree.rows
    capacity = None if row_capacity is None else _check_capacity(row_capacity, rows)
    if not tree.is_packed:
        mask_layout = backend.mask_layout(placement, tree.batch, tree.nodes, vocab_size, capacity)
    else:
        mask_layout = _packed_layout(backend, placement, rows, vocab_size, capacity)
    _check_layout(mask_layout, rows, backend)
    if layout == "compact" and tree.is_packed:
        raise ValueError(
            "packed chains (GrammarTree.from_packed_chains) build dense masks only; "
            "use layout='dense'"
        )
    if layout == "compact":
        _check_compact(backend, mask_layout)
        if reasoning is not None:
            raise ValueError("reasoning= builds dense masks only; use layout='dense'")
    options = _Options(layout, max_rows, reasoning, return_valid)
    args = (grammars, tree, vocab_size, backend, mask_layout, words, capacity, options)
    if wait:
        mask, upload_seconds = _build_and_upload(*args)
        record_upload(upload_seconds, perf_counter() - started)
        return mask
    if isinstance(grammars, (str, bytes)) or not isinstance(grammars, Sequence):
        raise TypeError(
            f"grammars must be a sequence with one entry per request, got {type(grammars).__name__}"
        )

    def build() -> Any:
        mask, upload_seconds = _build_and_upload(*args)
        record_upload(upload_seconds, 0.0)
        return mask

    context = backend.capture_context(mask_layout.placement)
    handle = start_pending(list(grammars), build, context, submit)
    record_upload(0.0, perf_counter() - started)
    return handle


@dataclass(frozen=True)
class _Options:
    layout: str
    max_rows: int | None
    reasoning: Any
    return_valid: bool


def _build_and_upload(
    grammars: Sequence[Any],
    tree: GrammarTree,
    vocab_size: int,
    backend: Backend,
    mask_layout: MaskLayout,
    words: int,
    capacity: int | None,
    options: _Options,
) -> tuple[Any, float]:
    """Build into a pooled host buffer and start the upload; ``(result, upload seconds)``,
    the result being the mask, or ``(mask, valid)`` with ``return_valid``."""
    rows = tree.rows
    always = capacity is not None or mask_layout.collective
    if options.layout == "compact":
        return _build_compact(
            grammars, tree, vocab_size, backend, mask_layout, words, always, options
        )
    buffer = backend.acquire_host_mask(mask_layout.host_rows, words, mask_layout.placement)
    valid = None
    try:
        mask = build_host_bitmask(
            grammars,
            tree,
            vocab_size,
            out=buffer.array[:rows],
            reasoning=options.reasoning,
            return_valid=options.return_valid,
        )
        if options.return_valid:
            mask, valid = mask
        if mask is None and not always:
            backend.release_host_mask(buffer)
            return _with(None, valid, options), 0.0
        if mask is None:
            buffer.array.fill(ALL_ALLOWED)
        else:
            _arrange(buffer.array, mask_layout.blocks)
    except BaseException:
        backend.release_host_mask(buffer)
        raise
    uploading = perf_counter()
    uploaded = backend.upload(buffer, mask_layout.placement)
    return _with(uploaded, valid, options), perf_counter() - uploading


def _with(mask: Any, valid: np.ndarray | None, options: _Options) -> Any:
    return (mask, valid) if options.return_valid else mask


def _build_compact(
    grammars: Sequence[Any],
    tree: GrammarTree,
    vocab_size: int,
    backend: Backend,
    mask_layout: MaskLayout,
    words: int,
    always: bool,
    options: _Options,
) -> tuple[Any, float]:
    """The compact layout of :func:`_build_and_upload`: one pooled block holds the bits and
    the row index; only the listed rows are written."""
    max_rows = options.max_rows
    rows = tree.batch * tree.nodes
    num_rows = mask_layout.host_rows
    entries = rows if max_rows is None else max_rows
    block_rows = entries + index_words(entries, words)
    buffer = backend.acquire_host_mask(block_rows, words, mask_layout.placement)
    try:
        index, bits = compact_views(buffer.array, entries)
        host = build_host_bitmask(
            grammars,
            tree,
            vocab_size,
            out=CompactMask(index, bits, rows),
            layout="compact",
            max_rows=max_rows,
            return_valid=options.return_valid,
        )
        valid = None
        if options.return_valid:
            host, valid = host
        if host is None and not always and max_rows is None:
            backend.release_host_mask(buffer)
            return _with(None, valid, options), 0.0
        count = 0 if host is None else host.count
        size = (0 if max_rows is None else max_rows) if host is None else host.capacity
        _move_rows(index[:count], mask_layout.blocks)  # type: ignore[misc]
        index[count:size] = num_rows  # padding: a row past the logits
        mask = CompactMask(index[:size], bits[:size], num_rows, count)
    except BaseException:
        backend.release_host_mask(buffer)
        raise
    uploading = perf_counter()
    uploaded = backend.upload_compact(buffer, mask, mask_layout.placement)
    return _with(uploaded, valid, options), perf_counter() - uploading


def _check_compact(backend: Backend, mask_layout: MaskLayout) -> None:
    if not backend.supports_compact():
        raise TypeError(f"backend {backend.name!r} has no compact mask layout (layout='compact')")
    if mask_layout.collective:
        raise ValueError(
            "layout='compact' needs a placement within this process; a mask spanning several "
            "processes is dense (use layout='dense')"
        )


def _move_rows(index: np.ndarray, blocks: tuple[tuple[int, int, int], ...]) -> None:
    """Built row numbers -> rows of the host mask, block by block (see :class:`MaskLayout`)."""
    if all(src == dst for src, _count, dst in blocks) or not index.size:
        return
    starts = np.array([src for src, _count, _dst in blocks], dtype=np.int64)
    shift = np.array([dst - src for src, _count, dst in blocks], dtype=np.int64)
    block = np.searchsorted(starts, index, side="right") - 1
    index += shift[block].astype(np.int32)


def _packed_layout(
    backend: Backend, placement: Any, rows: int, vocab_size: int, capacity: int | None
) -> MaskLayout:
    """The layout of packed chains' rows: they are not split by request, so the placement
    must keep the mask whole (one device, or replicated)."""
    mask_layout = backend.mask_layout(placement, 1, rows, vocab_size, capacity)
    if mask_layout.collective or mask_layout.blocks != ((0, rows, 0),):
        raise ValueError(
            "packed chains (GrammarTree.from_packed_chains) need a placement that keeps the "
            "mask's rows together on this process (one device); shard by requests with a "
            "[batch, nodes] tree instead"
        )
    return mask_layout


def _check_capacity(row_capacity: Any, rows: int) -> int:
    if isinstance(row_capacity, bool) or not isinstance(row_capacity, Integral):
        raise TypeError(f"row_capacity must be an int, got {type(row_capacity).__name__}")
    if row_capacity < rows:
        raise ValueError(
            f"row_capacity = {row_capacity} is smaller than the mask's {rows} rows (batch * nodes)"
        )
    return int(row_capacity)


def _check_layout(layout: MaskLayout, rows: int, backend: Backend) -> None:
    """A backend's layout must cover the built rows once, in order, moving rows only forward
    (so that :func:`_arrange` can move them in place) and within the host buffer."""
    built = host = 0
    for src, count, dst in layout.blocks:
        if src != built or count < 0 or dst < src or dst < host:
            break
        built, host = src + count, dst + count
    else:
        if built == rows and host <= layout.host_rows:
            return
    raise ValueError(f"backend {backend.name!r} returned an invalid mask layout {layout}")


def _arrange(host: np.ndarray, blocks: tuple[tuple[int, int, int], ...]) -> None:
    """Move the built rows (at the start of ``host``) to their blocks, last block first (each
    moves forward, so no block overwrites rows not yet moved), and set the rest to -1."""
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


def apply_vocab_mask(logits: Any, mask: Any, *, vocab_size: int | None = None) -> Any:
    """Set the logits of disallowed tokens to ``-inf``.

    Args:
        logits: ``[rows, vocab]`` (or ``[vocab]``) floating array of any registered framework.
        mask: int32 ``[rows, words]`` bitmask of the same framework (as returned by
            :func:`build_grammar_vocab_mask`), a :class:`CompactMask` of that framework's
            arrays with ``num_rows == rows`` (only its listed rows are touched; the result is
            that of the dense mask), or ``None`` (no request has a grammar). Without
            ``vocab_size`` the mask must cover every column: ``32 * words >= vocab``.
        vocab_size: the model's real vocabulary, for logits padded past it (a mask built with
            this ``vocab_size`` covers only ``ceil(vocab_size / 32)`` words): every column at
            or past it is set to ``-inf`` in *every* row, all-allowed rows included (requests
            without a grammar, rejected draft nodes, and ``mask=None``), since such ids are
            no tokens; the columns below it are masked by the bits. Must not exceed what the
            mask covers (``32 * words``).

    Returns:
        The masked logits. numpy and torch modify ``logits`` in place and return it; JAX
        returns a new array (donate ``logits`` to the enclosing ``jax.jit`` to reuse its
        memory; ``vocab_size`` is static there). ``mask=None`` without ``vocab_size``: the
        logits unchanged.

    Raises:
        ValueError: logits wider than the mask covers without ``vocab_size`` (their extra
            columns would stay allowed: padding ids could be sampled), or a ``vocab_size``
            past the mask; shapes that do not match.
        TypeError: dtypes, frameworks or ``vocab_size`` of the wrong type.

    Does not block: on accelerators the work is queued on the logits' stream.
    """
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer))
    ):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    if mask is None and vocab_size is None:
        return logits
    backend = backend_for(logits)
    if isinstance(mask, CompactMask):
        if vocab_size is None:
            return backend.apply_compact_mask(logits, mask)
        return backend.apply_compact_mask(logits, mask, vocab_size=int(vocab_size))
    if vocab_size is None:
        return backend.apply_vocab_mask(logits, mask)
    return backend.apply_vocab_mask(logits, mask, vocab_size=int(vocab_size))
