"""The jobs of one build, whatever the layout: one planner over a row sink, and their runner.

A build's work is a list of jobs (callables) run on the library's thread pool: one per
xgrammar request (several for a request split over threads), one for all requests walked in
Python (they hold the GIL: on other threads they would only take turns), one per llguidance
width for chains (its executor fills them in parallel itself), one per unconstrained request
where the layout writes its rows. :func:`plan_jobs` makes that decision once; where the rows
go is the *sink*'s business (:class:`RowSink`): the dense build writes them into the mask in
place and repairs them inside the job, the compact build walks into scratch blocks and
commits the kept rows in request order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from time import perf_counter
from typing import Any, NamedTuple, Protocol

import numpy as np

from portable_spec import native
from portable_spec.builder.split import Split, Subtree, plan_split, walk_subtree
from portable_spec.engines.base import MatcherInfo
from portable_spec.engines.generic import walk_generic
from portable_spec.engines.llguidance import walk_llguidance, walk_llguidance_chain
from portable_spec.engines.outlines import walk_outlines
from portable_spec.engines.xgrammar import walk_xgrammar
from portable_spec.errors import MatcherError
from portable_spec.grammars import GENERIC, LLGUIDANCE, NONE, OUTLINES, XGRAMMAR
from portable_spec.pool import WorkItemError, get_num_threads, run_indexed
from portable_spec.stats import record_build
from portable_spec.tree import GrammarTree

__all__ = [
    "Build",
    "Plan",
    "RowSink",
    "accepted_below",
    "account",
    "per_node",
    "plan_jobs",
    "run_build",
    "run_jobs",
    "settle",
    "walk_chain_table",
]

Links = tuple[np.ndarray, np.ndarray, np.ndarray]
#: one request's Python walk, bound to its matcher and links: rows -> (filled, checked, refused)
Walk = Callable[[np.ndarray], tuple[list[bool], int, int]]
Job = Callable[[], None]

_PYTHON_WALKS = {GENERIC: walk_generic, LLGUIDANCE: walk_llguidance, OUTLINES: walk_outlines}

_scratch = threading.local()


class RowSink(Protocol):
    """Where a build's jobs put their rows (the dense mask, or a compact mask's entries).

    Request ``b``'s nodes are the first ``n`` of its links, for ``(start, n) = spans[b]``.
    Each method returns the job that walks one request (or a group) and delivers its rows,
    except the two split ones: a split request is walked in pieces into :meth:`split_block`,
    then :meth:`finish_split` decides and delivers its rows after every job has run.
    """

    def unconstrained(self, b: int) -> Job | None:
        """The job writing the rows of unconstrained request ``b`` (None: nothing to write)."""
        ...

    def xgrammar(
        self, b: int, matcher: Any, links: Links, info: MatcherInfo, limit: int, counts: Any
    ) -> Job:
        """Walk request ``b`` with xgrammar's traversal, decide which rows it keeps (writing
        its ``(checked, refused)`` into ``counts``), deliver them."""
        ...

    def python_walk(self, b: int, walk: Walk, info: MatcherInfo, counts: Any) -> Job:
        """Walk request ``b`` with ``walk(rows)`` (a Python walk of its matcher over its
        links, writing ``rows`` int32 ``[nodes, info.words]``); its filled rows are the kept
        ones."""
        ...

    def llguidance_chains(
        self, group: dict[int, Any], width: int, draft: np.ndarray, counts: np.ndarray
    ) -> Job:
        """Fill the llguidance chains of ``group`` (request -> matcher, all ``width`` words
        wide) in one executor call."""
        ...

    def llguidance_walks(self, build: Build, requests: list[int], counts: np.ndarray) -> Job | None:
        """The job walking the llguidance ``requests`` of ``build`` in one compiled call
        (their counts into ``counts``), or None: each is then a :meth:`python_walk`."""
        ...

    def split_block(self, b: int, info: MatcherInfo) -> np.ndarray:
        """The ``[nodes, width]`` rows the pieces of split request ``b`` walk into."""
        ...

    def finish_split(
        self, b: int, links: Links, info: MatcherInfo, limit: int, live: int
    ) -> tuple[int, int]:
        """Decide and deliver the rows of split request ``b`` (in its :meth:`split_block`)
        after its walks; return its ``(checked, refused)``."""
        ...


class Plan(NamedTuple):
    """How the planner runs one build's jobs: decided by the route table
    (:mod:`portable_spec.builder.routes`, which holds every threshold), obeyed here.

    Attributes:
        parallel: run the jobs on the pool (else one after the other on the calling thread).
        split_nodes: with fewer constrained requests than threads, xgrammar trees of at least
            this many nodes are cut into subtrees walked on forks (0: never).
        split_part: the fewest nodes of a cut subtree.
        executor: llguidance chains in one call of llguidance's parallel executor per width
            (else walked in one compiled call, or each in a job).
    """

    parallel: bool
    split_nodes: int
    split_part: int
    executor: bool


class Build(NamedTuple):
    """One build's inputs once the front has checked them all, resolved and validated the
    tree: what every layout's build starts from.

    Attributes:
        grammars: one matcher (or None) per request.
        tree: the verify trees; ``arrays`` its resolved int64 ``[batch, nodes]`` first-child,
            next-sibling and token arrays, ``spans`` its ``(first row, nodes)`` per request.
        vocab_size: the model's vocabulary size.
        kinds, infos: per request, the engine kind and its probe (``grammars.classify``).
        constrained: the requests with a grammar (at least one).
        return_valid: whether the valid flags are asked for.
        times: ``(started, resolved)`` perf_counter seconds, for the statistics.
        plan: how the planner runs the jobs (the route table's decision).
    """

    grammars: Sequence[Any]
    tree: GrammarTree
    arrays: Links
    spans: list[tuple[int, int]]
    vocab_size: int
    kinds: list[int]
    infos: list[MatcherInfo | None]
    constrained: list[int]
    return_valid: bool
    times: tuple[float, float]
    plan: Plan


def run_build(sink: RowSink, build: Build) -> tuple[list[int], list[float], np.ndarray]:
    """Plan the jobs of ``build`` over ``sink``, run them (on the pool when worth it), then
    finish the split requests. Returns the owners and seconds of the jobs (for
    :func:`account`) and the int64 ``[batch, 2]`` ``(checked, refused)`` counts. Blocks until
    every row is delivered; a failing matcher raises :class:`MatcherError` naming its
    request, every matcher back in its state."""
    batch = build.tree.batch
    counts = np.zeros((batch, 2), dtype=np.int64)
    root_ok = np.ones(batch, dtype=bool)  # split requests: was the matcher live at the root
    splits = plan_splits(build)
    jobs, owners, parallel = plan_jobs(sink, build, counts, root_ok, splits)
    seconds = run_jobs(jobs, owners, parallel)
    next_token, next_sibling, draft = build.arrays
    for b in sorted(splits):  # walked in pieces: decide and deliver over the whole tree now
        info: MatcherInfo = build.infos[b]  # type: ignore[assignment]
        links = (next_token[b], next_sibling[b], draft[b])
        limit = min(build.vocab_size, info.vocab_size)
        counts[b] = sink.finish_split(b, links, info, limit, int(root_ok[b]))
    return owners, seconds, counts


def plan_jobs(
    sink: RowSink,
    build: Build,
    counts: np.ndarray,
    root_ok: np.ndarray,
    splits: dict[int, tuple[Split, list[Any]]],
) -> tuple[list[Job], list[int], bool]:
    """The jobs of one build, the (first) request of each, and whether to run them on the
    pool.

    ``counts`` int64 ``[batch, 2]`` receives each request's ``(checked, refused)`` draft
    nodes (split requests: after the walks, see :func:`run_build`); ``root_ok`` bool
    ``[batch]`` receives whether each split request's matcher was live at the root;
    ``splits`` from :func:`plan_splits`. On linear chains llguidance requests are filled in
    one executor call per width.
    """
    grammars, kinds, infos, spans = build.grammars, build.kinds, build.infos, build.spans
    vocab_size, chains = build.vocab_size, build.tree.is_chain
    next_token, next_sibling, draft = build.arrays
    jobs: list[Job] = []
    owners: list[int] = []
    walks: list[tuple[int, Job]] = []  # Python walks: they hold the GIL
    llguidance = [b for b, kind in enumerate(kinds) if kind == LLGUIDANCE]
    grouped = chains and build.plan.executor
    if grouped and llguidance:  # llguidance's executor fills chains in parallel itself
        for width in sorted({infos[b].words for b in llguidance}):  # type: ignore[union-attr]
            group = {b: grammars[b] for b in llguidance if infos[b].words == width}  # type: ignore[union-attr]
            jobs.append(sink.llguidance_chains(group, width, draft, counts))
            owners.append(next(iter(group)))
    elif llguidance:  # walked in one compiled call where the sink can
        job = sink.llguidance_walks(build, llguidance, counts)
        grouped = job is not None
        if job is not None:
            jobs.append(job)
            owners.append(llguidance[0])
    for b, kind in enumerate(kinds):
        n = spans[b][1]
        if kind == NONE:
            job = sink.unconstrained(b)
            if job is not None:
                jobs.append(job)
                owners.append(b)
            continue
        if kind == LLGUIDANCE and grouped:
            continue
        info: MatcherInfo = infos[b]  # type: ignore[assignment]
        limit = min(vocab_size, info.vocab_size)
        if kind in _PYTHON_WALKS:
            lists = (
                next_token[b, :n].tolist(),
                next_sibling[b, :n].tolist(),
                draft[b, :n].tolist(),
            )
            if kind == OUTLINES:
                _check_depth(b, lists[0], lists[1], info)
            walker = walk_llguidance_chain if chains and kind == LLGUIDANCE else _PYTHON_WALKS[kind]
            walk = partial(_walk_into, walker, grammars[b], lists, limit)
            walks.append((b, sink.python_walk(b, walk, info, counts[b])))
            continue
        if b not in splits:
            links = (next_token[b, :n], next_sibling[b, :n], draft[b, :n])
            jobs.append(sink.xgrammar(b, grammars[b], links, info, limit, counts[b]))
        else:
            plan, forks = splits[b]
            block = sink.split_block(b, info)
            for sub, fork in zip(plan.subtrees, forks, strict=True):
                jobs.append(partial(_subtree_job, fork, sub, block, info, limit))
                owners.append(b)
            links = (plan.next_token, plan.next_sibling, draft[b])
            rows = plan.main_rows
            jobs.append(partial(_xgrammar_job, grammars[b], links, block, info, root_ok, b, rows))
        owners.append(b)
    if walks:  # one job: on other threads they would only take turns holding the GIL
        jobs.append(partial(_walk_requests, walks))
        owners.append(walks[0][0])
    return jobs, owners, bool(splits) or build.plan.parallel


def plan_splits(build: Build) -> dict[int, tuple[Split, list[Any]]]:
    """Cut large xgrammar trees into subtrees when there are fewer requests than threads.

    Each request gets about ``threads / requests`` pieces. Returns, per split request, the
    split and one fork of the matcher per subtree, taken now, before any walk moves the
    matcher. Packed chains are never split.
    """
    tree, constrained, plan = build.tree, build.constrained, build.plan
    if tree.is_packed or not plan.split_nodes or tree.nodes < plan.split_nodes:
        return {}
    threads = get_num_threads()
    if threads < 2 or len(constrained) >= threads:
        return {}
    parts = threads // len(constrained)
    if parts < 2:
        return {}
    next_token, next_sibling, draft = build.arrays
    plans = {}
    for b in constrained:
        if build.kinds[b] != XGRAMMAR:
            continue
        nt, ns, dt = next_token[b].tolist(), next_sibling[b].tolist(), draft[b].tolist()
        split = plan_split(nt, ns, dt, parts, plan.split_part)
        if split is not None:
            plans[b] = (split, [build.grammars[b].fork() for _ in split.subtrees])
    return plans


def run_jobs(jobs: list[Job], owners: list[int], parallel: bool) -> list[float]:
    """Run a build's jobs (on the pool when ``parallel`` and there are several) and return
    each one's seconds; a failing job raises :class:`MatcherError` naming its request
    (``owners[i]`` for job ``i``, unless the job named it itself). Blocks until every job
    has finished (or one has failed and the others stopped)."""
    seconds = [0.0] * len(jobs)
    if not parallel or len(jobs) == 1:  # inline on the calling thread, no pool hand-off
        for i, job in enumerate(jobs):
            start = perf_counter()
            try:
                job()
            except MatcherError as exc:  # a batch-wide job named its request
                raise exc from exc.error
            except BaseException as exc:
                raise MatcherError(owners[i], exc) from exc
            finally:
                seconds[i] = perf_counter() - start
        return seconds

    def run_job(i: int) -> None:
        start = perf_counter()
        try:
            jobs[i]()
        finally:
            seconds[i] = perf_counter() - start

    try:
        run_indexed(run_job, len(jobs), parallel=parallel and len(jobs) > 1)
    except WorkItemError as exc:
        if isinstance(exc.error, MatcherError):  # a batch-wide job named its request
            raise exc.error from exc.error.error
        raise MatcherError(owners[exc.index], exc.error) from exc.error
    return seconds


def account(
    constrained: list[int],
    owners: list[int],
    seconds: list[float],
    counts: np.ndarray,
    rows: int,
    times: tuple[float, float],
) -> None:
    """Record a build in :func:`portable_spec.grammar_stats`: each request's walk time (its
    jobs summed), ``rows`` produced, the node counts, and the phases from ``times``
    (``(started, tree resolved)``, perf_counter seconds) to now."""
    per_request = dict.fromkeys(constrained, 0.0)
    for owner, spent in zip(owners, seconds, strict=True):
        if owner in per_request:
            per_request[owner] += spent
    if len(counts) <= 16:  # a few numbers: cheaper in Python than a numpy reduction
        pairs = counts.tolist()
        checked, rejected = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    else:
        checked, rejected = (int(n) for n in counts.sum(axis=0))
    started, resolved = times
    record_build(
        per_request.items(),
        rows,
        wait_seconds=resolved - started,
        walk_seconds=perf_counter() - resolved,
        checked_nodes=checked,
        rejected_nodes=rejected,
    )


# -- the valid flags ---------------------------------------------------------------------------
def accepted_below(
    bits: np.ndarray, at: np.ndarray, tokens: np.ndarray, vocab_size: int
) -> np.ndarray:
    """Which nodes the grammar accepts below a live parent: bool, one per node of ``at``.

    ``at[i]``: the entry of ``bits`` (int32 ``[entries, words]``) holding node ``i``'s
    parent's row when that parent is accepted and not terminated, else -1 (a root, a
    parent rejected or terminated). Node ``i`` is accepted there iff ``0 <= tokens[i] <
    vocab_size`` and the token's bit is set in that row. Roots are the caller's to set.
    """
    usable = (at >= 0) & (tokens >= 0) & (tokens < vocab_size)
    safe = np.where(usable, tokens, 0)
    word = np.zeros(len(at), dtype=np.int32)
    word[usable] = bits[at[usable], safe[usable] >> 5]
    return usable & (((word >> (safe & 31)) & 1) == 1)


def per_node(tree: GrammarTree, padded: np.ndarray) -> np.ndarray:
    """A per-node bool ``[batch * nodes]`` over the tree's resolved (padded) arrays, in the
    shape ``return_valid`` gives: ``[batch, nodes]``, or ``[rows]`` for packed chains."""
    grid = padded.reshape(tree.batch, tree.nodes)
    if not tree.is_packed:
        return grid.copy()
    lengths = np.diff(tree.offsets)
    offsets = tree.offsets
    assert offsets is not None
    starts = np.array([start for start, _ in tree.spans()], dtype=np.int64)
    positions = np.arange(int(offsets[-1]), dtype=np.int64) + np.repeat(
        starts - offsets[:-1], lengths
    )
    flags = np.zeros(tree.rows, dtype=bool)
    flags[positions] = grid[np.arange(tree.nodes)[None, :] < lengths[:, None]]
    return flags


# -- the jobs every layout shares --------------------------------------------------------------
def scratch_rows(nodes: int, words: int) -> np.ndarray:
    """A per-thread int32 ``[nodes, words]`` buffer for matchers narrower than the mask."""
    cache: dict[tuple[int, int], np.ndarray] | None = getattr(_scratch, "buffers", None)
    if cache is None:
        cache = _scratch.buffers = {}
    buf = cache.get((nodes, words))
    if buf is None:
        if len(cache) > 4:
            cache.clear()
        buf = cache[(nodes, words)] = np.empty((nodes, words), dtype=np.int32)
    return buf


def copy_rows(block: np.ndarray, target: np.ndarray, words: int, rows: list[int] | None) -> None:
    """Copy a narrower matcher's rows into the mask (zeros past its width)."""
    if rows is None:
        block[:, :words] = target
        block[:, words:] = 0
    else:
        block[rows, :words] = target[rows]
        block[rows, words:] = 0


