"""The host build in the dense layout: one row per node, written in place.

Each xgrammar request is walked by xgrammar's C++ traversal straight into its rows of the
mask, then repaired in the same job (:func:`portable_spec.native.repair_rows`: every row of a
node that does not keep its grammar row becomes all-allowed, and the valid flags are written
on the way), both without the GIL with the compiled helper. Python walks write their rows and
say which they filled; llguidance chains are filled in one executor call. Nothing passes over
the mask afterwards, except for requests split over threads (repaired once all their pieces
are walked).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np

import portable_spec.builder.jobs as jobs
from portable_spec import native
from portable_spec.builder.jobs import (
    Build,
    Job,
    Links,
    Walk,
    accepted_below,
    account,
    copy_rows,
    fill_llguidance_named,
    run_build,
    scratch_rows,
)
from portable_spec.engines.base import MatcherInfo
from portable_spec.engines.llguidance import fill_llguidance_chains
from portable_spec.engines.xgrammar import walk_xgrammar
from portable_spec.errors import MatcherError
from portable_spec.grammars import NONE, XGRAMMAR
from portable_spec.masks import ALL_ALLOWED

__all__ = ["build_dense", "build_inline", "build_table", "walk_table"]


def build_dense(build: Build, mask: np.ndarray) -> Any:
    """The dense layout of :func:`portable_spec.build_host_bitmask` by the planner (one job
    per request, or per subtree, on the pool as ``build.plan`` says), once every argument is
    checked, the tree resolved and validated (``build``), the matchers held, and at least
    one request is constrained. Any mix of grammar engines.

    Writes every row of ``mask`` (int32 ``[rows, words]``, C-contiguous) and returns it, or
    ``(mask, valid)`` with ``build.return_valid`` (bool ``[batch, nodes]``; ``[rows]`` for
    packed chains). Blocks until every row is written; every matcher ends where it started.
    """
    tree, kinds = build.tree, build.kinds
    batch, nodes, rows = tree.batch, tree.nodes, tree.rows
    chains = tree.is_chain or tree.is_packed
    accepted = live = None
    if build.return_valid:
        accepted = np.zeros(rows, dtype=bool)
        if any(kind not in (XGRAMMAR, NONE) for kind in kinds):
            live = np.zeros(rows, dtype=bool)
    flags = accepted if chains else None
    sink = _DenseRows(mask, build.spans, build.vocab_size, flags, accepted, live)
    owners, seconds, counts = run_build(sink, build)
    account(build.constrained, owners, seconds, counts, rows, build.times)
    if accepted is None:
        return mask
    if live is not None:
        walked = [b for b, kind in enumerate(kinds) if kind not in (XGRAMMAR, NONE)]
        _accept_walked(mask, build, walked, live, accepted)
    if not chains:
        unconstrained = np.repeat(np.asarray(kinds) == NONE, nodes)
        if unconstrained.any():
            accepted[unconstrained] = tree.topology().reachable[unconstrained]
    return mask, accepted if tree.is_packed else accepted.reshape(batch, nodes)


class _DenseRows:
    """The dense row sink (see :class:`portable_spec.builder.jobs.RowSink`): request ``b``
    writes ``mask[start:start + n]`` for ``(start, n) = spans[b]``. ``accepted`` (flat bool
    ``[rows]``) receives the valid flags of xgrammar requests (and, ``unconstrained_flags``,
    of unconstrained chain requests); ``live`` marks the rows Python walks filled."""

    def __init__(
        self,
        mask: np.ndarray,
        spans: list[tuple[int, int]],
        vocab_size: int,
        unconstrained_flags: np.ndarray | None,
        accepted: np.ndarray | None,
        live: np.ndarray | None,
    ) -> None:
        self.mask, self.spans, self.vocab_size = mask, spans, vocab_size
        self.repair = native.row_repairer(accepted is not None)  # taken once per build
        self.unconstrained_flags, self.accepted, self.live = unconstrained_flags, accepted, live

    def _rows(self, b: int, flags: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        start, n = self.spans[b]
        return self.mask[start : start + n], None if flags is None else flags[start : start + n]

    def unconstrained(self, b: int) -> Job | None:
        block, flags = self._rows(b, self.unconstrained_flags)
        if flags is None:
            return partial(block.fill, ALL_ALLOWED)
        return partial(_allow_all, block, flags)

    def xgrammar(
        self, b: int, matcher: Any, links: Links, info: MatcherInfo, limit: int, counts: Any
    ) -> Job:
        block, flags = self._rows(b, self.accepted)
        job = partial(_xgrammar_repaired_job, self.repair, matcher, links, block, info, limit)
        return partial(job, counts, flags)

    def python_walk(self, b: int, walk: Walk, info: MatcherInfo, counts: Any) -> Job:
        block, live = self._rows(b, self.live)
        return partial(_walk_job, walk, block, info, counts, live)

    def llguidance_chains(
        self, group: dict[int, Any], width: int, draft: np.ndarray, counts: np.ndarray
    ) -> Job:
        fill = partial(
            fill_llguidance_chains, group, width, draft, self.mask, self.vocab_size, counts,
            live=self.live,
        )  # fmt: skip
        return partial(fill_llguidance_named, fill, group)

    def llguidance_walks(self, build: Build, requests: list[int], counts: np.ndarray) -> Job | None:
        words = self.mask.shape[1]
        if native.native is None or any(build.infos[b].words != words for b in requests):  # type: ignore[union-attr]
            return None
        next_token, next_sibling, draft = build.arrays
        width = draft.shape[1]
        spans = np.array(
            [(self.spans[b][0], b * width, self.spans[b][1]) for b in requests], dtype=np.int64
        )
        chain = build.tree.is_chain or build.tree.is_packed
        links = (None, None) if chain else (next_token.reshape(-1), next_sibling.reshape(-1))
        matchers = [build.grammars[b] for b in requests]
        limit = min(self.vocab_size, 32 * words)
        return partial(
            _llguidance_walks_job, self.mask, links, draft.reshape(-1), spans, matchers, limit,
            chain, counts, requests, self.live,
        )  # fmt: skip

    def split_block(self, b: int, info: MatcherInfo) -> np.ndarray:
        return self._rows(b, None)[0]

    def finish_split(
        self, b: int, links: Links, info: MatcherInfo, limit: int, live: int
    ) -> tuple[int, int]:
        block, flags = self._rows(b, self.accepted)
        return native.repair_rows(block, links, limit, info.stop_ids, live, flags)


def _llguidance_walks_job(
    mask: np.ndarray,
    links: tuple[np.ndarray | None, np.ndarray | None],
    draft: np.ndarray,
    spans: np.ndarray,
    matchers: list[Any],
    limit: int,
    chain: bool,
    counts: np.ndarray,
    requests: list[int],
    live: np.ndarray | None,
) -> None:
    """Walk llguidance requests in one compiled call (the Python walk's rules, the matchers'
    methods called from C) straight into their rows of ``mask``; the rows they do not fill
    all-allowed, ``live`` marking the filled ones; their counts into ``counts``. A matcher
    that raises is named by its request (every matcher back in its state)."""
    walked = np.zeros((len(requests), 2), dtype=np.int64)
    failed, error = native.llguidance_walks(
        mask, links[0], links[1], draft, spans, matchers, limit, chain, walked, live, None
    )
    if failed >= 0:
        raise MatcherError(requests[failed], error) from error
    counts[requests] = walked


def _allow_all(block: np.ndarray, accepted: np.ndarray) -> None:
    """An unconstrained chain request: every row all-allowed, every node accepted."""
    block.fill(ALL_ALLOWED)
    accepted.fill(True)


def _xgrammar_repaired_job(
    repair: Callable[..., tuple[int, int, int]],
    matcher: Any,
    links: Links,
    block: np.ndarray,
    info: MatcherInfo,
    limit: int,
    counts: np.ndarray,
    accepted: np.ndarray | None,
) -> None:
    """Walk one request with xgrammar's C++ traversal, then repair its rows in place with
    ``repair`` (:func:`portable_spec.native.row_repairer`; both release the GIL with the
    compiled helper); store its (checked, refused) node counts, and
    which nodes the grammar accepts into ``accepted`` (its ``[nodes]`` flags) if given."""
    nodes, words = block.shape
    target = block if info.words == words else scratch_rows(nodes, info.words)
    live = walk_xgrammar(matcher, *links, target)
    if target is not block:
        copy_rows(block, target, info.words, None)
    if accepted is None:
        _, counts[0], counts[1] = repair(block, *links, limit, info.stop_ids, int(live))
    else:
        _, counts[0], counts[1] = repair(block, *links, limit, info.stop_ids, int(live), accepted)


def _walk_job(
    walk: Walk, block: np.ndarray, info: MatcherInfo, counts: np.ndarray, live: np.ndarray | None
) -> None:
    """Walk one request with a Python walk (protocol matchers, llguidance trees, outlines-core
    guides); rows it does not fill become -1; ``live`` (its rows) marks the filled ones."""
    nodes, words = block.shape
    target = block if info.words == words else scratch_rows(nodes, info.words)
    filled, counts[0], counts[1] = walk(target)
    if live is not None:
        live[:] = filled
    if target is not block:
        copy_rows(block, target, info.words, None)
    if info.vocab_size % 32:
        # a foreign matcher may leave bits past its vocabulary set; the contract says 0
        block[:, info.words - 1] &= np.int32((1 << (info.vocab_size % 32)) - 1)
    block[~np.asarray(filled)] = ALL_ALLOWED


def _accept_walked(
    mask: np.ndarray, build: Build, requests: list[int], live: np.ndarray, accepted: np.ndarray
) -> None:
    """The valid flags of the requests walked in Python (and llguidance chains), read off
    their finished rows: a node is accepted when it is a root, or its parent is live and the
    parent's row allows its token (``live``: flat bool ``[rows]``, the rows they filled)."""
    tree, spans, draft = build.tree, build.spans, build.arrays[2]
    parent_of = None if tree.is_chain or tree.is_packed else tree.topology().parent
    rows_list, parents, tokens = [], [], []
    for b in requests:
        start, n = spans[b]
        rows = np.arange(start, start + n)
        if parent_of is None:  # chains: each node's parent is the row before it
            parent = rows - 1
            parent[0] = -1
        else:
            parent = parent_of[rows]
        rows_list.append(rows)
        parents.append(parent)
        tokens.append(draft[b, :n])
    rows = np.concatenate(rows_list)
    parent = np.concatenate(parents)
    at = np.where((parent >= 0) & live[np.where(parent >= 0, parent, 0)], parent, -1)
    flags = accepted_below(mask, at, np.concatenate(tokens), build.vocab_size)
    accepted[rows] = flags
    accepted[[spans[b][0] for b in requests]] = True  # the roots


