"""The most common small builds in as few Python lines as possible: a few short chains, or a
small batch of verify trees, of plain xgrammar matchers.

:func:`build_host_bitmask` tries :func:`in_place` first for host trees without reasoning,
dense layout: one compiled call over the caller's own arrays. When it declines, chain trees
try :func:`small_chains`, which resolves the tokens and walks request by request. A batch-1
call in a serving engine starts with cold caches (the model's forward pass evicts them between
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
from portable_spec.engines.xgrammar import xgrammar_info
from portable_spec.errors import MatcherError
from portable_spec.grammars import XGRAMMAR, _kind_by_type
from portable_spec.pending import hold_matchers, release_matchers
from portable_spec.stats import note_slow
from portable_spec.tree import GrammarTree

__all__ = ["SMALL_CHAIN_BATCH", "chain_links", "host_rows", "in_place", "small_chains"]

# Up to this many chain requests take this path, each of at most jobs.INLINE_CHAIN_NODES nodes
# (the chains short enough to stay on the calling thread).
SMALL_CHAIN_BATCH = 8


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
    grammars: Any, tree: GrammarTree, vocab_size: Any, out: Any, return_valid: bool
) -> Any:
    """The most common small call in one compiled call over the caller's own host arrays
    (``tree._inplace``): a few short chains (``from_linear_chain``, ``from_packed_chains``:
    ``span_masks``) or a small batch of verify trees (``from_host``: ``tree_masks``) of plain
    xgrammar matchers already probed at the model's width, none walked by another build. The
    compiled call checks the arrays, the links, the matchers' facts and ``out``, copies the
    tokens and links, holds the matchers, walks and repairs every request on the calling
    thread (GIL released) and counts. Returns
    what :func:`portable_spec.build_host_bitmask` returns, or ``None`` whenever anything is
    unusual (nothing written, no matcher moved): the other paths then check everything and
    raise what they must.

    A call arrives with cold caches in a serving engine (the forward pass evicts them between
    steps), where every Python line and attribute read costs about a microsecond: this
    function is the few lines the common call runs besides the compiled one."""
    arrays = tree._inplace
    assert arrays is not None
    threshold = stats._threshold or -1.0
    if len(arrays) == 2:  # host chains: (tokens, the offsets as a tuple of ints, or None)
        if tree.batch > SMALL_CHAIN_BATCH or tree.nodes > jobs.INLINE_CHAIN_NODES:
            return None
        tokens, offsets = arrays
        done = compiled.span_masks(
            grammars, tokens, offsets, tree.nodes, vocab_size, out, return_valid, threshold
        )
    else:  # host trees: (next_token, next_sibling, draft)
        if tree.nodes >= jobs.SPLIT_MIN_NODES or tree.rows >= jobs.CHAIN_TABLE_PARALLEL_ROWS:
            return None
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
    grammars: Any, tree: GrammarTree, vocab_size: Any, out: Any, return_valid: bool
) -> Any:
    """A few ``from_linear_chain`` or ``from_packed_chains`` requests of plain xgrammar
    matchers already probed at the model's width, a valid ``out`` (or none),
    when :func:`in_place` could not take them (tokens staged from a device, of another dtype
    or layout, or no compiled call over them). Walks and repairs each request on the calling
    thread (no padding, the links of each chain length made once): one compiled call for the
    whole batch when the helper can call xgrammar itself, else one binding call per request.
    Returns what :func:`portable_spec.build_host_bitmask` returns, or ``None`` whenever
    anything is unusual (nothing written, no matcher moved): the general path then checks
    everything and raises what it must (also when another build walks one of the matchers)."""
    native = compiled.native
    # the tree's own fields, read once: each property or method call costs microseconds here
    batch, nodes, packed = tree.batch, tree.nodes, tree._packed
    if (
        native is None
        or not (tree._chain or packed)
        or type(grammars) is not list
        or len(grammars) != batch
        or not 0 < batch <= SMALL_CHAIN_BATCH
        or nodes > jobs.INLINE_CHAIN_NODES
        or type(vocab_size) is not int
        or vocab_size <= 0
    ):
        return None
    tokens = tree.host_chain_tokens()
    words = (vocab_size + 31) >> 5
    infos = []
    for g in grammars:
        if _kind_by_type.get(type(g)) != XGRAMMAR:
            return None
        info = xgrammar_info(g)
        if info is None or info.words != words:
            return None
        infos.append(info)
    if batch > 1 and len({id(g) for g in grammars}) != batch:
        return None
    rows = tree.rows
    mask = host_rows(out, rows, words)
    if mask is None:
        return None
    started = perf_counter()
    if tokens is None:  # staged, another dtype or layout: the tree's own int64 copy
        if packed:
            return None
        tokens = tree.resolve()[2]
    resolved = perf_counter()
    if packed:
        firsts = tree.offsets.tolist()  # type: ignore[union-attr]
        spans = tree.spans()
    elif batch == 1:
        tokens = tokens.reshape(-1)
        firsts = (0,)
        spans = [(0, nodes)]
    else:
        tokens = tokens.reshape(-1)
        firsts = range(0, rows + 1, nodes)
        spans = [(f, nodes) for f in firsts[:-1]]
    accepted = np.empty(rows, dtype=bool) if return_valid else None
    first = infos[0]
    if batch == 1:  # no comprehension, no generator: each costs microseconds with cold caches
        row, n = spans[0]
        direct = first.handle and compiled.walks_xgrammar()
        table = [(row, row, n)]
    else:
        direct = jobs.walkable(infos, words) is not None
        table = [(row, row, n) for row, n in spans]
    if direct:  # every chain walked and repaired by one call of the compiled helper
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
    else:
        if native is None:
            return None
        try:
            token, held = hold_matchers(grammars)
        except ValueError:  # another build walks one of them: the general build says which
            return None
        try:
            checked, rejected, walks = _walk_each(
                grammars, infos, mask, tokens, firsts, spans, vocab_size, accepted
            )
        finally:
            release_matchers(token, held)
    return jobs.settle(tree, (started, resolved), mask, accepted, walks, checked, rejected)


def _walk_each(
    grammars: list[Any],
    infos: list[Any],
    mask: np.ndarray,
    tokens: np.ndarray,
    firsts: Any,
    spans: list[tuple[int, int]],
    vocab_size: int,
    accepted: np.ndarray | None,
) -> tuple[int, int, list[tuple[int, float]]]:
    """Each request walked through xgrammar's Python binding and repaired by the compiled
    helper. Returns ``(checked, rejected, walks)``."""
    repair = compiled.row_repairer(True)
    walks = []
    checked = rejected = 0
    began = perf_counter()
    for b, matcher in enumerate(grammars):
        info = infos[b]
        row, n = spans[b]
        block = mask[row : row + n]
        first = firsts[b]
        dt = tokens[first : first + n]
        nt, ns = chain_links(n)
        limit = min(vocab_size, info.vocab_size)
        try:
            live = 0
            if not matcher.is_terminated():
                matcher.traverse_draft_tree(nt, ns, dt, block)
                live = 1
            if accepted is None:
                _, c, r = repair(block, nt, ns, dt, limit, info.stop_ids, live)
            else:
                flags = accepted[row : row + n]
                _, c, r = repair(block, nt, ns, dt, limit, info.stop_ids, live, flags)
        except BaseException as exc:
            raise MatcherError(b, exc) from exc
        checked += c
        rejected += r
        ended = perf_counter()
        walks.append((b, ended - began))
        began = ended
    return checked, rejected, walks
