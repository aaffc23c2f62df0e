"""Sections ``percall`` and ``targets``: where one small call spends its time, and the
per-call targets (small batches, short chains) measured against the peers in one run.

``percall``: batch 1, ``K`` chain drafts (1 by default), SmolLM2's vocabulary and the sample
JSON schema; every round draws another request from a pool (its matcher advanced by a random
valid prefix, a draft the grammar allows with probability ``on_grammar``). Each phase of a
call is timed on its own, in interleaved rounds, in two regimes:

* ``warm``: the call is made three times untimed right before the timed one (back to back,
  as a micro-benchmark sees it);
* ``cold``: a 32 MiB buffer is written untimed right before the timed call, evicting the
  caches the way an engine's forward pass does between two steps.

Phases: ``tree`` (``GrammarTree.from_linear_chain``), ``resolve`` (the tree's host arrays),
``checks`` (grammars classified, pending builds looked up: what runs before any matcher
moves), ``engine_walk`` (xgrammar's ``traverse_draft_tree`` alone: the engine's own call the
build makes), ``repair`` (the compiled row repair with the valid flags), ``build`` (the whole
``build_host_bitmask(..., out=, return_valid=True)`` over ``from_linear_chain``, tree creation
included), ``build_packed`` (the same over ``from_packed_chains``), ``build_lists``
(``build_chain_bitmask`` on the request's draft list, no tree) and ``serial_fill`` (the
vLLM-style per-token fill of the same rows: the engine's own loop). ``overhead`` is ``build``
minus ``engine_walk``: what the library adds above the engine's own calls.

``targets``: runs the configurations the per-call targets name (the chains section with and
without reasoning, xgrammar trees at batch 1 on a 131072-token vocabulary and at batch 64,
llguidance trees and chains, and ``percall``) and prints one table, each target met or not.
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
    geomean,
    measure_quietly,
    median,
    run_rounds,
    usable_cores,
)
from tools.bench.workloads import Setup

__all__ = [
    "PERCALL_PHASES",
    "issue_targets",
    "percall_table",
    "run_percall_section",
    "run_targets_section",
]

PERCALL_PHASES = (
    "tree",
    "resolve",
    "checks",
    "engine_walk",
    "repair",
    "build",
    "build_packed",
    "build_lists",
    "serial_fill",
)
REGIMES = ("warm", "cold")


def _chain_links(nodes: int) -> tuple[np.ndarray, np.ndarray]:
    next_token = np.append(np.arange(1, nodes, dtype=np.int64), -1)
    return next_token, np.full(nodes, -1, dtype=np.int64)


def _phase_methods(setup: Setup, k: int, regime: str) -> list[Method[Any]]:
    """The phases of :data:`PERCALL_PHASES` as methods over one request ``(matcher,
    drafts)``; ``regime`` says how each call is prepared (see the module docstring)."""
    import xgrammar as xgr

    import portable_spec as ps
    from portable_spec import native
    from portable_spec.grammars import classify_grammars
    from portable_spec.pending import check_not_pending
    from tools.bench.chains import ChainBatch, serial_fill

    vocab, words, nodes = setup.vocab_size, setup.words, k + 1
    out = np.full((nodes, words), -1, dtype=np.int32)
    rows = np.full((nodes, words), -1, dtype=np.int32)
    bitmask = xgr.allocate_token_bitmask(nodes, vocab)
    valid = np.zeros(nodes, dtype=bool)
    next_token, next_sibling = _chain_links(nodes)
    offsets = np.array([0, nodes], dtype=np.int64)
    evict = cache_evictor()
    stop_ids = np.array([setup.eos_id], dtype=np.int64)

    def chain_of(data: Any) -> np.ndarray:
        chain = np.full((1, nodes), -1, dtype=np.int64)
        chain[0, 1:] = data[1]
        return chain

    def calls(data: Any) -> dict[str, Callable[[], Any]]:
        matcher, drafts = data
        chain = chain_of(data)
        tokens = chain[0].copy()
        fresh: list[Any] = []

        def resolve() -> Any:
            return fresh[0].resolve()

        repair_rows = native.row_repairer(True)  # the compiled function itself, when built

        def repair() -> Any:
            return repair_rows(rows, next_token, next_sibling, tokens, vocab, stop_ids, 1, valid)

        batch = ChainBatch([matcher], [list(drafts)], [list(drafts)], [False], 0)
        return {
            "tree": lambda: ps.GrammarTree.from_linear_chain(chain),
            "resolve": resolve,
            "checks": lambda: (
                classify_grammars([matcher], 1, vocab),
                check_not_pending([matcher]),
            ),
            "engine_walk": lambda: matcher.traverse_draft_tree(
                next_token, next_sibling, tokens, rows
            ),
            "repair": repair,
            "build": lambda: ps.build_host_bitmask(
                [matcher], ps.GrammarTree.from_linear_chain(chain), vocab, out=out,
                return_valid=True,
            ),
            "build_packed": lambda: ps.build_host_bitmask(
                [matcher], ps.GrammarTree.from_packed_chains(tokens, offsets), vocab, out=out,
                return_valid=True,
            ),
            "build_lists": lambda: ps.build_chain_bitmask(
                [matcher], [drafts], vocab, rows_per_request=k + 1, out=out, return_valid=True
            ),
            "serial_fill": lambda: serial_fill(batch, bitmask, k, frozenset()),
            "_fresh_tree": lambda: fresh.insert(0, ps.GrammarTree.from_linear_chain(chain)),
        }  # fmt: skip

    def method(name: str) -> Method[Any]:
        def prepare(data: Any) -> Callable[[], Any]:
            table = calls(data)
            call = table[name]
            if name == "repair":
                table["engine_walk"]()  # the rows the repair reads
            if regime == "warm":
                for _ in range(3):
                    if name == "resolve":
                        table["_fresh_tree"]()
                    call()
            if name == "resolve":
                table["_fresh_tree"]()
            if regime == "cold":
                evict()
            return call

        return Method(name, prepare)

    names = [p for p in PERCALL_PHASES if p != "repair" or native.native is not None]
    return [method(name) for name in names]


def _request_pool(setup: Setup, k: int, size: int, on_grammar: float, seed: int) -> list[Any]:
    from tools.bench.chains import chain_pool

    pool = chain_pool(setup, k, size, reasoning_share=0.0, on_grammar=on_grammar, seed=seed)
    return [(m, list(d)) for m, d in zip(pool.matchers, pool.drafts, strict=True)]


def run_percall_section(
    setup: Setup,
    plan: RoundPlan,
    *,
    k: int = 1,
    on_grammar: float = 0.85,
    seed: int = 0,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One record per regime: median microseconds per phase of a batch-1, ``k``-draft call,
    ``overhead_us`` (build minus the engine's walk, linear and packed chains) and the ratio of
    the serial fill's median over the build's."""
    import portable_spec as ps

    policy = policy or QuietPolicy()
    requests = _request_pool(setup, k, 64, on_grammar, seed)
    rng = np.random.default_rng([seed, k, 20])
    matchers = [m for m, _ in requests]
    zeros = np.zeros((len(matchers), 1), dtype=np.int64)
    ps.build_host_bitmask(matchers, ps.GrammarTree.from_linear_chain(zeros), setup.vocab_size)
    records = []
    for regime in REGIMES:
        methods = _phase_methods(setup, k, regime)

        def measure(methods: list[Method[Any]] = methods) -> tuple[dict[str, Any], int]:
            seconds, inputs = run_rounds(
                methods, lambda _r: requests[int(rng.integers(len(requests)))], plan
            )
            return {n: median(ts) * 1e6 for n, ts in seconds.items()}, len(inputs)

        (us, rounds), busy = measure_quietly(measure, policy)
        records.append(
            {
                "regime": regime,
                "k": k,
                "batch": 1,
                "rounds": rounds,
                "cores": usable_cores(),
                "us": us,
                "overhead_us": us["build"] - us["engine_walk"],
                "overhead_packed_us": us["build_packed"] - us["engine_walk"],
                "overhead_lists_us": us["build_lists"] - us["engine_walk"],
                "serial_fill_over_build": us["serial_fill"] / us["build"],
                "other_busy_cores": busy,
            }
        )
        if advance is not None:
            advance(f"percall {regime}")
    return records


