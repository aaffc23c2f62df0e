"""The shared host mask builder: one bitmask row per verify-tree node, for a whole batch.

Data flow of one build::

    tree.resolve()          host int64 links and tokens (waits for the staged copy only)
    classify + validate     every check that can fail, before any matcher moves
    walk requests           on the thread pool: xgrammar C++ traversal, or the Python walk
    fix xgrammar rows       one vectorized pass over node indices (not over the mask)

The result obeys the row contract documented on :func:`build_host_bitmask`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from numbers import Integral
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.engines.generic import walk_generic
from portable_spec.engines.llguidance import fill_llguidance_chains, walk_llguidance
from portable_spec.engines.outlines import walk_outlines
from portable_spec.engines.xgrammar import walk_xgrammar, xgrammar_info
from portable_spec.errors import MatcherError
from portable_spec.grammars import (
    GENERIC,
    LLGUIDANCE,
    NONE,
    OUTLINES,
    XGRAMMAR,
    MatcherInfo,
    _kind_by_type,
    classify_grammars,
    words_for,
)
from portable_spec.pending import check_not_pending, pending_builds
from portable_spec.pool import WorkItemError, get_num_threads, run_indexed
from portable_spec.split import Split, Subtree, plan_split, walk_subtree
from portable_spec.stats import record_build
from portable_spec.topology import Topology
from portable_spec.tree import GrammarTree

__all__ = ["LAYOUTS", "build_host_bitmask", "check_layout", "check_vocab_size"]

ALL_ALLOWED = -1
# Below this many nodes with a grammar, waking pool workers costs more than it saves.
PARALLEL_MIN_NODES = 48
# With fewer requests than threads, trees of at least this many nodes are cut into subtrees
# of at least SPLIT_MIN_PART nodes walked in parallel on forks of the matcher. Forks, path
# replays and waking a worker cost tens of microseconds, so only big trees gain.
SPLIT_MIN_NODES = 256
SPLIT_MIN_PART = 16
# Chains up to INLINE_CHAIN_NODES nodes per request stay on the calling thread up to
# SHORT_CHAIN_FACTOR times more rows: each request's GIL-free work (its K + 1 rows) is too
# short for a second thread to gain, workers would mostly wait for the GIL (measured with 1
# to 8 drafts, batch 8 to 256: the pool was slower in every configuration).
INLINE_CHAIN_NODES = 9
# Up to this many chain requests take the single-function path (see _small_chains).
SMALL_CHAIN_BATCH = 8
SHORT_CHAIN_FACTOR = 64

_scratch = threading.local()

#: mask layouts: one row per node, or only the rows that constrain something (CompactMask)
LAYOUTS = ("dense", "compact")


def check_vocab_size(vocab_size: Any) -> int:
    """Validate ``vocab_size`` (a positive int, numpy ints included) and return it as int."""
    if type(vocab_size) is int and vocab_size > 0:  # the common case, without an ABC check
        return vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, Integral):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    vocab_size = int(vocab_size)
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return vocab_size


def check_layout(layout: Any, max_rows: Any) -> int | None:
    """Validate ``layout`` and ``max_rows`` (compact only: a non-negative int or None); return
    ``max_rows`` as an int or None."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if max_rows is None:
        return None
    if layout != "compact":
        raise ValueError("max_rows bounds a compact mask; it needs layout='compact'")
    if isinstance(max_rows, bool) or not isinstance(max_rows, Integral):
        raise TypeError(f"max_rows must be an int, got {type(max_rows).__name__}")
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0, got {max_rows}")
    return int(max_rows)


def _check_out(out: Any, rows: int, words: int) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy int32 array, got {type(out).__name__}")
    if out.dtype != np.int32:
        raise TypeError(f"out must have dtype int32, got {out.dtype}")
    if out.shape != (rows, words):
        raise ValueError(
            f"out must have shape ({rows}, {words}) (batch * nodes, ceil(vocab_size / 32)), "
            f"got {out.shape}"
        )
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous (rows are handed to C++ as flat memory)")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return out


def _scratch_rows(nodes: int, words: int) -> np.ndarray:
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