def _xgrammar_job(
    matcher: Any,
    links: Links,
    block: np.ndarray,
    info: MatcherInfo,
    root_ok: np.ndarray,
    b: int,
    owned_rows: list[int] | None,
) -> None:
    """Walk the part of a split request left after cutting subtrees out (its rows
    ``owned_rows``) with xgrammar's C++ traversal."""
    nodes, words = block.shape
    target = block if info.words == words else scratch_rows(nodes, info.words)
    root_ok[b] = walk_xgrammar(matcher, *links, target)
    if target is not block:
        copy_rows(block, target, info.words, owned_rows)


def _subtree_job(fork: Any, sub: Subtree, block: np.ndarray, info: MatcherInfo, limit: int) -> None:
    """Walk a subtree cut out of a request on a fork of its matcher; write its rows."""
    k = len(sub.nodes)
    scratch = scratch_rows(k, info.words)
    if walk_subtree(fork, sub, scratch, limit):
        block[sub.nodes, : info.words] = scratch
        if info.words < block.shape[1]:
            block[sub.nodes, info.words :] = 0


def _walk_into(
    walk: Callable[..., tuple[list[bool], int, int]],
    matcher: Any,
    lists: tuple[list[int], list[int], list[int]],
    limit: int,
    rows: np.ndarray,
) -> tuple[list[bool], int, int]:
    """A Python walk of ``matcher`` over ``lists`` (its links and tokens) into ``rows``."""
    return walk(matcher, *lists, rows, limit)