def walk_table(build: Build) -> np.ndarray:
    """The :func:`jobs.walk_chain_table` table of a build (chains and trees alike: per
    request its first row, its first node ``b * nodes`` in the resolved arrays, its nodes)."""
    nodes = build.tree.nodes
    table = [(start, b * nodes, n) for b, (start, n) in enumerate(build.spans)]
    return np.array(table, dtype=np.int64)


def build_table(build: Build, mask: np.ndarray, parts: int) -> Any:
    """The dense build of chains or trees whose every constrained matcher the compiled
    helper walks itself (:func:`jobs.walkable` of ``build.infos``), in one call on the calling
    thread or in ``parts`` parts on the pool (:func:`jobs.walk_chain_table`); the matchers
    held by the caller. Same result and accounting as :func:`build_dense`."""
    table = walk_table(build)
    tree = build.tree
    chains = tree.is_chain or tree.is_packed
    accepted = np.empty(tree.rows, dtype=bool) if build.return_valid else None
    info = build.infos[build.constrained[0]]
    limit = min(build.vocab_size, info.vocab_size)  # type: ignore[union-attr]
    next_token, next_sibling, draft = build.arrays
    links = None if chains else (next_token.reshape(-1), next_sibling.reshape(-1))
    stop_ids = info.stop_ids  # type: ignore[union-attr]
    checked, rejected, walks = jobs.walk_chain_table(
        mask, draft.reshape(-1), table, build.grammars, limit, stop_ids, accepted, parts, links
    )
    if accepted is not None:
        reachable = None if chains else tree.topology().reachable
        for b, kind in enumerate(build.kinds):
            if kind == NONE:  # an unconstrained request: every node a link reaches accepted
                start, n = build.spans[b]
                if reachable is None:
                    accepted[start : start + n] = True
                else:
                    accepted[start : start + n] = reachable[start : start + n]
    walked = [w for w in walks if build.kinds[w[0]] != NONE]
    return jobs.settle(build.tree, build.times, mask, accepted, walked, checked, rejected)


