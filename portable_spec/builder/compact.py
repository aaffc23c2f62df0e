"""The host build in the compact layout: only the rows that constrain something are written.

The dense build writes every row of ``[batch * nodes, words]``: the grammar's rows where xgrammar
(or a Python walk) filled them, and ``-1`` into every other row, which is most of them when
drafts leave the grammar early. The compact build writes only the ``K`` rows of accepted,
non-terminated nodes, back to back and in row order, plus their row indices
(:class:`portable_spec.CompactMask`); no all-allowed row is ever written.

How, per request, on the library's thread pool:

1. walk the request into a scratch block of ``[nodes, width]`` rows taken from a free list
   (reused across builds, so no page faults and, at typical sizes, cache-resident);
2. decide which nodes keep their row from node indices alone (the same rule and, with the
   compiled helper, the same GIL-free code as the dense build's row repair, which here reports
   the kept nodes instead of writing ``-1`` into the others);
3. *commit*: the request's rows go to the output right after those of the requests before it.
   Requests finish out of order; a request whose predecessors are still walking parks its
   scratch, and whichever thread completes the prefix assigns the offsets and copies the
   parked rows (a ``memcpy`` per kept row, GIL released with the compiled helper).

So each kept row is written by the walk (into a hot scratch) and copied once; nothing else is
written. Requests split over threads (small batches of big trees) walk into a block of their
own and commit after the walks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.builder import (
    _PYTHON_WALKS,
    PARALLEL_MIN_NODES,
    _check_depth,
    _plan_splits,
    _subtree_job,
    _walk_requests,
    _xgrammar_job,
    account,
    run_jobs,
)
from portable_spec.engines.base import MatcherInfo
from portable_spec.engines.llguidance import fill_llguidance_chains
from portable_spec.engines.xgrammar import walk_xgrammar
from portable_spec.errors import MatcherError
from portable_spec.grammars import LLGUIDANCE, NONE, OUTLINES, words_for
from portable_spec.masks import CompactMask, compact_views, index_words
from portable_spec.pool import get_num_threads
from portable_spec.split import Split
from portable_spec.tree import GrammarTree

__all__ = ["build_compact_bitmask", "check_compact_out", "keep_rows", "take_rows"]


# -- the two index helpers (compiled, or numpy/Python) ----------------------------------------
def keep_rows(
    rows: np.ndarray,
    links: tuple[np.ndarray, np.ndarray, np.ndarray],
    limit: int,
    stop_ids: np.ndarray,
    root_state: int,
) -> tuple[np.ndarray, int, int]:
    """The nodes of one request that keep their row, in ascending order, and the request's
    ``(checked, refused)`` draft-node counts.

    ``rows`` (int32 ``[nodes, width]``) holds what the walk wrote; only the rows of kept nodes'
    parents are read. A node keeps its row iff every node on its root path has its token in
    ``[0, limit)``, not a stop token, and its bit set in its parent's row, and the matcher was
    live at the root (``root_state``: 1 live, 0 terminated). Same rule and counts as the dense
    build's row repair (``_native.repair_rows``); nothing is written.
    """
    native = compiled.native
    if native is not None:
        kept = np.empty(rows.shape[0], dtype=np.int32)
        count, checked, refused = native.keep_rows(rows, *links, limit, stop_ids, root_state, kept)
        return kept[:count], checked, refused
    return _keep_rows_python(rows, links, limit, frozenset(stop_ids.tolist()), root_state)


def _keep_rows_python(
    rows: np.ndarray,
    links: tuple[np.ndarray, np.ndarray, np.ndarray],
    limit: int,
    stops: frozenset[int],
    root_state: int,
) -> tuple[np.ndarray, int, int]:
    if not root_state:
        return np.empty(0, dtype=np.int32), 0, 0
    first, following, token = (a.tolist() for a in links)
    nodes = len(first)
    keep = [False] * nodes
    keep[0] = True
    queue = [0]
    head = checked = refused = 0
    while head < len(queue):
        parent = queue[head]
        head += 1
        row = rows[parent]
        child = first[parent]
        while child != -1:
            t = token[child]
            checked += 1
            if not (0 <= t < limit and (int(row[t >> 5]) >> (t & 31)) & 1):
                refused += 1
            elif t not in stops and not keep[child]:
                keep[child] = True
                queue.append(child)
            child = following[child]
    return np.array(sorted(queue), dtype=np.int32), checked, refused


def take_rows(
    source: np.ndarray, index: np.ndarray, dest: np.ndarray, numbers: np.ndarray, base: int
) -> None:
    """``dest[i] = source[index[i]]`` (int32 rows, words of ``dest`` past the source's width
    set to 0) and ``numbers[i] = index[i] + base``. ``dest`` is C-contiguous
    ``[len(index), words]``, ``index`` and ``numbers`` int32 ``[len(index)]``."""
    native = compiled.native
    if native is not None:
        native.take_rows(source, index, dest, numbers, base)
        return
    width = source.shape[1]
    if width == dest.shape[1]:
        np.take(source, index, axis=0, out=dest, mode="clip")
    else:
        dest[:, :width] = source[index]
        dest[:, width:] = 0
    np.add(index, base, out=numbers, casting="unsafe")


# -- scratch blocks ----------------------------------------------------------------------------
class _ScratchBlocks:
    """Free lists of int32 ``[nodes, width]`` blocks, kept across builds (bounded)."""

    MAX_BYTES = 256 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, int], list[np.ndarray]] = {}
        self._bytes = 0

    def take(self, nodes: int, width: int) -> np.ndarray:
        with self._lock:
            free = self._free.get((nodes, width))
            if free:
                block = free.pop()
                self._bytes -= block.nbytes
                return block
        return np.empty((nodes, width), dtype=np.int32)

    def give(self, block: np.ndarray) -> None:
        with self._lock:
            if self._bytes + block.nbytes > self.MAX_BYTES:
                self._free.clear()
                self._bytes = 0
            self._free.setdefault(block.shape, []).append(block)  # type: ignore[arg-type]
            self._bytes += block.nbytes


_scratch = _ScratchBlocks()


class _Sink:
    """Where requests commit their kept rows, in request order, whatever order they finish in.

    ``order``: the requests that will commit, ascending. A commit parks the request's rows;
    every request whose predecessors have all committed gets the next offset, and its rows are
    copied there (by the thread that completed the prefix, outside the lock).
    """

    def __init__(
        self, bits: np.ndarray, rows: np.ndarray, order: list[int], nodes: int, capacity: int
    ) -> None:
        self.bits, self.rows = bits, rows
        self.order = order
        self.nodes = nodes
        self.capacity = capacity
        self._lock = threading.Lock()
        self._parked: dict[int, tuple[np.ndarray, np.ndarray, bool]] = {}
        self._next = 0
        self.count = 0  # kept rows committed so far (may exceed the capacity)

    def scratch(self, width: int) -> np.ndarray:
        """A ``[nodes, width]`` block to walk into (returned to the free list on commit)."""
        return _scratch.take(self.nodes, width)

    def commit(self, b: int, source: np.ndarray, kept: np.ndarray, recycle: bool = True) -> None:
        """Request ``b`` keeps ``source[kept]`` (``kept`` ascending node indices)."""
        ready = []
        with self._lock:
            self._parked[b] = (source, kept, recycle)
            order = self.order
            while self._next < len(order) and order[self._next] in self._parked:
                request = order[self._next]
                src, which, back = self._parked.pop(request)
                ready.append((request, src, which, back, self.count))
                self.count += len(which)
                self._next += 1
        for request, src, which, back, offset in ready:
            end = offset + len(which)
            if end <= self.capacity and len(which):
                rows = self.rows[offset:end]
                take_rows(src, which, self.bits[offset:end], rows, request * self.nodes)
            if back:
                _scratch.give(src)

    def finish(self) -> int:
        """The number of kept rows; every request must have committed."""
        assert self._next == len(self.order), "a request did not commit its rows"
        return self.count


# -- the jobs ------------------------------------------------------------------------------------
def _xgrammar_compact_job(
    matcher: Any,
    links: tuple[np.ndarray, np.ndarray, np.ndarray],
    info: MatcherInfo,
    limit: int,
    sink: _Sink,
    b: int,
    counts: np.ndarray,
) -> None:
    """Walk one request with xgrammar's C++ traversal into a scratch block, decide its kept
    rows, commit them."""
    block = sink.scratch(info.words)
    live = walk_xgrammar(matcher, *links, block)
    kept, counts[0], counts[1] = keep_rows(block, links, limit, info.stop_ids, int(live))
    sink.commit(b, block, kept)


def _walk_compact_job(
    walk: Callable[..., tuple[list[bool], int, int]],
    matcher: Any,
    lists: tuple[list[int], list[int], list[int]],
    info: MatcherInfo,
    limit: int,
    sink: _Sink,
    b: int,
    counts: np.ndarray,
) -> None:
    """Walk one request with a Python walk (protocol matchers, llguidance trees, outlines-core
    guides) into a scratch block; its filled rows are the kept ones."""
    block = sink.scratch(info.words)
    filled, counts[0], counts[1] = walk(matcher, *lists, block, limit)
    kept = np.flatnonzero(filled).astype(np.int32)
    if info.vocab_size % 32 and len(kept):
        # a foreign matcher may leave bits past its vocabulary set; the contract says 0
        block[kept, info.words - 1] &= np.int32((1 << (info.vocab_size % 32)) - 1)
    sink.commit(b, block, kept)


def _llguidance_chains_compact_job(
    group: dict[int, Any],
    width: int,
    draft: np.ndarray,
    vocab_size: int,
    sink: _Sink,
    counts: np.ndarray,
) -> None:
    """Fill a group of llguidance chains (one executor call) into a block of their own, then
    commit each request's live prefix. A matcher found broken is reported by its request."""
    requests = list(group)
    nodes = draft.shape[1]
    block = np.empty((len(requests) * nodes, width), dtype=np.int32)
    local = {k: group[b] for k, b in enumerate(requests)}
    local_counts = np.zeros((len(requests), 2), dtype=np.int64)
    try:
        alive = fill_llguidance_chains(
            local, width, draft[requests], block, vocab_size, local_counts, get_num_threads()
        )
    except BaseException as exc:
        for b, matcher in group.items():
            if matcher.is_error():
                raise MatcherError(b, RuntimeError(matcher.get_error())) from exc
        raise MatcherError(requests[0], exc) from exc
    counts[requests] = local_counts
    for k, b in enumerate(requests):
        rows = block[k * nodes : (k + 1) * nodes]
        sink.commit(b, rows, np.arange(int(alive[k]), dtype=np.int32), recycle=False)