def _walk_requests(walks: list[tuple[int, Job]]) -> None:
    """Run the Python walks one after the other; a failure names its request (each walk has
    already restored its matcher, and later ones have not moved theirs)."""
    for b, walk in walks:
        try:
            walk()
        except BaseException as exc:
            raise MatcherError(b, exc) from exc


def fill_llguidance_named(fill: Callable[[int], Any], matchers: dict[int, Any]) -> Any:
    """Run ``fill(threads)`` (an llguidance executor call over ``matchers``) and return what
    it returns; a matcher found broken afterwards is reported by its request index (the
    executor cannot say which one failed)."""
    try:
        return fill(get_num_threads())
    except BaseException as exc:
        for b, matcher in matchers.items():
            if matcher.is_error():
                raise MatcherError(b, RuntimeError(matcher.get_error())) from exc
        raise MatcherError(next(iter(matchers)), exc) from exc


def _check_depth(b: int, next_token: list[int], next_sibling: list[int], info: MatcherInfo) -> None:
    """Refuse a tree deeper than the matcher can roll back (before any matcher moves)."""
    limit = info.max_depth
    if limit is None or limit >= len(next_token) - 1:
        return
    depth = 0
    level = [0]
    while level:
        nxt = []
        for v in level:
            c = next_token[v]
            while c != -1:
                nxt.append(c)
                c = next_sibling[c]
        if nxt:
            depth += 1
        level = nxt
    if depth > limit:
        raise ValueError(
            f"the tree of request {b} is {depth} draft tokens deep but grammars[{b}] can roll "
            f"back only {limit} (an outlines_core.Guide built with max_rollback={limit}); "
            f"build its Guide with max_rollback >= {depth}"
        )


