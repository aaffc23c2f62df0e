"""``portable-spec bench`` (also ``python -m portable_spec.bench``): side-by-side performance
of the host mask build, the staging, the apply and the overlap, on SmolLM2's vocabulary and
the sample JSON schema, EBNF and regex grammars.

Every figure is a median over interleaved rounds (each round runs every method once, in a
random order, on the same fresh inputs) and every ratio is taken between medians of the
same run. Tables go to stdout (Markdown), progress to stderr. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

__all__ = ["Preset", "main", "parse_args", "run"]

SECTIONS = (
    "build",
    "staging",
    "apply",
    "overlap",
    "engines",
    "chains",
    "layout",
    "async",
    "percall",
    "targets",
)
#: sections run when --sections is not given (``targets`` re-runs parts of the others)
DEFAULT_SECTIONS = SECTIONS[:-1]


@dataclass(frozen=True)
class Preset:
    """Default configuration of a run (each field can be overridden on the command line)."""

    batches: tuple[int, ...]
    nodes: tuple[int, ...]
    shapes: tuple[str, ...]
    grammars: tuple[str, ...]
    min_rounds: int
    max_rounds: int
    budget_s: float
    staging_batches: tuple[int, ...]
    apply_rows: int
    overlap_batch: int
    overlap_nodes: int
    chain_drafts: tuple[int, ...]
    chain_batches: tuple[int, ...]
    chain_reasoning: tuple[float, ...]
    layout_vocabs: tuple[str, ...] = ("smollm2", "131072")
    layout_batches: tuple[int, ...] = (8, 64, 256)
    layout_nodes: tuple[int, ...] = (16, 64)
    async_vocabs: tuple[str, ...] = ("smollm2", "131072")
    async_batch: int = 32
    async_nodes: int = 32


FULL = Preset(
    batches=(1, 8, 64, 256),
    nodes=(16, 64),
    shapes=("tree", "chain"),
    grammars=("json_schema", "ebnf", "regex"),
    min_rounds=5,
    max_rounds=41,
    budget_s=2.0,
    staging_batches=(8, 64),
    apply_rows=256,
    overlap_batch=64,
    overlap_nodes=64,
    chain_drafts=(1, 2, 4, 8),
    chain_batches=(1, 8, 64, 256),
    chain_reasoning=(0.0, 0.5),
)

QUICK = Preset(
    batches=(1, 8),
    nodes=(16,),
    shapes=("tree", "chain"),
    grammars=("json_schema", "regex"),
    min_rounds=3,
    max_rounds=9,
    budget_s=0.25,
    staging_batches=(8,),
    apply_rows=32,
    overlap_batch=8,
    overlap_nodes=16,
    chain_drafts=(1, 4),
    chain_batches=(1, 8),
    chain_reasoning=(0.5,),
    layout_vocabs=("smollm2",),
    layout_batches=(8,),
    layout_nodes=(16,),
    async_vocabs=("smollm2",),
    async_batch=8,
    async_nodes=16,
)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _shares(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected shares in [0, 1], got {text!r}")
    return values


def _names(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(choices)}, got {text!r}"
            )
        return values

    return parse


def _vocabs(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or any(v != "smollm2" and not (v.isdigit() and int(v) >= 256) for v in values):
        raise argparse.ArgumentTypeError(
            f"expected smollm2 and/or vocabulary sizes of at least 256, got {text!r}"
        )
    return values


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Command-line options (``--help`` lists them)."""
    from portable_spec.bench.workloads import GRAMMAR_KINDS, SHAPES

    p = argparse.ArgumentParser(
        prog="portable-spec bench",
        description=(
            "Benchmark the grammar mask build against xgrammar's request-by-request loop and a "
            "Python traversal, the staging, the apply and the overlap with a forward. Tables "
            "(Markdown) on stdout, progress on stderr."
        ),
    )
    p.add_argument("--quick", action="store_true", help="small preset, under a minute")
    p.add_argument(
        "--sections",
        type=_names(SECTIONS),
        default=DEFAULT_SECTIONS,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    p.add_argument("--batch", type=_ints, help="build batch sizes (full: 1,8,64,256)")
    p.add_argument("--nodes", type=_ints, help="build nodes per request (full: 16,64)")
    p.add_argument("--shapes", type=_names(SHAPES), help="tree shapes: tree,chain")
    p.add_argument(
        "--grammars", type=_names(GRAMMAR_KINDS), help="grammars: json_schema,ebnf,regex"
    )
    p.add_argument(
        "--engines",
        type=_names(("xgrammar", "llguidance", "outlines")),
        help="grammar engines of the engines section (default: those installed)",
    )
    p.add_argument(
        "--engine-batch", type=_ints, help="engines section batch sizes (full: 1,8,64,256)"
    )
    p.add_argument(
        "--chain-drafts", type=_ints, help="chains section: drafts per request K (full: 1,2,4,8)"
    )
    p.add_argument(
        "--chain-batch", type=_ints, help="chains section batch sizes (full: 1,8,64,256)"
    )
    p.add_argument(
        "--chain-reasoning",
        type=_shares,
        help="chains section: shares of the batch still reasoning (full: 0,0.5)",
    )
    p.add_argument("--rounds", type=int, help="most timed rounds per configuration")
    p.add_argument("--min-rounds", type=int, help="fewest timed rounds per configuration")
    p.add_argument("--budget", type=float, help="seconds per configuration before stopping")
    p.add_argument(
        "--threads", type=int, help="portable_spec threads (default: the library's default)"
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: idle OpenMP workers spinning after a torch op "
        "steal a core from whatever runs next)",
    )
    p.add_argument("--topk", type=int, default=4, help="EAGLE-like tree branching (default 4)")
    p.add_argument(
        "--on-grammar",
        type=float,
        default=0.85,
        help="probability a draft follows its parent's grammar (default 0.85)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--staging-batch", type=_ints, help="staging batch sizes (full: 8,64)")
    p.add_argument("--apply-rows", type=int, help="logit rows of the apply section (full: 256)")
    p.add_argument("--apply-vocab", type=int, default=131072, help="apply vocabulary (131072)")
    p.add_argument("--overlap-batch", type=int, help="overlap batch size (full: 64)")
    p.add_argument(
        "--layout",
        type=_names(("dense", "compact")),
        default=("dense", "compact"),
        help="mask layouts of the layout section: dense,compact (default both)",
    )
    p.add_argument(
        "--layout-vocab",
        type=_vocabs,
        help="vocabularies of the layout and async sections: smollm2 and/or token counts of "
        "synthetic ones (full: smollm2,131072)",
    )
    p.add_argument("--layout-batch", type=_ints, help="layout section batches (full: 8,64,256)")
    p.add_argument("--layout-nodes", type=_ints, help="layout section nodes (full: 16,64)")
    p.add_argument(
        "--apply-max-mb",
        type=int,
        default=1024,
        help="layout section: apply only where the float32 logits take at most this (1024)",
    )
    p.add_argument("--async-batch", type=int, help="async section batch (full: 32)")
    p.add_argument("--async-nodes", type=int, help="async section nodes (full: 32)")
    p.add_argument(
        "--forward-factor",
        type=float,
        default=1.5,
        help="stand-in forward duration as a multiple of the build (default 1.5)",
    )
    p.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.2,
        help="other processes' busy cores above which a configuration counts as disturbed "
        "(default 0.2)",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="waiting budget of the run: a disturbed configuration is measured again after "
        "the machine is quiet (up to 3 times; the quietest attempt is kept). Default 0: only "
        "record the load",
    )
    p.add_argument("--json", metavar="FILE", help="write all results as JSON (- for stdout)")
    p.add_argument("--plot", metavar="FILE.png", help="plot build time against batch size")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(list(argv))
    for name in ("rounds", "min_rounds", "threads", "torch_threads", "apply_rows", "apply_vocab"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0.0 <= args.on_grammar <= 1.0:
        p.error("--on-grammar must lie in [0, 1]")
    return args


# -- progress -----------------------------------------------------------------------------------


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
    from portable_spec.bench.timing import (
        LoadMeter,
        QuietPolicy,
        RoundPlan,
        background_busy_cores,
        usable_cores,
    )
    from portable_spec.bench.workloads import load_setup, make_pool

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

    from portable_spec.bench.build import BuildGrid, run_build_section
    from portable_spec.bench.layouts import LayoutGrid

    grid = BuildGrid(
        kinds=grammars,
        shapes=shapes,
        nodes=nodes,
        batches=batches,
        topk=args.topk,
        on_grammar=args.on_grammar,
        seed=args.seed,
    )
    steps = 1  # vocabulary
    steps += len(grid.configs()) if "build" in sections else 0
    steps += 4 * len(staging_batches) if "staging" in sections else 0
    steps += 5 if "apply" in sections else 0
    steps += 2 if "overlap" in sections else 0
    from portable_spec.bench.engines import available_engines

    engines = args.engines or available_engines()
    engine_batches = args.engine_batch or preset.batches
    engine_kinds = args.grammars or ("json_schema",)
    engine_nodes = args.nodes or (16,)
    if "engines" in sections:
        steps += len(engines) * len(engine_kinds) * len(shapes) * len(engine_nodes)
    chain_drafts = args.chain_drafts or preset.chain_drafts
    chain_batches = args.chain_batch or preset.chain_batches
    chain_reasoning = args.chain_reasoning or preset.chain_reasoning
    steps += len(chain_drafts) * len(chain_reasoning) if "chains" in sections else 0
    layout_vocabs = args.layout_vocab or preset.layout_vocabs
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
    steps += 2 if "percall" in sections else 0
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
            "command": "portable-spec bench " + " ".join(argv),
            "preset": "quick" if args.quick else "full",
            "rounds": {
                "min": plan.min_rounds,
                "max": plan.max_rounds,
                "budget_s": plan.budget_s,
            },
            "workload": {
                "vocabulary": "SmolLM2-135M (GGUF), 49152 tokens",
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
        "per_call_targets": [],
        "targets_runs": {},
    }
    wall = time.perf_counter()
    meter = LoadMeter()
    with _Progress(steps, not args.no_progress) as progress, _torch_threads(args.torch_threads):
        progress.describe("loading the SmolLM2 vocabulary and compiling grammars")
        kinds = (*grammars, "json_schema") if "build" in sections else ("json_schema",)
        if "engines" in sections:
            kinds = (*kinds, *engine_kinds)
        if "chains" in sections or "percall" in sections or "targets" in sections:
            kinds = (*kinds, "json_schema")
        setup = load_setup(tuple(dict.fromkeys(kinds)))
        payload["meta"]["vocab_size"] = setup.vocab_size
        if "apply" in sections and args.apply_vocab < setup.vocab_size:
            raise SystemExit(
                f"portable-spec bench: --apply-vocab must be at least the grammar vocabulary "
                f"({setup.vocab_size}), got {args.apply_vocab}"
            )
        progress.advance("vocabulary loaded")

        if "build" in sections:
            progress.describe("build: drawing request pools")

            def plan_for(_batch: int, _nodes: int) -> RoundPlan:
                return plan

            payload["build"] = run_build_section(
                setup, grid, plan_for, threads=threads, policy=policy, advance=progress.advance
            )

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
            from portable_spec.bench.staging import run_staging_section

            payload["staging"] = run_staging_section(
                setup, side_pool, staging_batches, plan, policy=policy, advance=progress.advance
            )
        if "apply" in sections:
            from portable_spec.bench.apply import run_apply_section

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
            from portable_spec.bench.overlap import run_overlap_section

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
            from portable_spec.bench.engines import run_engines_section

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
            from portable_spec.bench.chains import run_chains_section

            progress.describe("chains: drawing request pools")
            payload["chains"] = run_chains_section(
                setup,
                chain_drafts,
                chain_batches,
                lambda _batch, _nodes: plan,
                threads=threads,
                reasoning_shares=chain_reasoning,
                on_grammar=args.on_grammar,
                seed=args.seed,
                policy=policy,
                advance=progress.advance,
            )
        if "layout" in sections:
            from portable_spec.bench.layouts import run_layout_section

            progress.describe("layout: drawing request pools")
            payload["layout"] = run_layout_section(
                layout_grid, plan, threads=threads, policy=policy, advance=progress.advance
            )
        if "async" in sections:
            from portable_spec.bench.layouts import run_async_section

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
            from portable_spec.bench.percall import run_percall_section

            progress.describe("percall: drawing requests")
            payload["percall"] = run_percall_section(
                setup,
                percall_plan,
                on_grammar=args.on_grammar,
                seed=args.seed,
                policy=policy,
                advance=progress.advance,
            )
        if "targets" in sections:
            from portable_spec.bench.percall import issue_targets, run_targets_section

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
    payload["targets"] = [t.as_dict() for t in _targets(payload)]
    return payload


def _targets(payload: dict[str, Any]) -> list[Any]:
    from portable_spec.bench import report
    from portable_spec.bench.layouts import layout_targets

    return [
        *report.evaluate_targets(payload["build"], payload["apply"]),
        *layout_targets(payload.get("layout", []), payload.get("async", [])),
    ]


def _print_tables(payload: dict[str, Any], file: Any) -> None:
    from portable_spec.bench import report

    meta = payload["meta"]
    cores = meta["cores"]
    busy = meta.get("other_processes_busy_cores_during_run")

    def out(text: str = "") -> None:
        print(text, file=file)

    out(f"# portable_spec benchmark ({cores} cores)")
    out()
    out(report.meta_lines(meta))
    if busy is not None:
        out(f"- other processes during the run (busy cores): {busy:.2f}")
    quiet = meta.get("quiet_policy")
    if quiet:
        out(
            f"- disturbed configurations (other processes > {quiet['threshold_cores']} cores) "
            f"measured again: {quiet['remeasured_configs']}, waiting {quiet['waited_s']:.0f} s "
            f"of a {quiet['wait_budget_s']:.0f} s budget"
        )
    out()
    out(
        "`bg`: cores other processes kept busy (on average) while that configuration ran; "
        "figures with a high `bg` are disturbed."
    )
    out()
    if payload["build"]:
        out(f"## Host mask build ({cores} cores, {meta['threads']} portable_spec threads)")
        out()
        out("Medians of interleaved rounds; `vs X` = X's median / portable_spec's median.")
        out()
        out(report.build_table(payload["build"]))
        out()
    if payload["targets"]:
        targets = _targets(payload)
        if any(t.met is not None for t in targets):
            out(f"## Targets ({cores} cores)")
            out()
            out(report.targets_table(targets, cores))
            out()
    if payload["staging"]:
        out(f"## Staging ({cores} cores)")
        out()
        out(report.staging_table(payload["staging"]))
        out()
    if payload["apply"]:
        out(f"## Apply ({cores} cores)")
        out()
        out(report.apply_table(payload["apply"]))
        out()
    if payload["overlap"]:
        out(f"## Overlap ({cores} cores)")
        out()
        out(report.overlap_table(payload["overlap"]))
        out()
    if payload.get("engines"):
        out(f"## Grammar engines ({cores} cores, {meta['threads']} portable_spec threads)")
        out()
        out(
            "Each engine against its own per-request, per-node loop (and llguidance's parallel "
            "chain fill on chains); `vs X` = X's median / portable_spec's median."
        )
        out()
        out(report.engines_table(payload["engines"]))
        out()
    if payload.get("chains"):
        out(f"## vLLM-style chains ({cores} cores, {meta['threads']} portable_spec threads)")
        out()
        out(
            "The strided chain build (K drafts + 1 bonus row per request, part of the batch "
            "still reasoning) against vLLM's serial per-token fill; `vs X` = X's median / "
            "portable_spec's median."
        )
        out()
        out(report.chains_table(payload["chains"]))
        out()
    if payload.get("layout"):
        from portable_spec.bench.layouts import layout_apply_table, layout_table

        out(f"## Mask layouts: host build, bytes ({cores} cores, {meta['threads']} threads)")
        out()
        out(layout_table(payload["layout"]))
        out()
        applied = layout_apply_table(payload["layout"])
        if applied:
            out(f"## Mask layouts: apply ({cores} cores; float32 logits)")
            out()
            out(applied)
            out()
    if payload.get("async"):
        from portable_spec.bench.layouts import async_table

        out(f"## wait=False ({cores} cores)")
        out()
        out(async_table(payload["async"]))
        out()
    if payload.get("percall"):
        from portable_spec.bench.percall import percall_table

        out(f"## One call, batch 1, K=1 ({cores} cores)")
        out()
        out("Medians of interleaved rounds, microseconds per phase; see `--sections percall`.")
        out()
        out(percall_table(payload["percall"]))
        out()
    if payload.get("targets_runs"):
        from portable_spec.bench.percall import issue_targets, percall_table
        from portable_spec.bench.report import targets_table

        runs = payload["targets_runs"]
        out(f"## Per-call targets ({cores} cores, {meta['threads']} portable_spec threads)")
        out()
        out(
            "Every ratio is a peer's median over portable_spec's, measured in this run "
            "(interleaved rounds); fixed costs in microseconds."
        )
        out()
        out(targets_table(issue_targets(runs), cores))
        out()
        if runs.get("percall"):
            out(percall_table(runs["percall"]))
            out()
        if runs.get("chains"):
            out(report.chains_table(runs["chains"]))
            out()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``portable-spec bench``; returns the exit status (1 if a mask check
    failed: the library and the Python traversal, or the serial chain fill, disagreed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    payload = run(args, argv)
    tables_to = sys.stderr if args.json == "-" else sys.stdout
    _print_tables(payload, tables_to)
    if args.json:
        from portable_spec.bench.report import write_json

        write_json(args.json, payload)
    if args.plot and payload["build"]:
        from portable_spec.bench.report import plot_build

        meta = payload["meta"]
        plot_build(
            payload["build"],
            args.plot,
            title=(
                f"Host mask build, SmolLM2 vocabulary ({meta['vocab_size']} tokens): medians of "
                f"interleaved rounds, {meta['cores']} cores, {meta['threads']} threads"
            ),
        )
    failed = [
        r for r in payload["build"] if not (r.get("masks_identical") and r.get("accepted_matches"))
    ]
    failed += [
        r
        for r in payload.get("layout", [])
        if r.get("masks_identical") is False or r.get("listed_matches_accepted") is False
    ]
    if failed:
        print(
            f"error: {len(failed)} build configurations produced masks that differ from the "
            "Python traversal's (build section) or from the dense layout's (layout section)",
            file=sys.stderr,
        )
    chains = [r for r in payload["chains"] if not r.get("rows_identical")]
    if chains:
        print(
            f"error: {len(chains)} chain configurations produced rows that differ from the "
            "serial fill",
            file=sys.stderr,
        )
    return 1 if failed or chains else 0
