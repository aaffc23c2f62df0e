"""Section 1, host mask build: this library against the ways engines build the mask today.

Competitors, all given the same batch in the same round (in a random order per round):

``portable_spec``
    What an engine runs each step: ``GrammarTree.from_host`` (``from_linear_chain`` for
    chains) on the round's fresh ``[batch, nodes]`` int64 arrays, then
    ``build_host_bitmask(..., out=buffer)`` into a buffer reused across rounds. Link
    validation, the row contract and the thread pool are all inside the timing.
``xgr_loop_reused``
    ``GrammarMatcher.traverse_draft_tree`` called request by request on one thread, into a
    reused buffer, with every per-request int64 row and buffer slice prepared untimed. This
    is also the single-thread C++ time ``T1`` of the ideal ``T1 / cores``.
``xgr_loop_fresh``
    The same loop into a buffer allocated per step (``xgrammar.allocate_token_bitmask``).
``python_dfs``
    A recursive depth-first traversal in Python over torch CPU tensors (the algorithm
    sglang 0.5.23 ships: accept the draft token if the parent's row allows it, fill the
    node's row, recurse into the children, roll back), into a fresh all-allowed buffer.

The warm-up round of each configuration checks that ``portable_spec`` and ``python_dfs``
produce identical masks (both leave rejected and unreached rows all-allowed) and that
``python_dfs`` fills exactly the rows the workload generator counted as accepted.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tools.bench.timing import (
    Method,
    QuietPolicy,
    RoundPlan,
    measure_quietly,
    median,
    run_rounds,
    usable_cores,
)
from tools.bench.workloads import Batch, RequestPool, Setup, make_pool

__all__ = [
    "BUILD_LABELS",
    "BUILD_METHODS",
    "BuildGrid",
    "build_methods",
    "python_tree_mask",
    "run_build_config",
    "run_build_section",
    "warm_matchers",
]

BUILD_METHODS = ("portable_spec", "xgr_loop_reused", "xgr_loop_fresh", "python_dfs")
BUILD_LABELS = {
    "portable_spec": "portable_spec (from_host + build, reused out)",
    "xgr_loop_reused": "xgrammar traverse_draft_tree loop, reused buffer",
    "xgr_loop_fresh": "xgrammar traverse_draft_tree loop, fresh buffer",
    "python_dfs": "recursive Python DFS on torch tensors (sglang-like)",
}


@dataclass(frozen=True)
class BuildGrid:
    """The configurations of the build section (every combination is run)."""

    kinds: tuple[str, ...]
    shapes: tuple[str, ...]
    nodes: tuple[int, ...]
    batches: tuple[int, ...]
    topk: int = 4
    on_grammar: float = 0.85
    seed: int = 0

    def configs(self) -> list[tuple[str, str, int, int]]:
        """``(kind, shape, nodes, batch)`` in run order (one pool per kind/shape/nodes)."""
        return list(itertools.product(self.kinds, self.shapes, self.nodes, self.batches))

    def pool_size(self) -> int:
        """Distinct requests per pool: a quarter more than the largest batch (at least 16)."""
        biggest = max(self.batches)
        return max(16, biggest + biggest // 4)


def python_tree_mask(
    matchers: Sequence[Any],
    next_token: Any,
    next_sibling: Any,
    draft_tokens: Any,
    vocab_size: int,
) -> tuple[Any, int]:
    """The plain recursive Python traversal, over torch CPU tensors.

    Args:
        matchers: one ``xgrammar.GrammarMatcher`` per request.
        next_token, next_sibling, draft_tokens: ``[batch, nodes]`` int64 torch tensors.
        vocab_size: the mask covers ``ceil(vocab_size / 32)`` words per row.

    Returns:
        ``(mask, filled)``: a fresh torch int32 ``[batch * nodes, words]`` mask, all-allowed
        except the rows of accepted, non-terminated nodes, and the number of rows filled.
    """
    import xgrammar as xgr

    batch, nodes = draft_tokens.shape
    mask = xgr.allocate_token_bitmask(batch * nodes, vocab_size)
    filled = 0
    for b, matcher in enumerate(matchers):
        filled += _python_walk(
            matcher,
            next_token[b],
            next_sibling[b],
            draft_tokens[b],
            mask[b * nodes : (b + 1) * nodes],
        )
    return mask, filled


def _python_walk(matcher: Any, links: Any, siblings: Any, tokens: Any, rows: Any) -> int:
    """One request of :func:`python_tree_mask`; returns the number of rows filled."""
    if matcher.is_terminated():
        return 0
    filled = 1
    matcher.fill_next_token_bitmask(rows, 0)

    def visit(node: int, parent: int) -> None:
        nonlocal filled
        token = tokens[node]
        if ((rows[parent, token // 32] >> (token % 32)) & 1) == 0:
            return
        if not matcher.accept_token(int(token)):
            return
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(rows, node)
            filled += 1
            child = links[node]
            while child != -1:
                visit(int(child), node)
                child = siblings[child]
        matcher.rollback(1)

    child = links[0]
    while child != -1:
        visit(int(child), 0)
        child = siblings[child]
    return filled


def library_build(
    batch: Batch, vocab_size: int, out: Any, *, chain: bool, **options: Any
) -> Callable[[], Any]:
    """portable_spec's build as an engine runs it every step, on one round's batch: the tree
    from the round's arrays (``from_linear_chain`` when ``chain``), then
    ``build_host_bitmask(..., out=out, **options)``."""
    import portable_spec as ps

    matchers, draft = batch.matchers, batch.draft_tokens
    if chain:
        return lambda: ps.build_host_bitmask(
            matchers, ps.GrammarTree.from_linear_chain(draft), vocab_size, out=out, **options
        )
    links, siblings = batch.next_token, batch.next_sibling
    return lambda: ps.build_host_bitmask(
        matchers, ps.GrammarTree.from_host(links, siblings, draft), vocab_size, out=out, **options
    )


def xgrammar_loop(batch: Batch, reused: np.ndarray) -> Callable[[], np.ndarray]:
    """xgrammar's ``traverse_draft_tree`` request by request on one thread into ``reused``
    (``[batch * nodes, words]`` int32), every per-request array prepared beforehand."""
    n = batch.nodes
    work = [
        (m.traverse_draft_tree, batch.next_token[b], batch.next_sibling[b],
         batch.draft_tokens[b], reused[b * n : (b + 1) * n])
        for b, m in enumerate(batch.matchers)
    ]  # fmt: skip

    def call() -> np.ndarray:
        for traverse, links, siblings, tokens, rows in work:
            traverse(links, siblings, tokens, rows)
        return reused

    return call


def build_methods(
    vocab_size: int, words: int, shape: str, out: np.ndarray, reused: np.ndarray
) -> list[Method[Batch]]:
    """The build competitors of :data:`BUILD_METHODS`, in that order, over one round's
    :class:`Batch`; ``portable_spec`` writes into ``out``, ``xgr_loop_reused`` into
    ``reused`` (both ``[batch * nodes, words]`` int32). Imports torch and xgrammar."""
    import torch
    import xgrammar as xgr

    def ours(batch: Batch) -> Callable[[], Any]:
        return library_build(batch, vocab_size, out, chain=shape == "chain")

    def xgr_reused(batch: Batch) -> Callable[[], Any]:
        return xgrammar_loop(batch, reused)

    def xgr_fresh(batch: Batch) -> Callable[[], Any]:
        n = batch.nodes
        work = [
            (m.traverse_draft_tree, batch.next_token[b], batch.next_sibling[b],
             batch.draft_tokens[b])
            for b, m in enumerate(batch.matchers)
        ]  # fmt: skip
        rows_total = batch.batch * n

        def call() -> Any:
            mask = xgr.allocate_token_bitmask(rows_total, vocab_size)
            host = mask.numpy()
            for b, (traverse, links, siblings, tokens) in enumerate(work):
                traverse(links, siblings, tokens, host[b * n : (b + 1) * n])
            return mask

        return call

    def python_dfs(batch: Batch) -> Callable[[], Any]:
        tensors = [
            torch.from_numpy(a) for a in (batch.next_token, batch.next_sibling, batch.draft_tokens)
        ]
        matchers = batch.matchers
        return lambda: python_tree_mask(matchers, *tensors, vocab_size)

    return [
        Method("portable_spec", ours),
        Method("xgr_loop_reused", xgr_reused),
        Method("xgr_loop_fresh", xgr_fresh),
        Method("python_dfs", python_dfs),
    ]


def warm_matchers(pool: RequestPool, vocab_size: int) -> None:
    """Build once over the whole pool, untimed: the library learns each matcher's bitmask width
    and stop tokens once per matcher (one fill), as an engine does on a request's first step.
    Timed rounds then measure the steady state of long-lived requests."""
    import portable_spec as ps

    tree = ps.GrammarTree.from_host(pool.next_token, pool.next_sibling, pool.draft_tokens)
    ps.build_host_bitmask(pool.matchers, tree, vocab_size)


def run_build_config(
    setup: Setup, pool: RequestPool, batch: int, plan: RoundPlan, *, threads: int
) -> dict[str, Any]:
    """Time the four methods on one configuration; return its result record.

    The record holds, per method, the median seconds and the median cost per accepted node
    (microseconds), the ratios of the medians, the ideal ``T1 / cores`` (``T1`` being the
    single-thread xgrammar loop of this run) and ``portable_spec / ideal``.
    """
    nodes = pool.next_token.shape[1]
    rows = batch * nodes
    out = np.full((rows, setup.words), -1, dtype=np.int32)
    reused = np.full((rows, setup.words), -1, dtype=np.int32)
    methods = build_methods(setup.vocab_size, setup.words, pool.shape, out, reused)
    check: dict[str, Any] = {}

    def on_warmup(data: Batch, results: dict[str, Any]) -> None:
        ours = results["portable_spec"]
        theirs, filled = results["python_dfs"]
        check["masks_identical"] = bool(ours is not None and np.array_equal(ours, theirs.numpy()))
        check["accepted_matches"] = filled == data.accepted

    warm_matchers(pool, setup.vocab_size)
    seconds, inputs = run_rounds(methods, lambda _r: pool.sample(batch), plan, on_warmup=on_warmup)
    accepted = [d.accepted for d in inputs]
    cores = usable_cores()
    med = {name: median(ts) for name, ts in seconds.items()}
    per_node = {
        name: median([t / a * 1e6 for t, a in zip(ts, accepted, strict=True)])
        for name, ts in seconds.items()
    }
    ours = med["portable_spec"]
    ideal = med["xgr_loop_reused"] / cores
    return {
        "kind": pool.kind,
        "shape": pool.shape,
        "nodes": nodes,
        "batch": batch,
        "rounds": len(accepted),
        "cores": cores,
        "threads": threads,
        "accepted_nodes": median(accepted),
        "seconds": med,
        "us_per_accepted_node": per_node,
        "speedup": {name: med[name] / ours for name in med if name != "portable_spec"},
        "ideal_seconds": ideal,
        "ours_over_ideal": ours / ideal,
        **check,
    }


def run_build_section(
    setup: Setup,
    grid: BuildGrid,
    plan_for: Callable[[int, int], RoundPlan],
    *,
    threads: int,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every configuration of ``grid``; ``plan_for(batch, nodes)`` gives its rounds,
    ``policy`` what to do when other processes load the machine, and ``advance(description)``
    is called after each configuration (progress)."""
    policy = policy or QuietPolicy()
    results = []
    pool_key: tuple[str, str, int] | None = None
    pool: RequestPool | None = None
    for kind, shape, nodes, batch in grid.configs():
        if pool_key != (kind, shape, nodes):
            pool = None  # free the previous pool's matchers first
            pool = make_pool(
                setup,
                kind,
                shape,
                nodes,
                grid.pool_size(),
                topk=grid.topk,
                on_grammar=grid.on_grammar,
                seed=grid.seed,
            )
            pool_key = (kind, shape, nodes)
        assert pool is not None
        record, busy = measure_quietly(
            functools.partial(
                run_build_config, setup, pool, batch, plan_for(batch, nodes), threads=threads
            ),
            policy,
        )
        record["other_busy_cores"] = busy
        results.append(record)
        if advance is not None:
            advance(f"build {kind} {shape} n={nodes} bs={batch}")
    return results
