"""The benchmark's run: every selected section in turn, with a progress bar on stderr; returns
the JSON payload that :mod:`tools.bench.tables` prints (the command line: :mod:`tools.bench.cli`).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager, suppress
from typing import Any

from tools.bench.presets import FULL, QUICK

__all__ = ["run", "targets"]


class _Progress:
    """A rich progress bar on stderr (nothing when disabled or rich is missing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._task: Any = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:  # pragma: no cover - rich is a test dependency
            return
        self._bar = Progress(
            TextColumn("[bold]bench[/bold] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._bar.add_task("starting", total=total)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def describe(self, text: str) -> None:
        """Show what runs now."""
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self, text: str) -> None:
        """One step done."""
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=text)


@contextmanager
def _torch_threads(count: int) -> Any:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("portable-spec", "numpy", "torch", "jax", "jaxlib", "xgrammar"):
        with suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {platform.system()} {platform.release()}"


# -- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Run the selected sections; return the JSON payload (also printed as tables)."""
    import portable_spec as ps
    from tools.bench.timing import (
        LoadMeter,
        QuietPolicy,
        RoundPlan,
        background_busy_cores,
        usable_cores,
    )
    from tools.bench.workloads import make_pool, vocab_setup

    preset = QUICK if args.quick else FULL
    batches = args.batch or preset.batches
    nodes = args.nodes or preset.nodes
    shapes = args.shapes or preset.shapes
    grammars = args.grammars or preset.grammars
    plan = RoundPlan(
        min_rounds=args.min_rounds or preset.min_rounds,
        max_rounds=max(args.rounds or preset.max_rounds, args.min_rounds or preset.min_rounds),
        budget_s=preset.budget_s if args.budget is None else args.budget,
    )
    if args.rounds is not None and args.min_rounds is None:
        plan = RoundPlan(min(plan.min_rounds, args.rounds), args.rounds, plan.budget_s)
    staging_batches = args.staging_batch or preset.staging_batches
    apply_rows = args.apply_rows or preset.apply_rows
    overlap_batch = args.overlap_batch or preset.overlap_batch
    sections = args.sections
    policy = QuietPolicy(threshold=args.quiet_threshold, wait_s=args.wait_quiet)

    if args.threads is not None:
        ps.set_num_threads(args.threads)
    threads = ps.get_num_threads()
    cores = usable_cores()
    background = background_busy_cores()
    if background is not None and background > 0.25:
        print(
            f"warning: other processes keep {background:.2f} of {cores} cores busy; "
            "figures will be noisy",
            file=sys.stderr,
        )

    from tools.bench.build import BuildGrid, run_build_section
    from tools.bench.layouts import LayoutGrid

    grid = BuildGrid(
        kinds=grammars,
        shapes=shapes,
        nodes=nodes,
        batches=batches,
        topk=args.topk,
        on_grammar=args.on_grammar,
        seed=args.seed,
    )
    vocabs = args.vocab or preset.vocabs
    steps = 1  # vocabularies
    steps += len(vocabs) * len(grid.configs()) if "build" in sections else 0
    steps += 4 * len(staging_batches) if "staging" in sections else 0
    steps += 5 if "apply" in sections else 0
    steps += 2 if "overlap" in sections else 0
    from tools.bench.engines import available_engines

    engines = args.engines or available_engines()
    engine_batches = args.engine_batch or preset.batches
    engine_kinds = args.grammars or ("json_schema",)
    engine_nodes = args.nodes or (16,)
    if "engines" in sections:
        steps += len(engines) * len(engine_kinds) * len(shapes) * len(engine_nodes)
    chain_drafts = args.chain_drafts or preset.chain_drafts
    chain_batches = args.chain_batch or preset.chain_batches
    chain_reasoning = args.chain_reasoning or preset.chain_reasoning
    steps += len(vocabs) * len(chain_drafts) * len(chain_reasoning) if "chains" in sections else 0
    layout_vocabs = args.layout_vocab or args.vocab or preset.layout_vocabs
    async_vocabs = args.layout_vocab or preset.async_vocabs
    layout_grid = LayoutGrid(
        vocabs=layout_vocabs,
        batches=args.layout_batch or preset.layout_batches,
        nodes=args.layout_nodes or preset.layout_nodes,
        layouts=args.layout,
        apply_max_bytes=args.apply_max_mb << 20,
        topk=args.topk,
        on_grammar=args.on_grammar,
        seed=args.seed,
    )
    if "layout" in sections:
        steps += len(layout_grid.vocabs) * len(layout_grid.nodes) * len(layout_grid.batches)
    steps += len(async_vocabs) if "async" in sections else 0
    steps += 2 * len(vocabs) if "percall" in sections else 0
    forced_drafts = args.forced_drafts or preset.forced_drafts
    forced_batches = args.forced_batch or preset.forced_batches
    steps += len(forced_drafts) if "forced" in sections else 0
    steps += 3 * len(vocabs) if "thresholds" in sections else 0
    steps += 2 + 2 * len(chain_drafts) + 1 + 2 + 2 if "targets" in sections else 0
    percall_plan = RoundPlan(
        min_rounds=max(plan.min_rounds, 50), max_rounds=max(plan.max_rounds, 400), budget_s=3.0
    )

    payload: dict[str, Any] = {
        "meta": {
            "machine": _machine(),
            "cores": cores,
            "threads": threads,
            "torch_threads": args.torch_threads,
            "background_busy_cores": background,
            "versions": _versions(),
            "command": "scripts/bench.sh " + " ".join(argv),
            "preset": "quick" if args.quick else "full",
            "rounds": {
                "min": plan.min_rounds,
                "max": plan.max_rounds,
                "budget_s": plan.budget_s,
            },
            "workload": {
                "vocabulary": "SmolLM2-135M (GGUF), 49152 tokens (build, chains, percall, "
                "layout: each of meta.vocabularies)",
                "topk": args.topk,
                "on_grammar": args.on_grammar,
                "seed": args.seed,
            },
        },
        "build": [],
        "targets": [],
        "staging": [],
        "apply": [],
        "overlap": [],
        "engines": [],
        "chains": [],
        "layout": [],
        "async": [],
        "percall": [],
        "forced": [],
        "thresholds": [],
        "per_call_targets": [],
        "targets_runs": {},
    }
    wall = time.perf_counter()
    meter = LoadMeter()
    with _Progress(steps, not args.no_progress) as progress, _torch_threads(args.torch_threads):
        progress.describe("loading the vocabularies and compiling grammars")
        kinds = (*grammars, "json_schema") if "build" in sections else ("json_schema",)
        if "engines" in sections:
            kinds = (*kinds, *engine_kinds)
        if {"chains", "percall", "targets", "thresholds"} & set(sections):
            kinds = (*kinds, "json_schema")
        kinds = tuple(dict.fromkeys(kinds))
        # the other sections run on the first vocabulary; these on every one
        setups = [vocab_setup(name, kinds) for name in vocabs]
        setup = setups[0]
        payload["meta"]["vocab_size"] = setup.vocab_size
        payload["meta"]["vocabularies"] = [
            {"name": name, "label": s.label, "vocab_size": s.vocab_size, "words": s.words}
            for name, s in zip(vocabs, setups, strict=True)
        ]
        if "apply" in sections and args.apply_vocab < setup.vocab_size:
            raise SystemExit(
                f"scripts/bench.sh: --apply-vocab must be at least the grammar vocabulary "
                f"({setup.vocab_size}), got {args.apply_vocab}"
            )
        progress.advance("vocabularies loaded")

        if "build" in sections:
            progress.describe("build: drawing request pools")

            def plan_for(_batch: int, _nodes: int) -> RoundPlan:
                return plan

            for each in setups:
                payload["build"] += _labelled(
                    each,
                    run_build_section(
                        each, grid, plan_for, threads=threads, policy=policy,
                        advance=progress.advance,
                    ),
                )  # fmt: skip

        if "staging" in sections or "overlap" in sections:
            progress.describe("drawing the staging/overlap pool")
            need = max((*staging_batches, overlap_batch))
            side_pool = make_pool(
                setup,
                "json_schema",
                "tree",
                preset.overlap_nodes,
                need + max(8, need // 4),
                topk=args.topk,
                on_grammar=args.on_grammar,
                seed=args.seed + 1,
            )
        if "staging" in sections:
            from tools.bench.staging import run_staging_section

            payload["staging"] = run_staging_section(
                setup, side_pool, staging_batches, plan, policy=policy, advance=progress.advance
            )
        if "apply" in sections:
            from tools.bench.apply import run_apply_section

            progress.describe("apply: building a real mask")
            apply_nodes = 16
            rows = -(-apply_rows // apply_nodes) * apply_nodes
            apply_pool = make_pool(
                setup,
                "json_schema",
                "tree",
                apply_nodes,
                rows // apply_nodes,
                topk=args.topk,
                on_grammar=args.on_grammar,
                seed=args.seed + 2,
            )
            payload["apply"] = run_apply_section(
                setup,
                apply_pool,
                rows,
                args.apply_vocab,
                plan,
                policy=policy,
                advance=progress.advance,
            )
        if "overlap" in sections:
            from tools.bench.overlap import run_overlap_section

            progress.describe("overlap: calibrating the stand-in forward")
            payload["overlap"] = run_overlap_section(
                setup,
                side_pool,
                overlap_batch,
                plan,
                forward_factor=args.forward_factor,
                policy=policy,
                advance=progress.advance,
            )
        if "engines" in sections:
            from tools.bench.engines import run_engines_section

            progress.describe("engines: drawing request pools")
            payload["engines"] = run_engines_section(
                setup,
                engines,
                engine_kinds,
                shapes,
                engine_nodes,
                engine_batches,
                lambda _batch, _nodes: plan,
                threads=threads,
                topk=args.topk,
                on_grammar=args.on_grammar,
                seed=args.seed,
                policy=policy,
                advance=progress.advance,
            )
        if "chains" in sections:
            from tools.bench.chains import run_chains_section

            progress.describe("chains: drawing request pools")
            for each in setups:
                payload["chains"] += _labelled(
                    each,
                    run_chains_section(
                        each,
                        chain_drafts,
                        chain_batches,
                        lambda _batch, _nodes: plan,
                        threads=threads,
                        reasoning_shares=chain_reasoning,
                        on_grammar=args.on_grammar,
                        seed=args.seed,
                        policy=policy,
                        advance=progress.advance,
                    ),
                )
        if "layout" in sections:
            from tools.bench.layouts import run_layout_section

            progress.describe("layout: drawing request pools")
            payload["layout"] = run_layout_section(
                layout_grid, plan, threads=threads, policy=policy, advance=progress.advance
            )
        if "async" in sections:
            from tools.bench.layouts import run_async_section

            progress.describe("async: drawing request pools")
            payload["async"] = run_async_section(
                async_vocabs,
                args.async_batch or preset.async_batch,
                args.async_nodes or preset.async_nodes,
                plan,
                policy=policy,
                advance=progress.advance,
                seed=args.seed,
            )
        if "percall" in sections:
            from tools.bench.percall import run_percall_section

            progress.describe("percall: drawing requests")
            for each in setups:
                payload["percall"] += _labelled(
                    each,
                    run_percall_section(
                        each,
                        percall_plan,
                        on_grammar=args.on_grammar,
                        seed=args.seed,
                        policy=policy,
                        advance=progress.advance,
                    ),
                )
        if "forced" in sections:
            from tools.bench.forced import run_forced_section

            progress.describe("forced: replaying the schema workloads' outputs")
            payload["forced"] = run_forced_section(
                forced_drafts,
                forced_batches,
                plan,
                seed=args.seed,
                policy=policy,
                advance=progress.advance,
            )
        if "thresholds" in sections:
            from tools.bench.thresholds import run_thresholds_section

            progress.describe("thresholds: drawing request pools")
            for each in setups:
                payload["thresholds"] += _labelled(
                    each,
                    run_thresholds_section(
                        each, plan, on_grammar=args.on_grammar, seed=args.seed, policy=policy,
                        advance=progress.advance,
                    ),
                )  # fmt: skip
        if "targets" in sections:
            from tools.bench.percall import issue_targets, run_targets_section

            progress.describe("targets: the per-call targets' configurations")
            runs = run_targets_section(
                setup,
                plan,
                percall_plan,
                threads=threads,
                topk=args.topk,
                on_grammar=args.on_grammar,
                seed=args.seed,
                policy=policy,
                advance=progress.advance,
            )
            payload["targets_runs"] = runs
            payload["per_call_targets"] = [t.as_dict() for t in issue_targets(runs)]
    payload["meta"]["wall_seconds"] = time.perf_counter() - wall
    payload["meta"]["other_processes_busy_cores_during_run"] = meter.busy_cores()
    payload["meta"]["quiet_policy"] = {
        "threshold_cores": policy.threshold,
        "wait_budget_s": policy.wait_s,
        "waited_s": policy.waited_s,
        "remeasured_configs": policy.retried,
    }
    payload["targets"] = [t.as_dict() for t in targets(payload)]
    return payload


def _labelled(setup: Any, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with the vocabulary they ran on (``vocab``, ``vocab_size``)."""
    for record in records:
        record["vocab"] = setup.label
        record["vocab_size"] = setup.vocab_size
    return records


def targets(payload: dict[str, Any]) -> list[Any]:
    from tools.bench import report
    from tools.bench.layouts import layout_targets

    return [
        *report.evaluate_targets(payload["build"], payload["apply"]),
        *layout_targets(payload.get("layout", []), payload.get("async", [])),
    ]
