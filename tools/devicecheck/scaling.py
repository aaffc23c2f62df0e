"""Part 3, thread scaling of the host build on this machine's cores.

For each batch size and node count (a synthetic 131072-token vocabulary, the sample JSON
schema, EAGLE-like trees), interleaved rounds time ``portable_spec`` at each thread count
(``ps.set_num_threads(k)`` for k in 1, 2, 4, 8, 16, capped by the usable cores) and xgrammar's
request-by-request loop (``traverse_draft_tree`` per request, one thread, reused buffer: the
bench's ``xgr_loop_reused``). The thread count is set, and its workers started, before each
timed call (untimed). Each thread count writes its own buffer; the warm-up round checks that
all thread counts give the same mask.

Reported per thread count: median ms, speed-up over one thread, efficiency (speed-up / k) and
the ratio to the xgrammar loop (above 1: the library is faster).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tools.bench.build import build_methods, warm_matchers
from tools.bench.timing import (
    Method,
    QuietPolicy,
    measure_quietly,
    median,
    run_rounds,
    usable_cores,
)
from tools.bench.workloads import Batch, synthetic_setup
from tools.devicecheck.profiles import Profile
from tools.devicecheck.results import PartRecorder
from tools.devicecheck.workload import describe, json_pool

__all__ = ["run", "thread_counts"]


def thread_counts(wanted: tuple[int, ...], cores: int) -> tuple[int, ...]:
    """The thread counts of ``wanted`` that fit ``cores`` (1 always runs)."""
    return tuple(k for k in wanted if k <= cores) or (1,)


def _with_threads(method: Method[Batch], threads: int) -> Method[Batch]:
    import portable_spec as ps
    from portable_spec.pool import run_indexed

    def prepare(batch: Batch) -> Callable[[], Any]:
        if ps.get_num_threads() != threads:
            ps.set_num_threads(threads)
            run_indexed(lambda _i: None, threads, parallel=True)  # start the workers now
        return method.prepare(batch)

    return Method(f"threads={threads}", prepare)


def run(rec: PartRecorder, profile: Profile) -> None:
    """One section, one record per (batch, nodes)."""
    import portable_spec as ps

    cores = usable_cores()
    counts = thread_counts(profile.scaling_threads, cores)
    setup = synthetic_setup(profile.vocab)
    before = ps.get_num_threads()
    with rec.section("scaling"):
        for nodes in profile.scaling_nodes:
            pool = json_pool(setup, nodes, max(profile.scaling_batches))
            warm_matchers(pool, setup.vocab_size)
            if nodes == profile.scaling_nodes[0]:
                rec.note("workload", {**describe(setup, pool), "cores": cores, "threads": counts})
            for batch in profile.scaling_batches:
                record, busy = measure_quietly(  # records other processes' load, no waiting
                    lambda b=batch, p=pool: _config(setup, p, b, counts, profile), QuietPolicy()
                )
                record["other_busy_cores"] = busy
                rec.check(
                    "scaling",
                    f"same mask at every thread count (bs {batch}, {nodes} nodes)",
                    record.pop("masks_agree"),
                )
                rec.add("scaling", record)
    ps.set_num_threads(before)


def _config(
    setup: Any, pool: Any, batch: int, counts: tuple[int, ...], profile: Profile
) -> dict[str, Any]:
    nodes = pool.next_token.shape[1]
    rows = batch * nodes
    outs = {k: np.full((rows, setup.words), -1, dtype=np.int32) for k in counts}
    reused = np.full((rows, setup.words), -1, dtype=np.int32)
    methods: list[Method[Batch]] = []
    for k in counts:
        ours = build_methods(setup.vocab_size, setup.words, pool.shape, outs[k], reused)[0]
        methods.append(_with_threads(ours, k))
    xgr = build_methods(setup.vocab_size, setup.words, pool.shape, outs[counts[0]], reused)[1]
    methods.append(xgr)
    agree: list[bool] = []

    def on_warmup(_data: Batch, results: dict[str, Any]) -> None:
        first = outs[counts[0]]
        agree.append(all(np.array_equal(first, outs[k]) for k in counts[1:]))

    seconds, inputs = run_rounds(
        methods, lambda _r: pool.sample(batch), profile.scaling_plan, on_warmup=on_warmup
    )
    med = {name: median(v) for name, v in seconds.items()}
    one = med[f"threads={counts[0]}"]
    loop = med["xgr_loop_reused"]
    per_threads = {
        str(k): {
            "ms": med[f"threads={k}"] * 1e3,
            "speedup": one / med[f"threads={k}"],
            "efficiency": one / med[f"threads={k}"] / k,
            "vs_xgr_loop": loop / med[f"threads={k}"],
        }
        for k in counts
    }
    return {
        "batch": batch,
        "nodes": nodes,
        "rounds": len(seconds["xgr_loop_reused"]),
        "accepted_nodes": median([d.accepted for d in inputs]),
        "xgr_loop_ms": loop * 1e3,
        "threads": per_threads,
        "masks_agree": all(agree),
    }
