"""The host build in the compact layout: only the rows that constrain something are written.

The dense build writes every row of ``[batch * nodes, words]``: the grammar's rows where xgrammar
(or a Python walk) filled them, and ``-1`` into every other row, which is most of them when
drafts leave the grammar early. The compact build writes only the ``K`` rows of accepted,
non-terminated nodes, back to back and in row order, plus their row indices
(:class:`portable_spec.CompactMask`); no all-allowed row is ever written.

How, per request, on the library's thread pool:

1. walk the request into a scratch block of ``[nodes, width]`` rows taken from a free list
   (reused across builds, so no page faults and, at typical sizes, cache-resident);
2. decide which nodes keep their row from node indices alone (the same rule as the dense
   build's row repair, :func:`portable_spec.native.keep_rows`, which reports the kept nodes
   instead of writing ``-1`` into the others);
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
from functools import partial
from typing import Any

import numpy as np

from portable_spec import native
from portable_spec.builder.jobs import (
    Build,
    Job,
    Links,
    Walk,
    accepted_below,
    account,
    fill_llguidance_named,
    run_build,
)
from portable_spec.engines.base import MatcherInfo
from portable_spec.engines.llguidance import fill_llguidance_chains
from portable_spec.engines.xgrammar import walk_xgrammar
from portable_spec.grammars import NONE
from portable_spec.masks import CompactMask, compact_views, index_words

__all__ = ["build_compact"]


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


class _CompactRows:
    """The compact row sink (see :class:`portable_spec.builder.jobs.RowSink`): requests commit
    their kept rows in request order, whatever order they finish in.

    ``order``: the requests that will commit, ascending. A commit parks the request's rows;
    every request whose predecessors have all committed gets the next offset, and its rows are
    copied there (by the thread that completed the prefix, outside the lock).
    """

    def __init__(
        self,
        bits: np.ndarray,
        rows: np.ndarray,
        order: list[int],
        nodes: int,
        capacity: int,
        vocab_size: int,
    ) -> None:
        self.bits, self.rows = bits, rows
        self.order = order
        self.nodes = nodes
        self.capacity = capacity
        self.vocab_size = vocab_size
        self._split_blocks: dict[int, np.ndarray] = {}
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
                native.take_rows(src, which, self.bits[offset:end], rows, request * self.nodes)
            if back:
                _scratch.give(src)

    def finish(self) -> int:
        """The number of kept rows; every request must have committed."""
        assert self._next == len(self.order), "a request did not commit its rows"
        return self.count

    # -- the jobs (RowSink) --------------------------------------------------------------------
    def unconstrained(self, b: int) -> Job | None:
        return None  # nothing is written for an unconstrained request

    def xgrammar(
        self, b: int, matcher: Any, links: Links, info: MatcherInfo, limit: int, counts: Any
    ) -> Job:
        return partial(_xgrammar_job, matcher, links, info, limit, self, b, counts)

    def python_walk(self, b: int, walk: Walk, info: MatcherInfo, counts: Any) -> Job:
        return partial(_walk_job, walk, info, self, b, counts)

    def llguidance_chains(
        self, group: dict[int, Any], width: int, draft: np.ndarray, counts: np.ndarray
    ) -> Job:
        return partial(_llguidance_chains_job, group, width, draft, self.vocab_size, self, counts)

    def llguidance_walks(self, build: Build, requests: list[int], counts: np.ndarray) -> Job | None:
        return None  # walked request by request into scratch blocks (their kept rows committed)

    def split_block(self, b: int, info: MatcherInfo) -> np.ndarray:
        block = self._split_blocks[b] = np.empty((self.nodes, info.words), dtype=np.int32)
        return block

    def finish_split(
        self, b: int, links: Links, info: MatcherInfo, limit: int, live: int
    ) -> tuple[int, int]:
        block = self._split_blocks.pop(b)
        kept, checked, refused = native.keep_rows(block, links, limit, info.stop_ids, live)
        self.commit(b, block, kept, recycle=False)
        return checked, refused


def _xgrammar_job(
    matcher: Any,
    links: Links,
    info: MatcherInfo,
    limit: int,
    sink: _CompactRows,
    b: int,
    counts: np.ndarray,
) -> None:
    """Walk one request with xgrammar's C++ traversal into a scratch block, decide its kept
    rows, commit them."""
    block = sink.scratch(info.words)
    live = walk_xgrammar(matcher, *links, block)
    kept, counts[0], counts[1] = native.keep_rows(block, links, limit, info.stop_ids, int(live))
    sink.commit(b, block, kept)


def _walk_job(
    walk: Walk, info: MatcherInfo, sink: _CompactRows, b: int, counts: np.ndarray
) -> None:
    """Walk one request with a Python walk (protocol matchers, llguidance trees, outlines-core
    guides) into a scratch block; its filled rows are the kept ones."""
    block = sink.scratch(info.words)
    filled, counts[0], counts[1] = walk(block)
    kept = np.flatnonzero(filled).astype(np.int32)
    if info.vocab_size % 32 and len(kept):
        # a foreign matcher may leave bits past its vocabulary set; the contract says 0
        block[kept, info.words - 1] &= np.int32((1 << (info.vocab_size % 32)) - 1)
    sink.commit(b, block, kept)


def _llguidance_chains_job(
    group: dict[int, Any],
    width: int,
    draft: np.ndarray,
    vocab_size: int,
    sink: _CompactRows,
    counts: np.ndarray,
) -> None:
    """Fill a group of llguidance chains (one executor call) into a block of their own, then
    commit each request's live prefix. A matcher found broken is reported by its request."""
    requests = list(group)
    nodes = draft.shape[1]
    block = np.empty((len(requests) * nodes, width), dtype=np.int32)
    local = {k: group[b] for k, b in enumerate(requests)}
    local_counts = np.zeros((len(requests), 2), dtype=np.int64)
    fill = partial(
        fill_llguidance_chains, local, width, draft[requests], block, vocab_size, local_counts
    )
    alive = fill_llguidance_named(fill, group)
    counts[requests] = local_counts
    for k, b in enumerate(requests):
        rows = block[k * nodes : (k + 1) * nodes]
        sink.commit(b, rows, np.arange(int(alive[k]), dtype=np.int32), recycle=False)