def _make_compact_jobs(
    grammars: Sequence[Any],
    kinds: list[int],
    infos: list[MatcherInfo | None],
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
    sink: _Sink,
    root_ok: np.ndarray,
    counts: np.ndarray,
    splits: dict[int, tuple[Split, list[Any]]],
    split_blocks: dict[int, np.ndarray],
    vocab_size: int,
    chains: bool,
) -> tuple[list[Callable[[], None]], list[int]]:
    """The compact counterpart of ``builder._make_jobs``: one job per request (several for a
    split request), one for all Python walks, one per llguidance width for chains."""
    next_token, next_sibling, draft = arrays
    nodes = next_token.shape[1]
    jobs: list[Callable[[], None]] = []
    owners: list[int] = []
    walks: list[tuple[int, Callable[[], None]]] = []
    llguidance = [b for b, kind in enumerate(kinds) if kind == LLGUIDANCE]
    if chains and llguidance:
        for width in sorted({infos[b].words for b in llguidance}):  # type: ignore[union-attr]
            group = {b: grammars[b] for b in llguidance if infos[b].words == width}  # type: ignore[union-attr]
            job = partial(_llguidance_chains_compact_job, group, width, draft, vocab_size)
            jobs.append(partial(job, sink, counts))
            owners.append(next(iter(group)))
    for b, kind in enumerate(kinds):
        info: MatcherInfo = infos[b]  # type: ignore[assignment]
        if kind == NONE or (kind == LLGUIDANCE and chains):
            continue
        limit = min(vocab_size, info.vocab_size)
        if kind in _PYTHON_WALKS:
            lists = (next_token[b].tolist(), next_sibling[b].tolist(), draft[b].tolist())
            if kind == OUTLINES:
                _check_depth(b, lists[0], lists[1], info)
            job = partial(_walk_compact_job, _PYTHON_WALKS[kind], grammars[b], lists, info)
            walks.append((b, partial(job, limit, sink, b, counts[b])))
            continue
        if b not in splits:
            links = (next_token[b], next_sibling[b], draft[b])
            job = partial(_xgrammar_compact_job, grammars[b], links, info, limit, sink, b)
            jobs.append(partial(job, counts[b]))
        else:
            plan, forks = splits[b]
            block = split_blocks[b] = np.empty((nodes, info.words), dtype=np.int32)
            for sub, fork in zip(plan.subtrees, forks, strict=True):
                jobs.append(partial(_subtree_job, fork, sub, block, info, limit))
                owners.append(b)
            links = (plan.next_token, plan.next_sibling, draft[b])
            rows = plan.main_rows
            jobs.append(partial(_xgrammar_job, grammars[b], links, block, info, root_ok, b, rows))
        owners.append(b)
    if walks:
        jobs.append(partial(_walk_requests, walks))
        owners.append(walks[0][0])
    return jobs, owners


