"""Device-facing entry points: build and upload a mask, and apply it to logits."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from time import perf_counter
from typing import Any

from portable_spec.backend import Backend
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
) -> Any:
    """Build the batch's grammar bitmask on the host and start its upload to ``device``.

    Args:
        grammars: one entry per request, as for :func:`build_host_bitmask`.
        tree: the batch's verify trees; its backend (the framework of the arrays it was
            staged from) receives the mask unless ``device`` names another framework.
        vocab_size: the model's vocabulary size (the logits' width).
        device: where the mask goes: a framework device or placement object (a
            ``torch.device``, a ``jax.Device`` or ``jax.sharding.Sharding``), a device string
            understood by the tree's framework, or ``None`` for where the tree came from (the
            device of its arrays; a batch-sharded JAX tree gives a row-sharded mask).
        row_capacity: pad the mask to this many rows (all-allowed padding), so that engines
            compiled for a fixed batch capacity see one shape whatever the batch (no
            recompilation of the sampler). Must be at least ``batch * nodes``.

    Returns:
        ``None`` when no request has a grammar (the engine should then drop any mask it kept
        from an earlier step), else the backend's int32 ``[rows, ceil(vocab / 32)]`` array,
        ``rows`` being ``row_capacity`` or ``batch * nodes``, with the rows of
        :func:`build_host_bitmask`.

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
    capacity = rows if row_capacity is None else _check_capacity(row_capacity, rows)
    buffer = backend.acquire_host_mask(capacity, words, placement)
    try:
        mask = build_host_bitmask(grammars, tree, vocab_size, out=buffer.array[:rows])
    except BaseException:
        backend.release_host_mask(buffer)
        raise
    if mask is None:
        backend.release_host_mask(buffer)
        return None
    if capacity > rows:
        buffer.array[rows:] = ALL_ALLOWED
    uploading = perf_counter()
    uploaded = backend.upload(buffer, placement)
    done = perf_counter()
    record_upload(done - uploading, done - started)
    return uploaded


def _check_capacity(row_capacity: Any, rows: int) -> int:
    if isinstance(row_capacity, bool) or not isinstance(row_capacity, Integral):
        raise TypeError(f"row_capacity must be an int, got {type(row_capacity).__name__}")
    if row_capacity < rows:
        raise ValueError(
            f"row_capacity = {row_capacity} is smaller than the mask's {rows} rows (batch * nodes)"
        )
    return int(row_capacity)


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