# -- the build -----------------------------------------------------------------------------------
def build_compact(
    build: Build, out: tuple[np.ndarray, np.ndarray] | None, max_rows: int | None
) -> Any:
    """The compact layout of :func:`portable_spec.build_host_bitmask`, called by it once every
    argument is checked (``out``: the checked ``(rows, bits)`` arrays of an ``out=``
    CompactMask, or None), the tree resolved and validated (``build``), and at least one
    request is constrained.

    Returns a host :class:`CompactMask` (views of ``out``'s arrays if given): ``count`` real
    entries (``rows`` ascending, ``b * nodes + j``), then, with ``max_rows``, padding up to
    ``max_rows`` entries (row index ``batch * nodes``, bits not written). With
    ``build.return_valid``, ``(mask, valid)`` as for the dense layout. Blocks until done.

    Raises:
        ValueError: more than ``max_rows`` rows listed (after the walks; every matcher is back
            in its state).
    """
    words = (build.vocab_size + 31) // 32
    tree = build.tree
    nodes = tree.nodes
    num_rows = tree.batch * nodes
    capacity = len(build.constrained) * nodes if max_rows is None else max_rows
    if out is not None:
        rows_out, bits_out = out
    else:
        block = np.empty((capacity + index_words(capacity, words), words), dtype=np.int32)
        rows_out, bits_out = compact_views(block, capacity)
    room = min(capacity, bits_out.shape[0])
    sink = _CompactRows(bits_out, rows_out, build.constrained, nodes, room, build.vocab_size)
    owners, seconds, counts = run_build(sink, build)
    count = sink.finish()
    account(build.constrained, owners, seconds, counts, count, build.times)
    if max_rows is not None and count > max_rows:
        raise ValueError(
            f"the build lists {count} rows (accepted, non-terminated nodes of constrained "
            f"requests) but max_rows = {max_rows}; raise max_rows (at most batch * nodes = "
            f"{num_rows} can be needed). Every matcher is back in its state."
        )
    valid = None
    if build.return_valid:
        valid = _valid_nodes(rows_out[:count], bits_out[:count], build)
    if max_rows is None:
        mask = CompactMask(rows_out[:count], bits_out[:count], num_rows, count)
    else:
        rows_out[count:max_rows] = num_rows
        mask = CompactMask(rows_out[:max_rows], bits_out[:max_rows], num_rows, count)
    return mask if valid is None else (mask, valid)


def _valid_nodes(listed: np.ndarray, bits: np.ndarray, build: Build) -> np.ndarray:
    """bool ``[batch, nodes]``: the accepted nodes (the dense build's ``return_valid`` rule),
    read off the compact entries: a node is accepted when it is a root, or its parent is
    listed and the parent's row allows its token; unconstrained requests accept every node a
    link reaches."""
    tree = build.tree
    batch, nodes = tree.batch, tree.nodes
    total = batch * nodes
    topology = tree.topology()
    parent = topology.parent
    entry = np.full(total + 1, -1, dtype=np.int64)  # listed row -> its entry; else -1
    entry[listed] = np.arange(len(listed))
    at = entry[np.where(parent >= 0, parent, total)]
    valid = accepted_below(bits, at, build.arrays[2].reshape(-1), build.vocab_size)
    valid[::nodes] = True
    unconstrained = np.repeat(np.asarray(build.kinds) == NONE, nodes)
    valid[unconstrained] = topology.reachable[unconstrained]
    return valid.reshape(batch, nodes)
