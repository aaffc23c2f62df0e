"""The most common small builds in as few Python lines as possible: chains, or a batch of
verify trees, of plain xgrammar matchers, small enough for one thread.

Two rows of the route table (:mod:`portable_spec.builder.routes`, which says when): the
caller's own host arrays in one compiled call (:func:`in_place`), and chains whose tokens must
be resolved first (:func:`small_chains`). A batch-1 call in a serving engine starts with cold
caches (the model's forward pass evicts them between
steps), so what it costs follows the number of Python lines and numpy calls it runs: these
paths check only what they must (and give up on anything unusual, ``None``: the general path
then checks everything and raises what it must), and walk and repair on the calling thread
through the compiled helper (xgrammar's C++ traversal reached through tvm-ffi's C ABI, GIL
released); where the helper cannot call xgrammar itself, request by request through
xgrammar's Python binding.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec import stats
from portable_spec.builder import jobs
from portable_spec.errors import MatcherError
from portable_spec.stats import note_slow
from portable_spec.tree import GrammarTree

__all__ = ["chain_links", "host_rows", "in_place", "small_chains"]


_links: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def chain_links(nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(next_token, next_sibling)`` of one chain of ``nodes`` nodes: int64 ``[nodes]`` each,
    node ``i``'s child ``i + 1``, no siblings; made once per length and shared (never modify
    them: they stay writable only because xgrammar reads them through DLPack)."""
    links = _links.get(nodes)
    if links is None:
        next_token = np.arange(1, nodes + 1, dtype=np.int64)
        next_token[-1] = -1
        links = _links[nodes] = (next_token, np.full(nodes, -1, dtype=np.int64))
    return links


def host_rows(out: Any, rows: int, words: int) -> np.ndarray | None:
    """The int32 ``[rows, words]`` mask a small build writes: ``out`` itself when it is a
    C-contiguous writable numpy array of that shape and dtype, a new array when ``out`` is
    None, else ``None`` (the general path then checks ``out`` and says what is wrong)."""
    if out is None:
        return np.empty((rows, words), dtype=np.int32)
    if (
        type(out) is np.ndarray
        and out.dtype == np.int32
        and out.shape == (rows, words)
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        return out
    return None


def in_place(
    grammars: Any,
    arrays: tuple[Any, ...],
    nodes: int,
    vocab_size: Any,
    out: Any,
    return_valid: bool,
) -> Any:
    """One compiled call over the caller's own host arrays (``arrays``:
    :meth:`GrammarTree.host_inputs`; ``nodes`` per request): chains (``from_linear_chain``,
    ``from_packed_chains``: ``span_masks``) or verify trees (``from_host``: ``tree_masks``) of
    plain xgrammar matchers already probed at the model's width, none walked by another build.
    The compiled call checks the arrays, the links, the matchers' facts and ``out``, copies the
    tokens and links, holds the matchers, walks and repairs every request on the calling thread
    (GIL released) and counts. Returns what :func:`portable_spec.build_host_bitmask` returns, or
    ``None`` whenever anything is unusual (nothing written, no matcher moved): the route table
    then goes on to its next row.

    A call arrives with cold caches in a serving engine (the forward pass evicts them between
    steps), where every Python line and attribute read costs about a microsecond: this function
    is the few lines the common call runs besides the compiled one.
    """
    threshold = stats._threshold or -1.0
    if len(arrays) == 2:  # host chains: (tokens, the offsets as a tuple of ints, or None)
        tokens, offsets = arrays
        done = compiled.span_masks(
            grammars, tokens, offsets, nodes, vocab_size, out, return_valid, threshold
        )
    else:  # host trees: (next_token, next_sibling, draft)
        next_token, next_sibling, draft = arrays
        done = compiled.tree_masks(
            grammars, next_token, next_sibling, draft, vocab_size, out, return_valid, threshold
        )
    if done is None:
        return None
    mask, valid, failed, message, slow = done
    if failed >= 0:
        raise MatcherError(failed, RuntimeError(message))
    if slow:
        note_slow(slow)
    return (mask, valid) if return_valid else mask


def small_chains(
    grammars: Any,
    tree: GrammarTree,
    infos: list[Any],
    vocab_size: int,
    out: Any,
    return_valid: bool,
) -> Any:
    """Chains (``from_linear_chain``, ``from_packed_chains``) of plain xgrammar matchers the
    compiled helper walks itself (``infos``: their facts, probed at the model's width), a
    valid ``out`` (or none), when :func:`in_place` could not take them (tokens staged from a
    device, of another dtype or layout). Walks and repairs every chain in one compiled call
    on the calling thread (no padding), which holds the matchers while it walks. Returns what
    :func:`portable_spec.build_host_bitmask` returns, or ``None`` whenever anything is
    unusual (nothing written, no matcher moved): the route table then goes on to its next row
    (also when another build walks one of the matchers)."""
    batch, nodes, rows = tree.batch, tree.nodes, tree.rows
    words = (vocab_size + 31) >> 5
    if batch > 1 and (
        len({id(g) for g in grammars}) != batch or jobs.walkable(infos, words) is None
    ):
        return None
    first = infos[0]
    if batch == 1 and not (first.handle and compiled.walks_xgrammar()):
        return None
    mask = host_rows(out, rows, words)
    if mask is None:
        return None
    tokens = tree.host_chain_tokens()
    packed = tree.is_packed
    started = perf_counter()
    if tokens is None:  # staged, another dtype or layout: the tree's own int64 copy
        if packed:
            return None
        tokens = tree.resolve()[2]
    resolved = perf_counter()
    if packed:
        spans = tree.spans()
    else:
        tokens = tokens.reshape(-1)
        spans = [(0, nodes)] if batch == 1 else [(f, nodes) for f in range(0, rows, nodes)]
    accepted = np.empty(rows, dtype=bool) if return_valid else None
    table = [(row, row, n) for row, n in spans]
    seconds = np.empty(batch, dtype=np.float64) if batch > 1 else None
    began = perf_counter()
    done = compiled.walk_chains(
        mask, tokens, table, grammars, vocab_size, first.stop_ids, 0, accepted, seconds
    )
    if done is None:  # another build walks one of the matchers: the general build says
        return None
    checked, rejected, failed, message = done
    if failed >= 0:
        raise MatcherError(failed, RuntimeError(message))
    walks = [(0, perf_counter() - began)] if seconds is None else enumerate(seconds.tolist())
    return jobs.settle(tree, (started, resolved), mask, accepted, walks, checked, rejected)