def percall_table(records: Sequence[dict[str, Any]]) -> str:
    """Microseconds per phase (rows) and regime, per vocabulary (columns)."""
    several = len({r.get("vocab") for r in records}) > 1
    regimes = [f"{r['regime']} ({r['vocab']})" if several else r["regime"] for r in records]
    header = ["phase (µs, median)", *regimes]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    phases = [p for p in PERCALL_PHASES if all(p in r["us"] for r in records)]
    for phase in phases:
        cells = [f"{r['us'][phase]:.1f}" for r in records]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    for key, label in (
        ("overhead_us", "overhead: build - engine_walk"),
        ("overhead_packed_us", "overhead: build_packed - engine_walk"),
        ("overhead_lists_us", "overhead: build_lists - engine_walk"),
    ):
        lines.append(f"| {label} | " + " | ".join(f"{r[key]:.1f}" for r in records) + " |")
    ratios = " | ".join(f"{r['serial_fill_over_build']:.2f}x" for r in records)
    lines.append(f"| serial_fill / build | {ratios} |")
    busy = " | ".join(
        "" if r.get("other_busy_cores") is None else f"{r['other_busy_cores']:.2f}" for r in records
    )
    lines.append(f"| bg (other processes' busy cores) | {busy} |")
    return "\n".join(lines)