# -- the build -----------------------------------------------------------------------------------
def check_compact_out(out: Any, capacity: int, words: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``(rows, bits)`` arrays of an ``out=`` CompactMask, checked: numpy int32, ``rows``
    ``[C]`` and ``bits`` C-contiguous ``[C, words]`` with ``C >= capacity``, writable."""
    if not isinstance(out, CompactMask):
        raise TypeError(
            f"out must be a portable_spec.CompactMask of numpy arrays for layout='compact', "
            f"got {type(out).__name__}"
        )
    rows, bits = out.rows, out.bits
    if not isinstance(rows, np.ndarray) or not isinstance(bits, np.ndarray):
        raise TypeError("out must hold numpy arrays (the host build writes into them)")
    if bits.shape[1] != words:
        raise ValueError(f"out.bits must have {words} words per row, got {bits.shape[1]}")
    if out.capacity < capacity:
        raise ValueError(
            f"out has room for {out.capacity} rows; this build may list up to {capacity}"
        )
    if not bits.flags.c_contiguous or not rows.flags.c_contiguous:
        raise ValueError("out.rows and out.bits must be C-contiguous")
    if not bits.flags.writeable or not rows.flags.writeable:
        raise ValueError("out is read-only")
    return rows, bits


def build_compact_bitmask(
    grammars: Sequence[Any],
    tree: GrammarTree,
    vocab_size: int,
    kinds: list[int],
    infos: list[MatcherInfo | None],
    constrained: list[int],
    *,
    out: CompactMask | None,
    max_rows: int | None,
    return_valid: bool = False,
) -> Any:
    """The compact layout of :func:`portable_spec.build_host_bitmask` (called by it after the
    grammars were classified and at least one request is constrained).

    Returns a host :class:`CompactMask` (views of ``out``'s arrays if given): ``count`` real
    entries (``rows`` ascending, ``b * nodes + j``), then, with ``max_rows``, padding up to
    ``max_rows`` entries (row index ``batch * nodes``, bits not written). With
    ``return_valid``, ``(mask, valid)`` as for the dense layout.

    Raises:
        ValueError: ``out`` too small or malformed (before any matcher moves); more than
            ``max_rows`` rows listed (after the walks; every matcher is back in its state).
    """
    words = words_for(vocab_size)
    batch, nodes = tree.batch, tree.nodes
    num_rows = batch * nodes
    bound = len(constrained) * nodes  # no build lists more
    capacity = bound if max_rows is None else max_rows
    if out is not None:
        rows_out, bits_out = check_compact_out(out, capacity, words)
    else:
        block = np.empty((capacity + index_words(capacity, words), words), dtype=np.int32)
        rows_out, bits_out = compact_views(block, capacity)
    started = perf_counter()
    next_token, next_sibling, draft = tree.resolve()
    resolved = perf_counter()
    tree.validate()

    root_ok = np.ones(batch, dtype=bool)
    counts = np.zeros((batch, 2), dtype=np.int64)
    sink = _Sink(bits_out, rows_out, constrained, nodes, min(capacity, bits_out.shape[0]))
    splits = _plan_splits(kinds, constrained, tree, next_token, next_sibling, draft, grammars)
    split_blocks: dict[int, np.ndarray] = {}
    jobs, owners = _make_compact_jobs(
        grammars,
        kinds,
        infos,
        (next_token, next_sibling, draft),
        sink,
        root_ok,
        counts,
        splits,
        split_blocks,
        vocab_size,
        tree.is_chain,
    )
    parallel = bool(splits) or len(constrained) * nodes >= PARALLEL_MIN_NODES
    seconds = run_jobs(jobs, owners, parallel)
    for b in sorted(splits):  # walked in pieces: decide and commit now
        info: MatcherInfo = infos[b]  # type: ignore[assignment]
        links = (next_token[b], next_sibling[b], draft[b])
        limit = min(vocab_size, info.vocab_size)
        block = split_blocks[b]
        kept, counts[b, 0], counts[b, 1] = keep_rows(
            block, links, limit, info.stop_ids, int(root_ok[b])
        )
        sink.commit(b, block, kept, recycle=False)
    count = sink.finish()
    account(constrained, owners, seconds, counts, count, (started, resolved))
    if max_rows is not None and count > max_rows:
        raise ValueError(
            f"the build lists {count} rows (accepted, non-terminated nodes of constrained "
            f"requests) but max_rows = {max_rows}; raise max_rows (at most batch * nodes = "
            f"{num_rows} can be needed). Every matcher is back in its state."
        )
    valid = None
    if return_valid:
        valid = _valid_nodes(rows_out[:count], bits_out[:count], tree, draft, kinds, vocab_size)
    if max_rows is None:
        mask = CompactMask(rows_out[:count], bits_out[:count], num_rows, count)
    else:
        rows_out[count:max_rows] = num_rows
        mask = CompactMask(rows_out[:max_rows], bits_out[:max_rows], num_rows, count)
    return mask if valid is None else (mask, valid)


def _valid_nodes(
    listed: np.ndarray,
    bits: np.ndarray,
    tree: GrammarTree,
    draft: np.ndarray,
    kinds: list[int],
    vocab_size: int,
) -> np.ndarray:
    """bool ``[batch, nodes]``: the accepted nodes (the dense build's ``return_valid`` rule),
    read off the compact entries: a node is accepted when it is a root, or its parent is
    listed and the parent's row allows its token; unconstrained requests accept every node a
    link reaches."""
    batch, nodes = tree.batch, tree.nodes
    total = batch * nodes
    topology = tree.topology()
    parent = topology.parent
    entry = np.full(total + 1, -1, dtype=np.int64)  # listed row -> its entry; else -1
    entry[listed] = np.arange(len(listed))
    at = entry[np.where(parent >= 0, parent, total)]
    tokens = draft.reshape(-1)
    usable = (at >= 0) & (tokens >= 0) & (tokens < vocab_size)
    safe = np.where(usable, tokens, 0)
    word = np.zeros(total, dtype=np.int32)
    word[usable] = bits[at[usable], safe[usable] >> 5]
    valid = usable & (((word >> (safe & 31)) & 1) == 1)
    valid[::nodes] = True
    unconstrained = np.repeat(np.asarray(kinds) == NONE, nodes)
    valid[unconstrained] = topology.reachable[unconstrained]
    return valid.reshape(batch, nodes)