def build_host_bitmask(
    grammars: Sequence[Any],
    tree: GrammarTree,
    vocab_size: int,
    *,
    out: Any = None,
    layout: str = "dense",
    max_rows: int | None = None,
    reasoning: Any = None,
    return_valid: bool = False,
) -> Any:
    """Build the grammar bitmask of every node of every request's verify tree, on the host.

    Args:
        grammars: one entry per request: ``None`` (unconstrained), an
            ``xgrammar.GrammarMatcher``, or an object following
            :class:`portable_spec.GrammarMatcherLike`. Each matcher must be in the state after
            the request's committed tokens (node 0's token included).
        tree: the batch's verify trees (:class:`portable_spec.GrammarTree`).
        vocab_size: the model's vocabulary size (the logits' width); at least each matcher's.
        out: optional C-contiguous int32 ``[batch * nodes, ceil(vocab_size / 32)]`` buffer to
            write into instead of allocating (compact: a :class:`CompactMask` of numpy arrays
            with room for every row the build may list: ``max_rows``, or the rows of the
            constrained requests).
        layout: ``"dense"`` (the default: every row) or ``"compact"``: a
            :class:`portable_spec.CompactMask` listing only the rows of accepted,
            non-terminated nodes of constrained requests (``rows`` int32 ``[K]`` ascending,
            ``bits`` int32 ``[K, words]``); every row not listed is all-allowed, and nothing is
            written for it.
        max_rows: compact only: the mask has exactly this many entries (``K`` real ones, then
            padding entries whose row is ``batch * nodes`` and whose bits are not written), so
            its shape does not change from step to step. ``ValueError`` if the build lists
            more (raised after the walks, every matcher back in its state).
        reasoning: a :class:`portable_spec.Reasoning`: requests still reasoning at the root
            get their grammar only below the node that ends the reasoning, per path (rows
            before it allow everything but the content end tokens the grammar refuses first).
            Dense layout only (``ValueError`` with ``layout="compact"``).
        return_valid: also return which nodes the grammars (and the reasoning rule) accept.

    Returns:
        ``None`` when the batch is empty or no request has a grammar (``out`` untouched).
        Otherwise the int32 ``[batch * nodes, ceil(vocab_size / 32)]`` mask (``out`` itself if
        given). Row ``b * nodes + j`` belongs to node ``j`` of request ``b``; bit ``t % 32`` of
        word ``t // 32`` set means token ``t`` is allowed. Node 0 is accepted; node ``j > 0`` is
        accepted iff its parent is accepted and not terminated, ``0 <= token < vocab_size`` and
        the token's bit is set in the parent's row. An accepted, non-terminated node's row is
        the grammar's mask after its root path (bits past the grammar's vocabulary are 0).
        Every other row is all-allowed (-1): unconstrained requests, rejected nodes and their
        subtrees, terminated nodes, and nodes no link reaches. With ``layout="compact"``, a
        host :class:`CompactMask` of those rows (``None`` as above); expanded with
        ``to_dense()`` it equals the dense mask.

        With ``return_valid=True``: ``(mask, valid)``, ``valid`` a bool ``[batch, nodes]``
        array, True for the accepted nodes by the rule above (terminated ones included; every
        node a link reaches for unconstrained requests; never for unreached padding). An
        engine truncates its drafts to the valid prefix with it (no separate validation pass).
        ``(None, valid)`` when no request has a grammar.

    Raises:
        TypeError, ValueError: malformed tree, grammars, ``vocab_size`` or ``out``; raised
            before any matcher moves.
        MatcherError: a matcher raised during its walk (``request_index`` names it; the
            original exception is chained). Every matcher is back in its starting state.

    Blocks the calling thread until the mask is complete (it waits for the tree's staged copy
    first). Requests are spread over the library's thread pool (:func:`set_num_threads`).
    Every matcher ends in the state it started in.
    """
    if not isinstance(tree, GrammarTree):
        raise TypeError(f"tree must be a portable_spec.GrammarTree, got {type(tree).__name__}")
    if reasoning is None and tree.is_chain and layout == "dense" and max_rows is None:
        done = _small_chains(grammars, tree, vocab_size, out, return_valid)
        if done is not None:
            return done
    vocab_size = check_vocab_size(vocab_size)
    max_rows = check_layout(layout, max_rows)
    batch, nodes = tree.batch, tree.nodes
    packed = tree.is_packed
    if packed and layout != "dense":
        raise ValueError(
            "packed chains (GrammarTree.from_packed_chains) build dense masks only; "
            "use layout='dense'"
        )
    if reasoning is not None:
        from portable_spec.reasoning import build_with_reasoning

        if layout != "dense":
            raise ValueError("reasoning= builds dense masks only; use layout='dense'")
        words = words_for(vocab_size)
        if out is not None:
            _check_out(out, tree.rows, words)
        return build_with_reasoning(
            build_host_bitmask, grammars, tree, vocab_size, words, reasoning, out, return_valid
        )
    kinds, infos = classify_grammars(grammars, batch, vocab_size)
    check_not_pending(grammars)
    constrained = [b for b, kind in enumerate(kinds) if kind != NONE]
    if not constrained:
        if return_valid:
            tree.validate()
            return None, per_node(tree, tree.topology().reachable)
        return None
    if layout == "compact":
        from portable_spec.compact import build_compact_bitmask

        return build_compact_bitmask(
            grammars,
            tree,
            vocab_size,
            kinds,
            infos,
            constrained,
            out=out,
            max_rows=max_rows,
            return_valid=return_valid,
        )
    words = words_for(vocab_size)
    rows = tree.rows
    mask = _check_out(out, rows, words) if out is not None else np.empty((rows, words), np.int32)
    started = perf_counter()
    if _inline(kinds, constrained, tree, return_valid):
        return _build_inline(grammars, kinds, infos, tree, mask, vocab_size, return_valid, started)
    next_token, next_sibling, draft = tree.resolve()
    resolved = perf_counter()
    tree.validate()

    root_ok = np.ones(batch, dtype=bool)
    # per request: draft nodes checked against the grammar, and those it refused
    counts = np.zeros((batch, 2), dtype=np.int64)
    splits = {}
    if not packed and nodes >= SPLIT_MIN_NODES:
        splits = _plan_splits(kinds, constrained, tree, next_token, next_sibling, draft, grammars)
    # return_valid: written by the jobs themselves when every request is an xgrammar one
    # repaired in its job (the compiled helper) or unconstrained on a chain (every node
    # reached); else derived after the walks from ``live``, the rows of accepted,
    # non-terminated nodes.
    accepted = live = None
    if return_valid:
        if _jobs_write_valid(kinds, splits, tree):
            accepted = np.empty(rows, dtype=bool)
        else:
            live = np.zeros(rows, dtype=bool)
    spans = tree.spans()
    jobs, owners = _make_jobs(
        grammars,
        kinds,
        infos,
        (next_token, next_sibling, draft),
        mask,
        root_ok,
        counts,
        splits,
        vocab_size,
        tree.is_chain,
        live,
        spans,
        accepted,
    )
    constrained_rows = len(constrained) * nodes
    if packed:
        constrained_rows = sum(spans[b][1] for b in constrained)
    parallel = bool(splits) or constrained_rows >= PARALLEL_MIN_NODES
    seconds = run_jobs(jobs, owners, parallel)
    # Rows of xgrammar requests not already repaired inside their job (no compiled helper,
    # or a request split over several walks) are repaired here, vectorized over the batch.
    in_job = compiled.native is not None
    pending = [b for b in constrained if kinds[b] == XGRAMMAR and (not in_job or b in splits)]
    if pending and packed:
        _rewrite_packed(mask, tree, draft, infos, root_ok, vocab_size, pending, counts)
    elif pending:
        topology = tree.topology()
        rewrite = _rewrite_small if topology.small else _rewrite_large
        rewrite(mask, topology, draft, kinds, infos, root_ok, vocab_size, pending, counts)
    valid = None
    if live is not None:
        valid = _valid_nodes(mask, tree, draft, kinds, infos, root_ok, vocab_size, live)
    elif accepted is not None:
        valid = accepted if packed else accepted.reshape(batch, nodes)
    account(constrained, owners, seconds, counts, rows, (started, resolved))
    return mask if valid is None else (mask, valid)