# -- chains the compiled helper walks itself ---------------------------------------------------
def walkable(infos: Sequence[MatcherInfo | None], words: int) -> MatcherInfo | None:
    """The first of ``infos`` when the compiled helper can walk every matcher they describe
    in one call (:func:`walk_chain_table`): each an xgrammar matcher's facts with a handle,
    ``words`` words per row, the same stop tokens and vocabulary (``None`` entries: requests
    without a matcher, skipped); ``None`` otherwise, or when every entry is ``None``."""
    if not native.walks_xgrammar():
        return None
    first = None
    for info in infos:
        if info is None:
            continue
        if not info.handle or info.words != words:
            return None
        if first is None:
            first = info
        elif info.stop_set != first.stop_set or info.vocab_size != first.vocab_size:
            return None
    return first


def walk_chain_table(
    mask: np.ndarray,
    tokens: np.ndarray,
    table: np.ndarray,
    matchers: Sequence[Any],
    limit: int,
    stop_ids: np.ndarray,
    valid: np.ndarray | None,
    parts: int,
    links: tuple[np.ndarray, np.ndarray] | None = None,
    hold: bool = False,
) -> tuple[int, int, list[tuple[int, float]]]:
    """Walk and repair chains (or trees) of xgrammar matchers with the compiled helper's
    ``walk_chains`` (``walk_trees`` with ``links``): xgrammar's C++ traversal through
    tvm-ffi's C ABI, GIL released.

    ``table``: int64 ``[chains, 3]``, per chain its first row in ``mask`` (int32 ``[rows,
    words]``), its first token in ``tokens`` (int64, root first) and its length; ``matchers``
    its matcher (``None``: all-allowed rows), each one :func:`walkable` accepts; ``rows`` the
    ``links``: ``(next_token, next_sibling)``, int64 like ``tokens``, each tree's links local
    to it. ``parts`` (the route table's choice, at most the library's threads): with more than
    one, the chains are cut into that many runs of about as many rows, walked on the pool at
    once.
    ``valid`` (bool ``[rows]``) gets the accepted nodes. ``hold``: the matchers are held by
    each part while it walks (``ValueError`` when another build holds one); without it the
    caller holds them. Returns ``(checked, refused, walks)``, ``walks`` the ``(chain index,
    seconds)`` of each chain. Blocks until every chain is done; a matcher xgrammar refuses
    raises :class:`MatcherError` naming its chain's index, every matcher back in its state.
    """
    chains = len(table)
    seconds = np.zeros(chains, dtype=np.float64)
    if links is None:
        walk = partial(native.walk_chains, mask, tokens)
        tail: tuple[Any, ...] = (0, valid)
    else:
        walk = partial(native.walk_trees, mask, links[0], links[1], tokens)
        tail = (valid,)
    parts = min(parts, chains)
    if parts <= 1:  # the common small call: no pool, no closure
        checked, refused = _walked(walk(table, matchers, limit, stop_ids, *tail, seconds, hold), 0)
        return checked, refused, list(enumerate(seconds.tolist()))
    bounds = _balanced_cuts(table[:, 2], parts)
    counts = np.zeros((len(bounds) - 1, 2), dtype=np.int64)

    def walk_part(i: int) -> None:
        lo, hi = bounds[i], bounds[i + 1]
        done = walk(table[lo:hi], matchers[lo:hi], limit, stop_ids, *tail, seconds[lo:hi], hold)
        counts[i] = _walked(done, lo)

    try:
        run_indexed(walk_part, len(bounds) - 1, parallel=len(bounds) > 2)
    except WorkItemError as exc:
        if isinstance(exc.error, MatcherError):
            raise exc.error from exc.error.error
        raise exc.error from exc
    checked, refused = (int(n) for n in counts.sum(axis=0))
    return checked, refused, list(enumerate(seconds.tolist()))