# -- the targets ----------------------------------------------------------------------------------
CHAIN_DRAFTS = (1, 2, 4, 8)
CHAIN_BATCHES = (1, 8, 64, 256)
ENGINE_BATCHES = (1, 8, 64, 256)


def issue_targets(payload: dict[str, Any]) -> list[Any]:
    """The per-call targets, decided by this run's records (``chains``, ``layout``, ``build``,
    ``engines``, ``percall``); a target without records is reported as not run."""
    from tools.bench.report import Target

    targets: list[Target] = []

    def add(name: str, bound: str, ratios: list[tuple[str, float]]) -> None:
        if not ratios:
            targets.append(Target(name, bound, [], None))
            return
        op, limit = bound.split()
        lim = float(limit.rstrip("xµs"))
        ok = all((v >= lim) if op == ">=" else (v <= lim) for _, v in ratios)
        targets.append(Target(name, bound, ratios, ok))

    chains = payload.get("chains", [])
    shares = ((0.0, "no reasoning", 0.8, 1.5), (0.5, "half reasoning", 0.8, 1.2))
    for share, label, floor, mean in shares:
        rows = [r for r in chains if r["pool_reasoning_share"] == share]
        ratios = [(f"K{r['k']}/bs{r['batch']}", r["speedup"]["serial_fill"]) for r in rows]
        add(f"vLLM chains, {label}: / serial fill, every config", f">= {floor}x", ratios)
        if share == 0.0:
            big = [(c, v) for (c, v), r in zip(ratios, rows, strict=True) if r["batch"] >= 8]
            add(f"vLLM chains, {label}: / serial fill, batch >= 8", ">= 1.0x", big)
        values = [v for _, v in ratios]
        add(
            f"vLLM chains, {label}: / serial fill, geomean",
            f">= {mean}x",
            [("geomean", geomean(values))] if values else [],
        )
    layout = [r for r in payload.get("layout", []) if r["vocab_size"] >= 131072]
    add(
        "xgrammar trees bs1, 16 nodes, 131k vocab: / request loop",
        ">= 0.9x",
        [
            (f"n{r['nodes']}/bs{r['batch']}", r["speedup"]["dense"])
            for r in layout
            if r["batch"] == 1 and r["nodes"] == 16
        ],
    )
    build = [r for r in payload.get("build", []) if r["shape"] == "tree" and r["batch"] == 64]
    for nodes, bound in ((16, ">= 1.6x"), (64, ">= 1.8x")):
        add(
            f"xgrammar trees bs64, {nodes} nodes: / request loop",
            bound,
            [
                (f"{r['kind']}/bs64", r["speedup"]["xgr_loop_reused"])
                for r in build
                if r["nodes"] == nodes
            ],
        )
    engines = [r for r in payload.get("engines", []) if r["engine"] == "llguidance"]
    add(
        "llguidance trees: / its own loop",
        ">= 1.0x",
        [
            (f"n{r['nodes']}/bs{r['batch']}", r["speedup"]["engine_loop"])
            for r in engines
            if r["shape"] == "tree"
        ],
    )
    add(  # the parallel fill is the engine's own for chains (engines.ENGINE_OWN): not compared
        "llguidance chains: / its best but the engine's own (parallel fill)",
        ">= 1.0x",
        [
            (f"n{r['nodes']}/bs{r['batch']}", min(
                v for k, v in r["speedup"].items() if k != r.get("engine_own")
            ))
            for r in engines
            if r["shape"] == "chain"
        ],
    )  # fmt: skip
    percall = {r["regime"]: r for r in payload.get("percall", []) if r["k"] == 1}
    for regime, bound in (("cold", "<= 40µs"), ("warm", "<= 10µs")):
        record = percall.get(regime)
        ratios = []
        if record is not None:
            ratios = [
                ("linear", record["overhead_us"]),
                ("packed", record["overhead_packed_us"]),
            ]
            if "overhead_lists_us" in record:  # records of runs before build_lists
                ratios.append(("lists", record["overhead_lists_us"]))
        add(f"fixed cost bs1 K=1, {regime}: build - engine walk (µs)", bound, ratios)
    return targets