def build_inline(build: Build, mask: np.ndarray) -> Any:
    """The build of a small batch of xgrammar requests (and unconstrained ones) on the
    calling thread, request after request: the C++ traversal, then the repair writing the
    counts and valid flags (both release the GIL with the compiled helper); no job objects,
    no pool, no pass over the mask afterwards. The matchers held by the caller. Same result
    and accounting as :func:`build_dense`."""
    grammars, tree, infos, spans = build.grammars, build.tree, build.infos, build.spans
    next_token, next_sibling, draft = build.arrays
    vocab_size = build.vocab_size
    accepted = np.empty(tree.rows, dtype=bool) if build.return_valid else None
    repair = native.row_repairer(accepted is not None)
    words = mask.shape[1]
    walks = []
    checked = rejected = 0
    full = tree.nodes
    began = perf_counter()
    for b, kind in enumerate(build.kinds):
        start, n = spans[b]
        block = mask[start : start + n]
        flags = None if accepted is None else accepted[start : start + n]
        if kind == NONE:
            block.fill(ALL_ALLOWED)
            if flags is not None:
                flags.fill(True)
            continue
        info: MatcherInfo = infos[b]  # type: ignore[assignment]
        if n == full:
            nt, ns, dt = next_token[b], next_sibling[b], draft[b]
        else:
            nt, ns, dt = next_token[b, :n], next_sibling[b, :n], draft[b, :n]
        try:
            target = block if info.words == words else scratch_rows(n, info.words)
            live = int(walk_xgrammar(grammars[b], nt, ns, dt, target))
            if target is not block:
                copy_rows(block, target, info.words, None)
            limit = min(vocab_size, info.vocab_size)
            if flags is None:
                _, c, r = repair(block, nt, ns, dt, limit, info.stop_ids, live)
            else:
                _, c, r = repair(block, nt, ns, dt, limit, info.stop_ids, live, flags)
        except BaseException as exc:
            raise MatcherError(b, exc) from exc
        checked += c
        rejected += r
        ended = perf_counter()
        walks.append((b, ended - began))
        began = ended
    return jobs.settle(build.tree, build.times, mask, accepted, walks, checked, rejected)
