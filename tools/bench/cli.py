"""``python -m tools.bench`` (``scripts/bench.sh``): side-by-side performance of the host mask
build, the staging, the apply and the overlap, on SmolLM2's vocabulary and the sample JSON
schema, EBNF and regex grammars.

Every figure is a median over interleaved rounds (each round runs every method once, in a
random order, on the same fresh inputs) and every ratio is taken between medians of the
same run. Tables go to stdout (Markdown), progress to stderr. See ``docs/benchmarks.md``.

This module reads the command line; :mod:`tools.bench.runner` runs the sections and
:mod:`tools.bench.tables` prints them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tools.bench.presets import DEFAULT_SECTIONS, SECTIONS

__all__ = ["main", "parse_args"]


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
    from tools.bench.workloads import VOCABS

    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or any(v not in VOCABS and not (v.isdigit() and int(v) >= 256) for v in values):
        raise argparse.ArgumentTypeError(
            f"expected a subset of {','.join(VOCABS)} and/or vocabulary sizes of at least 256, "
            f"got {text!r}"
        )
    return values


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Command-line options (``--help`` lists them)."""
    from tools.bench.workloads import GRAMMAR_KINDS, SHAPES

    p = argparse.ArgumentParser(
        prog="scripts/bench.sh",
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
    p.add_argument(
        "--vocab",
        type=_vocabs,
        help="vocabularies of the build, chains, percall and layout sections: smollm2 (49152), "
        "tekken (131072), qwen (151936) and/or sizes of synthetic ones (full: all three named)",
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
        "--forced-drafts", type=_ints, help="forced section: drafts per request K (full: 4,8)"
    )
    p.add_argument(
        "--forced-batch", type=_ints, help="forced section batch sizes (full: 1,8,16,32,64)"
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
        help="vocabularies of the layout and async sections, as --vocab (default: --vocab's; "
        "async: smollm2,131072)",
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m tools.bench``; returns the exit status (1 if a mask check
    failed: the library and the Python traversal, or the serial chain fill, disagreed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from tools.bench.runner import run
    from tools.bench.tables import print_tables

    payload = run(args, argv)
    tables_to = sys.stderr if args.json == "-" else sys.stdout
    print_tables(payload, tables_to)
    if args.json:
        from tools.bench.report import write_json

        write_json(args.json, payload)
    if args.plot and payload["build"]:
        from tools.bench.report import plot_build

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
