"""Section ``thresholds``: where walking on one thread stops paying, per vocabulary, in the
route table's units of work (``portable_spec.builder.routes.work``: rows x (words +
ROW_WORDS)).

For each vocabulary, xgrammar matchers of the sample JSON schema (the bench's request pools):

* chains: ``build_chain_bitmask`` (vLLM's strided layout, K drafts + 1 bonus row per request)
  at several batch sizes, with the route table forced to one thread (``ONE_THREAD_WORK`` at
  infinity) and forced to parts on the pool (``ONE_THREAD_WORK`` 0); vLLM's serial per-token
  fill beside them;
* trees: ``build_host_bitmask`` over ``from_host`` EAGLE-like trees, the same two ways
  (one thread: the one-call row; parts: the walk table on the pool).

Every call starts with cold caches (a 32 MiB write right before, as a forward pass leaves
them). ``one / parts`` above 1: the parts are faster. The crossover, read in units of work, is
what ``ONE_THREAD_WORK`` is set from; the one-thread time per row across the vocabularies is
what ``ROW_WORDS`` is fitted to (``us/row`` against the mask words).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tools.bench.timing import (
    Method,
    QuietPolicy,
    RoundPlan,
    cache_evictor,
    measure_quietly,
    median,
    run_rounds,
)
from tools.bench.workloads import Setup, make_pool

__all__ = ["run_thresholds_section", "thresholds_table"]

CHAIN_DRAFTS = (1, 4)
CHAIN_BATCHES = (8, 16, 32, 64, 128)
TREE_NODES = 16
TREE_BATCHES = (2, 4, 8, 16, 32, 64)


def _forced(value: int, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with the route table's ``ONE_THREAD_WORK`` set to ``value`` while it runs."""
    from portable_spec.builder import routes

    def run() -> Any:
        saved = routes.ONE_THREAD_WORK
        routes.ONE_THREAD_WORK = value
        try:
            return call()
        finally:
            routes.ONE_THREAD_WORK = saved

    return run


def _chain_record(setup: Setup, pool: Any, k: int, batch: int, plan: RoundPlan) -> dict[str, Any]:
    import xgrammar as xgr

    import portable_spec as ps
    from portable_spec.builder import routes
    from tools.bench.chains import serial_fill

    rows = batch * (k + 1)
    out = np.full((rows, setup.words), -1, dtype=np.int32)
    bitmask = xgr.allocate_token_bitmask(rows, setup.vocab_size)
    evict = cache_evictor()

    def ours(value: int) -> Callable[[Any], Callable[[], Any]]:
        def prepare(data: Any) -> Callable[[], Any]:
            call = _forced(
                value,
                lambda: ps.build_chain_bitmask(
                    data.matchers, data.drafts, setup.vocab_size, rows_per_request=k + 1,
                    out=out, return_valid=True,
                ),
            )  # fmt: skip
            evict()
            return call

        return prepare

    def serial(data: Any) -> Callable[[], Any]:
        evict()
        return lambda: serial_fill(data, bitmask, k, frozenset())

    methods = [
        Method("one", ours(10**18)),
        Method("parts", ours(0)),
        Method("serial_fill", serial),
    ]
    seconds, inputs = run_rounds(methods, lambda _r: pool.sample(batch), plan)
    med = {name: median(ts) for name, ts in seconds.items()}
    return {
        "shape": "chain",
        "k": k,
        "batch": batch,
        "rows": rows,
        "words": setup.words,
        "work": routes.work(rows, setup.words),
        "rounds": len(inputs),
        "seconds": med,
        "one_over_parts": med["one"] / med["parts"],
        "us_per_row_one": med["one"] / rows * 1e6,
    }


