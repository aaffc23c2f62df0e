"""Device-facing entry points: build and upload a mask, and apply it to logits."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec.backend import Backend, MaskLayout
from portable_spec.builder import ALL_ALLOWED, build_host_bitmask, check_vocab_size
from portable_spec.grammars import words_for
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
            requests.
        reasoning: a :class:`portable_spec.Reasoning` for reasoning models, as for
            :func:`build_host_bitmask`.
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
        ``return_valid=True``: ``(mask, valid)``.

    Raises:
        TypeError, ValueError: bad grammars, tree, vocabulary size, ``row_capacity`` or
            placement (for example a capacity the placement's row shards cannot divide);
            raised before any matcher moves.
        MatcherError: a matcher raised during its walk (every matcher is back in its state).

    Blocks while the host mask is built (after waiting for the tree's staged copy); the
    upload itself is started without blocking. The host buffer comes from the backend's pool
    (pinned where the platform has pinning) and is reused only after the upload finished and
    no returned array aliases it.
    """
    started = perf_counter()
    if not isinstance(tree, GrammarTree):
        raise TypeError(f"tree must be a portable_spec.GrammarTree, got {type(tree).__name__}")
    backend, placement = _target(tree, device)
    words = words_for(check_vocab_size(vocab_size))
    rows = tree.batch * tree.nodes
    capacity = None if row_capacity is None else _check_capacity(row_capacity, rows)
    layout = backend.mask_layout(placement, tree.batch, tree.nodes, vocab_size, capacity)
    _check_layout(layout, rows, backend)
    always = capacity is not None or layout.collective
    buffer = backend.acquire_host_mask(layout.host_rows, words, layout.placement)
    valid = None
    try:
        mask = build_host_bitmask(
            grammars,
            tree,
            vocab_size,
            out=buffer.array[:rows],
            reasoning=reasoning,
            return_valid=return_valid,
        )
        if return_valid:
            mask, valid = mask
        if mask is None and not always:
            backend.release_host_mask(buffer)
            return (None, valid) if return_valid else None
        if mask is None:
            buffer.array.fill(ALL_ALLOWED)
        else:
            _arrange(buffer.array, layout.blocks)
    except BaseException:
        backend.release_host_mask(buffer)
        raise
    uploading = perf_counter()
    uploaded = backend.upload(buffer, layout.placement)
    done = perf_counter()
    record_upload(done - uploading, done - started)
    return (uploaded, valid) if return_valid else uploaded


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


def apply_vocab_mask(logits: Any, mask: Any) -> Any:
    """Set the logits of disallowed tokens to ``-inf``.

    Args:
        logits: ``[rows, vocab]`` (or ``[vocab]``) floating array of any registered framework.
        mask: int32 ``[rows, ceil(vocab / 32)]`` bitmask of the same framework (as returned by
            :func:`build_grammar_vocab_mask`), or ``None`` (logits returned unchanged).

    Returns:
        The masked logits. numpy and torch modify ``logits`` in place and return it; JAX
        returns a new array (donate ``logits`` to the enclosing ``jax.jit`` to reuse its
        memory). Columns past ``32 * mask.shape[-1]`` are left unchanged.

    Does not block: on accelerators the work is queued on the logits' stream.
    """
    if mask is None:
        return logits
    return backend_for(logits).apply_vocab_mask(logits, mask)