def _walked(done: Any, first: int) -> tuple[int, int]:
    """``(checked, refused)`` of a walk of chains from index ``first`` on; raises
    :class:`MatcherError` for a chain xgrammar refused and ``ValueError`` when the walk
    declined (another build holds one of its matchers)."""
    if done is None:
        raise ValueError(
            "a matcher of this build is being walked by another build that has not finished "
            "(one started with wait=False, or one running on another thread)"
        )
    checked, refused, failed, message = done
    if failed >= 0:
        raise MatcherError(first + failed, RuntimeError(message))
    return checked, refused


def _balanced_cuts(lengths: np.ndarray, parts: int) -> list[int]:
    """Cut points ``[0, ..., len(lengths)]`` of ``parts`` runs of about as many rows each."""
    ends = np.cumsum(lengths)
    targets = ends[-1] * np.arange(1, parts) / parts
    cuts = np.searchsorted(ends, targets, side="left") + 1
    return [0, *sorted(set(int(c) for c in cuts if 0 < c < len(lengths))), len(lengths)]


def settle(
    tree: GrammarTree,
    times: tuple[float, float],
    mask: np.ndarray,
    accepted: np.ndarray | None,
    walks: Any,
    checked: int,
    rejected: int,
) -> Any:
    """Record a build walked on the calling thread or by the chain walker in
    :func:`portable_spec.grammar_stats` (``walks``: ``(request, seconds)`` pairs; ``times``:
    ``(started, tree resolved)`` perf_counter seconds); return what
    :func:`portable_spec.build_host_bitmask` returns for ``mask`` and the valid flags."""
    started, resolved = times
    record_build(
        walks,
        tree.rows,
        wait_seconds=resolved - started,
        walk_seconds=perf_counter() - resolved,
        checked_nodes=checked,
        rejected_nodes=rejected,
    )
    if accepted is None:
        return mask
    return mask, accepted if tree.is_packed else accepted.reshape(tree.batch, tree.nodes)
