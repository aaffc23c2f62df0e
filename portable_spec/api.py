"""Device-facing entry points: build and upload a mask, and apply it to logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec.backend import Backend, MaskLayout
from portable_spec.builder import build_host_bitmask
from portable_spec.delivery import (
    compact_rows,
    deliver,
    plan,
    resolve_target,
    settle_compact,
    settle_dense,
)
from portable_spec.hostbuffers import HostBuffer
from portable_spec.masks import (
    CompactMask,
    check_flag,
    check_layout,
    check_vocab_size,
    compact_views,
    words_for,
)
from portable_spec.pending import start_pending
from portable_spec.pool import submit
from portable_spec.registry import backend_for
from portable_spec.stats import record_upload
from portable_spec.tree import GrammarTree

__all__ = ["apply_vocab_mask", "build_grammar_vocab_mask"]


def build_grammar_vocab_mask(
    matchers: Sequence[Any],
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
        matchers: one entry per request of this process's tree, as for
            :func:`build_host_bitmask`.
        tree: the batch's verify trees; its backend (the framework of the arrays it was
            staged from) receives the mask unless ``device`` names another framework.
        vocab_size: the model's vocabulary size (the logits' width), at most
            :data:`portable_spec.MAX_VOCAB_SIZE`.
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
        return_valid: also return which nodes the matchers accept: a host (numpy) bool
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
        TypeError, ValueError: bad matchers, tree, vocabulary size, ``row_capacity``, layout or
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
    check_flag("return_valid", return_valid)
    backend, placement = resolve_target(device, default=(tree.backend, tree.device))
    words = words_for(check_vocab_size(vocab_size))
    max_rows = check_layout(layout, max_rows)
    packed_rows = tree.rows if tree.is_packed else None
    mask_layout = plan(
        backend,
        placement,
        tree.batch,
        tree.nodes,
        vocab_size,
        row_capacity,
        packed_rows=packed_rows,
    )
    if layout == "compact" and tree.is_packed:
        raise ValueError(
            "packed chains (GrammarTree.from_packed_chains) build dense masks only; "
            "use layout='dense'"
        )
    if layout == "compact":
        _check_compact(backend, mask_layout)
        if reasoning is not None:
            raise ValueError("reasoning= builds dense masks only; use layout='dense'")
    request = _MaskRequest(
        grammars=matchers,
        tree=tree,
        vocab_size=vocab_size,
        backend=backend,
        mask_layout=mask_layout,
        words=words,
        always=row_capacity is not None or mask_layout.collective,
        layout=layout,
        max_rows=max_rows,
        reasoning=reasoning,
        return_valid=return_valid,
    )
    if wait:
        mask, upload_seconds = _build_and_upload(request)
        record_upload(upload_seconds, perf_counter() - started)
        return mask
    if isinstance(matchers, (str, bytes)) or not isinstance(matchers, Sequence):
        raise TypeError(
            f"matchers must be a sequence with one entry per request, got {type(matchers).__name__}"
        )

    def build() -> Any:
        mask, upload_seconds = _build_and_upload(request)
        record_upload(upload_seconds, 0.0)
        return mask

    context = backend.capture_context(mask_layout.placement)
    handle = start_pending(list(matchers), build, context, submit)
    record_upload(0.0, perf_counter() - started)
    return handle


@dataclass(slots=True)
class _MaskRequest:
    """One checked call of :func:`build_grammar_vocab_mask`: what to build and where it goes.

    ``always``: a mask comes back even when no request has a grammar (a fixed row capacity,
    or a placement spanning processes)."""

    grammars: Sequence[Any]
    tree: GrammarTree
    vocab_size: int
    backend: Backend
    mask_layout: MaskLayout
    words: int
    always: bool
    layout: str
    max_rows: int | None
    reasoning: Any
    return_valid: bool


def _build_and_upload(request: _MaskRequest) -> tuple[Any, float]:
    """Build into a pooled host buffer and start the upload; ``(result, upload seconds)``,
    the result being the mask, or ``(mask, valid)`` with ``return_valid``."""
    valid = None
    tree = request.tree
    mask_layout = request.mask_layout
    if request.layout == "compact":
        entries = tree.rows if request.max_rows is None else request.max_rows

        def fill_compact(block: np.ndarray) -> CompactMask | None:
            nonlocal valid
            index, bits = compact_views(block, entries)
            host = build_host_bitmask(
                request.grammars,
                tree,
                request.vocab_size,
                out=CompactMask(index, bits, tree.rows),
                layout="compact",
                max_rows=request.max_rows,
                return_valid=request.return_valid,
            )
            if request.return_valid:
                host, valid = host
            return settle_compact(
                host,
                index,
                bits,
                mask_layout,
                max_rows=request.max_rows,
                always=request.always,
            )

        def send(buffer: HostBuffer, mask: CompactMask) -> Any:
            return request.backend.upload_compact(buffer, mask, mask_layout.placement)

        rows = compact_rows(entries, request.words)
        mask, seconds = deliver(
            request.backend, mask_layout, request.words, fill_compact, rows=rows, send=send
        )
    else:

        def fill_dense(host: np.ndarray) -> np.ndarray | None:
            nonlocal valid
            built = build_host_bitmask(
                request.grammars,
                tree,
                request.vocab_size,
                out=host[: tree.rows],
                reasoning=request.reasoning,
                return_valid=request.return_valid,
            )
            if request.return_valid:
                built, valid = built
            return settle_dense(host, mask_layout, built is not None, request.always)

        mask, seconds = deliver(request.backend, mask_layout, request.words, fill_dense)
    return ((mask, valid) if request.return_valid else mask), seconds


def _check_compact(backend: Backend, mask_layout: MaskLayout) -> None:
    if not backend.supports_compact():
        raise TypeError(f"backend {backend.name!r} has no compact mask layout (layout='compact')")
    if mask_layout.collective:
        raise ValueError(
            "layout='compact' needs a placement within this process; a mask spanning several "
            "processes is dense (use layout='dense')"
        )


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