def issue_targets_table(targets: Sequence[Any], cores: int) -> str:
    """One row per target: bound, configurations, geomean, worst, met or missed."""
    from tools.bench.report import targets_table

    return targets_table(targets, cores)


def run_targets_section(
    setup: Setup,
    plan: RoundPlan,
    percall_plan: RoundPlan,
    *,
    threads: int,
    topk: int = 4,
    on_grammar: float = 0.85,
    seed: int = 0,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Run every configuration :func:`issue_targets` reads; return the records per section
    (``chains``, ``layout``, ``build``, ``engines``, ``percall``)."""
    from tools.bench.build import BuildGrid, run_build_section
    from tools.bench.chains import run_chains_section
    from tools.bench.engines import available_engines, run_engines_section
    from tools.bench.layouts import LayoutGrid, run_layout_section

    policy = policy or QuietPolicy()

    def plan_for(_batch: int, _nodes: int) -> RoundPlan:
        return plan

    records: dict[str, list[dict[str, Any]]] = {}
    records["percall"] = run_percall_section(
        setup, percall_plan, on_grammar=on_grammar, seed=seed, policy=policy, advance=advance
    )
    records["chains"] = run_chains_section(
        setup,
        CHAIN_DRAFTS,
        CHAIN_BATCHES,
        plan_for,
        threads=threads,
        reasoning_shares=(0.0, 0.5),
        on_grammar=on_grammar,
        seed=seed,
        policy=policy,
        advance=advance,
    )
    grid = LayoutGrid(
        vocabs=("131072",),
        batches=(1,),
        nodes=(16,),
        layouts=("dense",),
        apply_max_bytes=0,
        topk=topk,
        on_grammar=on_grammar,
        seed=seed,
    )
    records["layout"] = run_layout_section(
        grid, plan, threads=threads, policy=policy, advance=advance
    )
    build_grid = BuildGrid(
        kinds=("json_schema",),
        shapes=("tree",),
        nodes=(16, 64),
        batches=(64,),
        topk=topk,
        on_grammar=on_grammar,
        seed=seed,
    )
    records["build"] = run_build_section(
        setup, build_grid, plan_for, threads=threads, policy=policy, advance=advance
    )
    records["engines"] = []
    if "llguidance" in available_engines():
        records["engines"] = run_engines_section(
            setup,
            ("llguidance",),
            ("json_schema",),
            ("tree", "chain"),
            (16,),
            ENGINE_BATCHES,
            plan_for,
            threads=threads,
            topk=topk,
            on_grammar=on_grammar,
            seed=seed,
            policy=policy,
            advance=advance,
        )
    return records