def _tree_record(setup: Setup, pool: Any, batch: int, plan: RoundPlan) -> dict[str, Any]:
    import portable_spec as ps
    from portable_spec.builder import routes
    from tools.bench.build import xgrammar_loop

    nodes = pool.next_token.shape[1]
    rows = batch * nodes
    out = np.full((rows, setup.words), -1, dtype=np.int32)
    reused = np.full((rows, setup.words), -1, dtype=np.int32)
    evict = cache_evictor()

    def ours(value: int) -> Callable[[Any], Callable[[], Any]]:
        def prepare(data: Any) -> Callable[[], Any]:
            links = (data.next_token, data.next_sibling, data.draft_tokens)
            call = _forced(
                value,
                lambda: ps.build_host_bitmask(
                    data.matchers, ps.GrammarTree.from_host(*links), setup.vocab_size, out=out
                ),
            )
            evict()
            return call

        return prepare

    def loop(data: Any) -> Callable[[], Any]:
        call = xgrammar_loop(data, reused)
        evict()
        return call

    methods = [Method("one", ours(10**18)), Method("parts", ours(0)), Method("xgr_loop", loop)]
    seconds, inputs = run_rounds(methods, lambda _r: pool.sample(batch), plan)
    med = {name: median(ts) for name, ts in seconds.items()}
    return {
        "shape": "tree",
        "k": nodes - 1,
        "batch": batch,
        "rows": rows,
        "words": setup.words,
        "work": routes.work(rows, setup.words),
        "rounds": len(inputs),
        "seconds": med,
        "one_over_parts": med["one"] / med["parts"],
        "us_per_row_one": med["one"] / rows * 1e6,
    }


def run_thresholds_section(
    setup: Setup,
    plan: RoundPlan,
    *,
    chain_drafts: Sequence[int] = CHAIN_DRAFTS,
    chain_batches: Sequence[int] = CHAIN_BATCHES,
    tree_batches: Sequence[int] = TREE_BATCHES,
    on_grammar: float = 0.85,
    seed: int = 0,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One record per configuration (chains per ``K`` and batch, trees per batch)."""
    import portable_spec as ps
    from tools.bench.build import warm_matchers
    from tools.bench.chains import chain_pool

    policy = policy or QuietPolicy()
    records = []
    for k in chain_drafts:
        size = max(chain_batches) + max(chain_batches) // 4
        pool = chain_pool(setup, k, size, reasoning_share=0.0, on_grammar=on_grammar, seed=seed)
        zeros = np.zeros((len(pool.matchers), 1), dtype=np.int64)
        ps.build_host_bitmask(
            pool.matchers, ps.GrammarTree.from_linear_chain(zeros), setup.vocab_size
        )
        for batch in chain_batches:
            record, busy = measure_quietly(
                lambda p=pool, k=k, b=batch: _chain_record(setup, p, k, b, plan), policy
            )
            record["other_busy_cores"] = busy
            records.append(record)
        if advance is not None:
            advance(f"thresholds chains K={k}")
    size = max(tree_batches) + max(tree_batches) // 4
    trees = make_pool(setup, "json_schema", "tree", TREE_NODES, size, on_grammar=on_grammar,
                      seed=seed)  # fmt: skip
    warm_matchers(trees, setup.vocab_size)
    for batch in tree_batches:
        record, busy = measure_quietly(lambda b=batch: _tree_record(setup, trees, b, plan), policy)
        record["other_busy_cores"] = busy
        records.append(record)
    if advance is not None:
        advance("thresholds trees")
    return records


def thresholds_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per configuration: rows, work, one thread against parts, the engine's loop."""
    header = ["vocab", "shape", "K", "batch", "rows", "work (k)", "one ms", "parts ms"]
    header += ["engine's ms", "one / parts", "one us/row", "bg"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        s = r["seconds"]
        engine = s.get("serial_fill", s.get("xgr_loop"))
        busy = r.get("other_busy_cores")
        cells = [
            r.get("vocab", ""),
            r["shape"],
            str(r["k"]),
            str(r["batch"]),
            str(r["rows"]),
            f"{r['work'] / 1000:.0f}",
            f"{s['one'] * 1e3:.3f}",
            f"{s['parts'] * 1e3:.3f}",
            f"{engine * 1e3:.3f}",
            f"{r['one_over_parts']:.2f}",
            f"{r['us_per_row_one']:.2f}",
            "" if busy is None else f"{busy:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