def _small_chains(
    grammars: Any, tree: GrammarTree, vocab_size: Any, out: Any, return_valid: bool
) -> Any:
    """The most common small call in one function: a few ``from_linear_chain`` requests of
    plain xgrammar matchers already probed at the model's width, nothing pending, a valid
    ``out`` (or none). Walks and repairs each request on the calling thread like
    :func:`_build_inline`, touching as little Python as possible (a batch-1 call is dominated
    by it when the caches are cold). Returns ``None`` whenever anything is unusual: the general
    path then checks everything and raises what it must."""
    native = compiled.native
    batch, nodes = tree.batch, tree.nodes
    if (
        native is None
        or type(grammars) is not list
        or len(grammars) != batch
        or not 0 < batch <= SMALL_CHAIN_BATCH
        or nodes > INLINE_CHAIN_NODES
        or type(vocab_size) is not int
        or vocab_size <= 0
        or pending_builds()
        or (return_valid and not _repair_writes_valid())
    ):
        return None
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
    rows = batch * nodes
    if out is None:
        mask = np.empty((rows, words), dtype=np.int32)
    elif (
        type(out) is np.ndarray
        and out.dtype == np.int32
        and out.shape == (rows, words)
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        mask = out
    else:
        return None
    started = perf_counter()
    next_token, next_sibling, draft = tree.resolve()
    resolved = perf_counter()
    accepted = np.empty((batch, nodes), dtype=bool) if return_valid else None
    repair = native.repair_rows
    walks = []
    checked = rejected = 0
    began = resolved
    for b, matcher in enumerate(grammars):
        info = infos[b]
        block = mask[b * nodes : (b + 1) * nodes]
        nt, ns, dt = next_token[b], next_sibling[b], draft[b]
        limit = min(vocab_size, info.vocab_size)
        try:
            live = 0
            if not matcher.is_terminated():
                matcher.traverse_draft_tree(nt, ns, dt, block)
                live = 1
            if accepted is None:
                _, c, r = repair(block, nt, ns, dt, limit, info.stop_ids, live)
            else:
                _, c, r = repair(block, nt, ns, dt, limit, info.stop_ids, live, accepted[b])
        except BaseException as exc:
            raise MatcherError(b, exc) from exc
        checked += c
        rejected += r
        ended = perf_counter()
        walks.append((b, ended - began))
        began = ended
    record_build(
        walks,
        rows,
        wait_seconds=resolved - started,
        walk_seconds=perf_counter() - resolved,
        checked_nodes=checked,
        rejected_nodes=rejected,
    )
    return mask if accepted is None else (mask, accepted)


def _inline(kinds: list[int], constrained: list[int], tree: GrammarTree, valid: bool) -> bool:
    """Whether a build is small and simple enough for :func:`_build_inline`: the compiled
    helper, few rows or short chains (no pool), no tree big enough to split, xgrammar
    requests only (and unconstrained ones, on chains when the valid flags are asked for)."""
    if compiled.native is None or tree.nodes >= SPLIT_MIN_NODES:
        return False
    if valid and not _repair_writes_valid():
        return False
    chains = tree.is_chain or tree.is_packed
    limit = PARALLEL_MIN_NODES
    if chains and tree.nodes <= INLINE_CHAIN_NODES:
        limit *= SHORT_CHAIN_FACTOR
    if len(constrained) * tree.nodes >= limit:
        return False
    allowed = (XGRAMMAR, NONE) if chains or not valid else (XGRAMMAR,)
    return set(kinds).issubset(allowed)


def _build_inline(
    grammars: Sequence[Any],
    kinds: list[int],
    infos: list[MatcherInfo | None],
    tree: GrammarTree,
    mask: np.ndarray,
    vocab_size: int,
    return_valid: bool,
    started: float,
) -> Any:
    """The build of a small batch of xgrammar requests on the calling thread, request after
    request: the C++ traversal, then the compiled repair writing the counts and valid flags
    (both release the GIL); no job objects, no pool, no pass over the mask afterwards. Same
    result, checks and accounting as the general path."""
    next_token, next_sibling, draft = tree.resolve()
    resolved = perf_counter()
    tree.validate()
    spans = tree.spans()
    accepted = np.empty(tree.rows, dtype=bool) if return_valid else None
    repair = compiled.native.repair_rows  # type: ignore[union-attr]
    words = mask.shape[1]
    walks = []
    checked = rejected = 0
    full = tree.nodes
    began = perf_counter()
    for b, kind in enumerate(kinds):
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
            target = block if info.words == words else _scratch_rows(n, info.words)
            live = int(walk_xgrammar(grammars[b], nt, ns, dt, target))
            if target is not block:
                _copy_rows(block, target, info.words, None)
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


def _jobs_write_valid(kinds: list[int], splits: dict[int, Any], tree: GrammarTree) -> bool:
    """Whether the jobs can write ``return_valid``'s flags themselves (see the build)."""
    if compiled.native is None or splits or not _repair_writes_valid():
        return False
    allowed = (XGRAMMAR, NONE) if tree.is_chain or tree.is_packed else (XGRAMMAR,)
    return set(kinds).issubset(allowed)


def _repair_writes_valid() -> bool:
    """Whether the compiled helper's ``repair_rows`` takes the ``valid`` output (a build of
    the helper older than the library's sources does not: the numpy pass is used then)."""
    return bool(getattr(compiled.native, "REPAIR_VALID", 0))


def _allow_all(block: np.ndarray, accepted: np.ndarray) -> None:
    """An unconstrained chain request: every row all-allowed, every node accepted."""
    block.fill(ALL_ALLOWED)
    accepted.fill(True)


def run_jobs(jobs: list[Callable[[], None]], owners: list[int], parallel: bool) -> list[float]:
    """Run a build's jobs (on the pool when ``parallel`` and there are several) and return
    each one's seconds; a failing job raises :class:`MatcherError` naming its request
    (``owners[i]`` for job ``i``, unless the job named it itself)."""
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


def _make_jobs(
    grammars: Sequence[Any],
    kinds: list[int],
    infos: list[MatcherInfo | None],
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
    mask: np.ndarray,
    root_ok: np.ndarray,
    counts: np.ndarray,
    splits: dict[int, tuple[Split, list[Any]]],
    vocab_size: int,
    chains: bool,
    live: np.ndarray | None,
    spans: list[tuple[int, int]],
    accepted: np.ndarray | None = None,
) -> tuple[list[Callable[[], None]], list[int]]:
    """One job per request (several for a split request), one job for all requests walked in
    Python, one per llguidance width for chains; and the (first) request of each job.

    Jobs that decide which nodes the grammar accepts write ``counts[b]`` (draft nodes
    checked, refused); the others leave it to the row repair after the walks. Request ``b``'s
    rows are ``mask[start:start + n]`` for ``(start, n) = spans[b]``, its nodes the first ``n``
    of its links. ``accepted`` (flat bool ``[rows]``, see :func:`_jobs_write_valid`) receives
    which nodes the grammars accept, written by the jobs."""
    next_token, next_sibling, draft = arrays
    jobs: list[Callable[[], None]] = []
    owners: list[int] = []
    walks: list[tuple[int, Callable[[], None]]] = []  # Python walks: they hold the GIL
    llguidance = [b for b, kind in enumerate(kinds) if kind == LLGUIDANCE]
    if chains and llguidance:  # llguidance's executor fills chains in parallel itself
        for width in sorted({infos[b].words for b in llguidance}):  # type: ignore[union-attr]
            group = {b: grammars[b] for b in llguidance if infos[b].words == width}  # type: ignore[union-attr]
            job = partial(
                fill_llguidance_chains, group, width, draft, mask, vocab_size, counts, live=live
            )
            jobs.append(partial(_llguidance_chain_job, job, group))
            owners.append(next(iter(group)))
    for b, kind in enumerate(kinds):
        start, n = spans[b]
        block = mask[start : start + n]
        info: MatcherInfo = infos[b]  # type: ignore[assignment]
        if kind == NONE and accepted is not None:
            jobs.append(partial(_allow_all, block, accepted[start : start + n]))
        elif kind == NONE:
            jobs.append(partial(block.fill, ALL_ALLOWED))
        elif kind == LLGUIDANCE and chains:
            continue
        elif kind in _PYTHON_WALKS:
            lists = (
                next_token[b, :n].tolist(),
                next_sibling[b, :n].tolist(),
                draft[b, :n].tolist(),
            )
            limit = min(vocab_size, info.vocab_size)
            if kind == OUTLINES:
                _check_depth(b, lists[0], lists[1], info)
            walk = _PYTHON_WALKS[kind]
            job = partial(_walk_job, walk, grammars[b], lists, block, info, limit, counts[b])
            if live is not None:
                job = partial(job, live=live[start : start + n])
            walks.append((b, job))
            continue
        elif b not in splits:
            links = (next_token[b, :n], next_sibling[b, :n], draft[b, :n])
            if compiled.native is not None:
                limit = min(vocab_size, info.vocab_size)
                job = partial(_xgrammar_repaired_job, grammars[b], links, block, info, limit)
                flags = None if accepted is None else accepted[start : start + n]
                jobs.append(partial(job, counts[b], root_ok, b, flags))
            else:
                job = partial(_xgrammar_job, grammars[b], links, block, info, root_ok, b, None)
                jobs.append(job)
        else:
            plan, forks = splits[b]
            limit = min(vocab_size, info.vocab_size)
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
    return jobs, owners


def _copy_rows(block: np.ndarray, target: np.ndarray, words: int, rows: list[int] | None) -> None:
    """Copy a narrower matcher's rows into the mask (zeros past its width)."""
    if rows is None:
        block[:, :words] = target
        block[:, words:] = 0
    else:
        block[rows, :words] = target[rows]
        block[rows, words:] = 0


def _xgrammar_job(
    matcher: Any,
    links: tuple[np.ndarray, np.ndarray, np.ndarray],
    block: np.ndarray,
    info: MatcherInfo,
    root_ok: np.ndarray,
    b: int,
    owned_rows: list[int] | None,
) -> None:
    """Walk one request (or, with ``owned_rows``, the part of it left after cutting
    subtrees out) with xgrammar's C++ traversal."""
    nodes, words = block.shape
    target = block if info.words == words else _scratch_rows(nodes, info.words)
    root_ok[b] = walk_xgrammar(matcher, *links, target)
    if target is not block:
        _copy_rows(block, target, info.words, owned_rows)


def _xgrammar_repaired_job(
    matcher: Any,
    links: tuple[np.ndarray, np.ndarray, np.ndarray],
    block: np.ndarray,
    info: MatcherInfo,
    limit: int,
    counts: np.ndarray,
    root_ok: np.ndarray,
    b: int,
    accepted: np.ndarray | None = None,
) -> None:
    """Walk one request with xgrammar's C++ traversal, then repair its rows in place with the
    compiled helper (both release the GIL); store its (checked, refused) node counts, and
    which nodes the grammar accepts into ``accepted`` (its ``[nodes]`` flags) if given."""
    nodes, words = block.shape
    target = block if info.words == words else _scratch_rows(nodes, info.words)
    live = root_ok[b] = walk_xgrammar(matcher, *links, target)
    if target is not block:
        _copy_rows(block, target, info.words, None)
    repair = compiled.native.repair_rows  # type: ignore[union-attr]
    if accepted is None:
        _, counts[0], counts[1] = repair(block, *links, limit, info.stop_ids, int(live))
    else:
        _, counts[0], counts[1] = repair(block, *links, limit, info.stop_ids, int(live), accepted)


def _subtree_job(fork: Any, sub: Subtree, block: np.ndarray, info: MatcherInfo, limit: int) -> None:
    """Walk a subtree cut out of a request on a fork of its matcher; write its rows."""
    k = len(sub.nodes)
    scratch = _scratch_rows(k, info.words)
    if walk_subtree(fork, sub, scratch, limit):
        block[sub.nodes, : info.words] = scratch
        if info.words < block.shape[1]:
            block[sub.nodes, info.words :] = 0


_PYTHON_WALKS = {GENERIC: walk_generic, LLGUIDANCE: walk_llguidance, OUTLINES: walk_outlines}


def _walk_requests(walks: list[tuple[int, Callable[[], None]]]) -> None:
    """Run the Python walks one after the other; a failure names its request (each walk has
    already restored its matcher, and later ones have not moved theirs)."""
    for b, walk in walks:
        try:
            walk()
        except BaseException as exc:
            raise MatcherError(b, exc) from exc


def _llguidance_chain_job(fill: Callable[[int], None], matchers: dict[int, Any]) -> None:
    """Fill llguidance chains; a matcher found broken afterwards is reported by its request
    index (the executor cannot say which one failed)."""
    try:
        fill(get_num_threads())
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


def _walk_job(
    walk: Callable[..., tuple[list[bool], int, int]],
    matcher: Any,
    lists: tuple[list[int], list[int], list[int]],
    block: np.ndarray,
    info: MatcherInfo,
    limit: int,
    counts: np.ndarray,
    live: np.ndarray | None = None,
) -> None:
    """Walk one request with a Python walk (protocol matchers, llguidance trees, outlines-core
    guides); rows it does not fill become -1; ``live`` (its rows) marks the filled ones."""
    nodes, words = block.shape
    target = block if info.words == words else _scratch_rows(nodes, info.words)
    filled, counts[0], counts[1] = walk(matcher, *lists, target, limit)
    if live is not None:
        live[:] = filled
    if target is not block:
        _copy_rows(block, target, info.words, None)
    if info.vocab_size % 32:
        # a foreign matcher may leave bits past its vocabulary set; the contract says 0
        block[:, info.words - 1] &= np.int32((1 << (info.vocab_size % 32)) - 1)
    block[~np.asarray(filled)] = ALL_ALLOWED


def _plan_splits(
    kinds: list[int],
    constrained: list[int],
    tree: GrammarTree,
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    grammars: Sequence[Any],
) -> dict[int, tuple[Split, list[Any]]]:
    """Cut large xgrammar trees into subtrees when there are fewer requests than threads.

    Each request gets about ``threads / requests`` pieces. Returns, per split request, the
    split and one fork of the matcher per subtree, taken now, before any walk moves the
    matcher.
    """
    threads = get_num_threads()
    if threads < 2 or len(constrained) >= threads or tree.nodes < SPLIT_MIN_NODES:
        return {}
    parts = threads // len(constrained)
    if parts < 2:
        return {}
    plans = {}
    for b in constrained:
        if kinds[b] != XGRAMMAR:
            continue
        nt, ns, dt = next_token[b].tolist(), next_sibling[b].tolist(), draft[b].tolist()
        split = plan_split(nt, ns, dt, parts, SPLIT_MIN_PART)
        if split is not None:
            plans[b] = (split, [grammars[b].fork() for _ in split.subtrees])
    return plans


# Which xgrammar rows to rewrite follows from node indices alone. xgrammar zeroes the rows of
# rejected and terminated nodes and leaves unreached rows untouched; a node keeps its row iff
# every node on its root path passes the local test "token in range, bit set in the parent's
# row, token not a stop token" (and the matcher was not terminated at the root). Reading the
# parent's word is only meaningful when the parent kept its row, which is why the test is
# ANDed down root paths. Cost: one word read per node, never a pass over a row's words.


def _rewrite_small(
    mask: np.ndarray,
    topology: Topology,
    draft: np.ndarray,
    kinds: list[int],
    infos: list[MatcherInfo | None],
    root_ok: np.ndarray,
    vocab_size: int,
    requests: list[int],
    counts: np.ndarray,
    write: bool = True,
) -> np.ndarray:
    """List version for small trees: parents come before children in ``topology.orders``.
    Returns which rows (of ``requests``) keep a grammar row; ``write=False`` only says so."""
    nodes = topology.nodes
    words = mask.shape[1]
    flat = mask.reshape(-1)
    orders, parents = topology.orders, topology.local_parents
    assert orders is not None and parents is not None
    tokens = draft.tolist()
    rewrite: list[int] = []
    kept = np.zeros(mask.shape[0], dtype=bool)
    for b in requests:
        base = b * nodes
        keep = [False] * nodes
        if root_ok[b]:
            info: MatcherInfo = infos[b]  # type: ignore[assignment]
            limit = min(vocab_size, info.vocab_size)
            stops = info.stop_set
            order, parent, token = orders[b], parents[b], tokens[b]
            keep[0] = True
            checked = rejected = 0
            for i in range(1, len(order)):
                v = order[i]
                p = parent[v]
                if keep[p]:
                    t = token[v]
                    checked += 1
                    if (
                        0 <= t < limit
                        and (int(flat[(base + p) * words + (t >> 5)]) >> (t & 31)) & 1
                    ):
                        keep[v] = t not in stops
                    else:
                        rejected += 1
            counts[b] = checked, rejected
        rewrite.extend(base + v for v in range(nodes) if not keep[v])
        kept[base : base + nodes] = keep
    if rewrite and write:
        mask[rewrite] = ALL_ALLOWED
    return kept


def _rewrite_large(
    mask: np.ndarray,
    topology: Topology,
    draft: np.ndarray,
    kinds: list[int],
    infos: list[MatcherInfo | None],
    root_ok: np.ndarray,
    vocab_size: int,
    requests: list[int],
    counts: np.ndarray,
    write: bool = True,
) -> np.ndarray:
    """Vectorized version: the local test for every node at once, then ANDed down root
    paths by pointer jumping (``topology.ancestor_jumps``). Returns which rows (of
    ``requests``) keep a grammar row; ``write=False`` only says so."""
    batch, nodes = topology.batch, topology.nodes
    total = batch * nodes
    words = mask.shape[1]
    flat = mask.reshape(-1)
    tokens = draft.reshape(-1)

    limits = {min(vocab_size, infos[b].vocab_size) for b in requests}  # type: ignore[union-attr]
    if len(limits) == 1:
        limit: Any = limits.pop()
    else:
        per_request = np.zeros(batch, dtype=np.int64)
        for b in requests:
            per_request[b] = min(vocab_size, infos[b].vocab_size)  # type: ignore[union-attr]
        limit = np.repeat(per_request, nodes)
    in_range = (tokens >= 0) & (tokens < limit)
    safe_tokens = np.where(in_range, tokens, 0)
    parent = topology.parent
    word = flat[np.where(parent >= 0, parent, 0) * words + (safe_tokens >> 5)]
    keep = np.empty(total + 1, dtype=bool)
    local = keep[:total]
    np.not_equal((word >> (safe_tokens & 31)) & 1, 0, out=local)
    local &= in_range
    local &= parent >= 0
    allowed = local.copy()  # the grammar allows the token (stop tokens included)

    stop_groups: dict[frozenset[int], list[int]] = {}
    for b in requests:
        stop_groups.setdefault(infos[b].stop_set, []).append(b)  # type: ignore[union-attr]
    for stop_set, members in stop_groups.items():
        if not stop_set:
            continue
        if len(stop_groups) == 1:
            node_rows = slice(None)
        else:
            node_rows = (np.asarray(members)[:, None] * nodes + np.arange(nodes)).ravel()
        group_tokens = tokens[node_rows]
        is_stop = group_tokens == next(iter(stop_set))
        for stop in list(stop_set)[1:]:
            is_stop |= group_tokens == stop
        local[node_rows] &= ~is_stop

    local[::nodes] = root_ok
    keep[total] = True  # the sentinel every root path ends in
    for jump in topology.ancestor_jumps or ():
        keep &= keep[jump]

    # checked: the parent kept its row (accepted, live); refused: ... and the token not allowed
    checked = (parent >= 0) & keep[np.where(parent >= 0, parent, total)]
    refused = checked & ~allowed
    selected = np.asarray(requests)
    counts[selected, 0] = checked.reshape(batch, nodes)[selected].sum(axis=1)
    counts[selected, 1] = refused.reshape(batch, nodes)[selected].sum(axis=1)

    is_xgrammar = np.repeat(np.asarray(kinds) == XGRAMMAR, nodes)
    rewrite = np.flatnonzero(~local & is_xgrammar)
    if rewrite.size and write:
        mask[rewrite] = ALL_ALLOWED
    return local & is_xgrammar


def _valid_nodes(
    mask: np.ndarray,
    tree: GrammarTree,
    draft: np.ndarray,
    kinds: list[int],
    infos: list[MatcherInfo | None],
    root_ok: np.ndarray,
    vocab_size: int,
    live: np.ndarray,
) -> np.ndarray:
    """bool ``[batch, nodes]``: the accepted nodes. ``live`` marks the accepted,
    non-terminated nodes of the Python walks and llguidance chains; xgrammar's are read off
    the finished rows by the repair rule (kept rows are untouched by the repair). A node is
    accepted when it is a root, or its parent is live, its token in range and allowed by the
    parent's row; unconstrained requests accept every node a link reaches. Packed chains:
    a flat bool ``[rows]``."""
    batch, nodes = tree.batch, tree.nodes
    if tree.is_packed:
        return _valid_packed(mask, tree, draft, kinds, infos, root_ok, vocab_size, live)
    topology = tree.topology()
    xgrammar = [b for b, kind in enumerate(kinds) if kind == XGRAMMAR]
    if xgrammar:
        rewrite = _rewrite_small if topology.small else _rewrite_large
        scratch = np.zeros((batch, 2), dtype=np.int64)
        kept = rewrite(
            mask, topology, draft, kinds, infos, root_ok, vocab_size, xgrammar, scratch, False
        )
        rows = (np.asarray(xgrammar)[:, None] * nodes + np.arange(nodes)).ravel()
        live[rows] = kept[rows]
    parent = topology.parent
    tokens = draft.reshape(-1)
    has_parent = parent >= 0
    safe = np.where((tokens >= 0) & (tokens < vocab_size), tokens, 0)
    word = mask[np.where(has_parent, parent, 0), safe >> 5]
    allowed = ((word >> (safe & 31)) & 1).astype(bool) & (tokens >= 0) & (tokens < vocab_size)
    valid = has_parent & live[np.where(has_parent, parent, 0)] & allowed
    valid[::nodes] = True
    unconstrained = np.repeat(np.asarray(kinds) == NONE, nodes)
    valid[unconstrained] = topology.reachable[unconstrained]
    return valid.reshape(batch, nodes)


def per_node(tree: GrammarTree, padded: np.ndarray) -> np.ndarray:
    """A per-node bool ``[batch * nodes]`` over the tree's resolved (padded) arrays, in the
    shape ``return_valid`` gives: ``[batch, nodes]``, or ``[rows]`` for packed chains."""
    grid = padded.reshape(tree.batch, tree.nodes)
    if not tree.is_packed:
        return grid.copy()
    lengths = np.diff(tree.offsets)
    flags = np.zeros(tree.rows, dtype=bool)
    flags[_positions(tree)] = grid[np.arange(tree.nodes)[None, :] < lengths[:, None]]
    return flags


def _positions(tree: GrammarTree) -> np.ndarray:
    """Packed chains: the mask row of each packed node (its index among ``tokens`` for
    trees of :meth:`GrammarTree.from_packed_chains`; the rows of their spans in general)."""
    offsets = tree.offsets
    assert offsets is not None
    starts = np.array([start for start, _ in tree.spans()], dtype=np.int64)
    return np.arange(int(offsets[-1]), dtype=np.int64) + np.repeat(
        starts - offsets[:-1], np.diff(offsets)
    )


def _packed_rows(tree: GrammarTree, draft: np.ndarray) -> tuple[np.ndarray, ...]:
    """Packed chains, per packed node: ``(request, parent node or -1, token, first nodes,
    mask row)``."""
    offsets = tree.offsets
    assert offsets is not None
    starts = offsets[:-1]
    lengths = np.diff(offsets)
    request = np.repeat(np.arange(tree.batch), lengths)
    parent = np.arange(-1, int(offsets[-1]) - 1, dtype=np.int64)
    parent[starts] = -1
    tokens = draft[np.arange(tree.nodes)[None, :] < lengths[:, None]]
    return request, parent, tokens, starts, _positions(tree)


def _rewrite_packed(
    mask: np.ndarray,
    tree: GrammarTree,
    draft: np.ndarray,
    infos: list[MatcherInfo | None],
    root_ok: np.ndarray,
    vocab_size: int,
    requests: list[int],
    counts: np.ndarray,
    write: bool = True,
) -> np.ndarray:
    """The row repair of packed chains (each row's parent is the row before it): the local
    test per row, ANDed along each chain by a running count of failures. Returns which rows
    (of ``requests``) keep a grammar row; ``write=False`` only says so."""
    request, parent, tokens, starts, position = _packed_rows(tree, draft)
    words = mask.shape[1]
    selected = np.zeros(tree.batch, dtype=bool)
    selected[requests] = True
    limits = np.zeros(tree.batch, dtype=np.int64)
    for b in requests:
        limits[b] = min(vocab_size, infos[b].vocab_size)  # type: ignore[union-attr]
    limit = limits[request]
    in_range = (tokens >= 0) & (tokens < limit)
    safe = np.where(in_range, tokens, 0)
    has_parent = parent >= 0
    parent_row = position[np.where(has_parent, parent, 0)]
    word = mask.reshape(-1)[parent_row * words + (safe >> 5)]
    allowed = ((word >> (safe & 31)) & 1).astype(bool) & in_range & has_parent
    local = allowed.copy()
    for b in requests:
        stops = infos[b].stop_ids  # type: ignore[union-attr]
        if len(stops):
            rows = slice(int(tree.offsets[b]), int(tree.offsets[b + 1]))  # type: ignore[index]
            local[rows] &= ~np.isin(tokens[rows], stops)
    local[starts] = root_ok
    local &= selected[request]
    failed = ~local
    running = np.cumsum(failed)
    before = running[starts] - failed[starts]
    keep = running == before[request]
    checked = has_parent & keep[np.where(has_parent, parent, 0)]
    refused = checked & ~allowed
    counts[requests, 0] = np.bincount(request, checked, minlength=tree.batch)[requests]
    counts[requests, 1] = np.bincount(request, refused, minlength=tree.batch)[requests]
    if write:
        rewrite = np.flatnonzero(selected[request] & ~keep)
        if rewrite.size:
            mask[position[rewrite]] = ALL_ALLOWED
    return keep


def _valid_packed(
    mask: np.ndarray,
    tree: GrammarTree,
    draft: np.ndarray,
    kinds: list[int],
    infos: list[MatcherInfo | None],
    root_ok: np.ndarray,
    vocab_size: int,
    live: np.ndarray,
) -> np.ndarray:
    """:func:`_valid_nodes` for packed chains: flat bool ``[rows]`` (mask rows; ``live`` too)."""
    request, parent, tokens, starts, position = _packed_rows(tree, draft)
    is_kind = np.asarray(kinds)[request]
    xgrammar = [b for b, kind in enumerate(kinds) if kind == XGRAMMAR]
    if xgrammar:
        scratch = np.zeros((tree.batch, 2), dtype=np.int64)
        kept = _rewrite_packed(
            mask, tree, draft, infos, root_ok, vocab_size, xgrammar, scratch, False
        )
        rows = is_kind == XGRAMMAR
        live[position[rows]] = kept[rows]
    has_parent = parent >= 0
    in_range = (tokens >= 0) & (tokens < vocab_size)
    safe = np.where(in_range, tokens, 0)
    parent_row = position[np.where(has_parent, parent, 0)]
    word = mask[parent_row, safe >> 5]
    allowed = ((word >> (safe & 31)) & 1).astype(bool) & in_range
    valid = has_parent & live[parent_row] & allowed
    valid[starts] = True
    valid[is_kind == NONE] = True
    flags = np.zeros(tree.rows, dtype=bool)
    flags[position] = valid
    return flags
