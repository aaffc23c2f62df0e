"""Figures of grammar-aware drafting: ``python -m examples.demo.draftbench``.

Two measurements (printed as Markdown tables, optionally written as JSON):

* ``levels``: the host cost of masking one draft level (``DraftSession.extend`` on host
  arrays: a fork, an accept and a fill per new node, then the upload to the model's device)
  next to the forward of that level (the demo's self drafter, its first layers and the head
  over ``batch * k`` rows, with the mask applied), at batch 1 and 8, for trees of 6 nodes
  (levels of 3 and 2) and 16 nodes (levels of 4, 4, 4, 3). Requests sit in different states
  of the person schema (prefixes of a reference output) and draft tokens their parent's row
  allows, so every node is live and costs a full fork, accept and fill.
* ``acceptance``: mean tokens committed per step of the self drafter (default settings:
  6 nodes, top-3, 24 of 30 layers, float32) drafting blind, root-only masked and masked per
  level, on the demo's person schema and on two more schemas (a book, an order) that the tests
  do not use; the n-gram drafter blind and grammar-aware too.

Tokens/s come from ``scripts/demo.sh --compare`` (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

__all__ = ["BENCH_SCHEMAS", "main"]

#: (schema, prompt) of the acceptance runs: the demo's default, and two the tests do not use
BENCH_SCHEMAS: dict[str, tuple[dict[str, Any] | None, str | None]] = {
    "person": (None, None),
    "book": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "author": {"type": "string"},
                "year": {"type": "integer"},
                "isbn": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{10}$"},
                "genres": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "enum": ["fiction", "science", "history", "poetry", "biography"],
                    },
                    "maxItems": 3,
                },
                "in_print": {"type": "boolean"},
            },
            "required": ["title", "author", "year", "isbn", "genres", "in_print"],
        },
        "Give a JSON object for this book. Title: The Analytical Engine. Author: Charles "
        "Babbage. Year: 1864. ISBN: 978-0123456789. Genres: science and history. In print: yes.",
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer"},
                "customer": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                    "required": ["name", "email"],
                },
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer", "minimum": 1},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "quantity", "price"],
                    },
                },
                "shipping": {"type": "string", "enum": ["standard", "express", "pickup"]},
                "paid": {"type": "boolean"},
            },
            "required": ["order_id", "customer", "items", "shipping", "paid"],
        },
        "Give a JSON object for this order. Order id: 4521. Customer name: Grace Hopper. "
        "Customer email: grace@navy.mil. Items: 2 of SKU A-100 at 9.99 each, 1 of SKU B-7 at "
        "24.50. Shipping: express. Paid: true.",
    ),
}

REFERENCE = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "address": {"street": '
    '"12 Engine Road", "city": "London", "zip": "10815"}, "tags": ["math", "poetry"]}'
)
SHAPES = {6: (3, [3, 2]), 16: (4, [4, 4, 4, 3])}  # nodes -> (branch, level widths)


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _matchers(batch: int, tok: Any, constraint: Any) -> list[Any]:
    """``batch`` matchers of the person schema, request ``b`` after a different prefix of the
    reference output (keys, strings, numbers, nested objects)."""
    ids = tok.encode(REFERENCE)
    out = []
    for b in range(batch):
        m = constraint.matcher()
        for t in ids[: 3 + (b * 7) % (len(ids) - 8)]:
            assert m.accept_token(t)
        out.append(m)
    return out


def _allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def _plan(session: Any, widths: list[int], branch: int, rng: Any, vocab: int) -> list[Any]:
    """Draw a tree level by level (parents among the previous level, tokens their parent's
    row allows) with a throwaway session; returns each level's host (parents, tokens)."""
    levels = []
    batch = session.batch
    frontier = np.zeros((batch, 1), np.int64)
    for k in widths:
        parents = frontier[:, np.arange(k) % frontier.shape[1]]
        tokens = np.zeros((batch, k), np.int64)
        known = session.verify_mask().reshape(batch, session.nodes, -1)  # every node's row
        for b in range(batch):
            for j in range(k):
                options = _allowed(known[b, parents[b, j]], vocab)
                tokens[b, j] = options[rng.integers(len(options))]
        first = session.nodes
        session.extend(parents, tokens, masks=False)
        levels.append((parents, tokens))
        frontier = np.broadcast_to(first + np.arange(k), (batch, k)).copy()
    return levels


def measure_levels(backend: str, rounds: int, log: Any) -> list[dict[str, Any]]:
    """Masking cost per level next to the forward of that level (see the module docstring)."""
    import portable_spec as ps
    from examples.demo.constraints import load_constraint
    from examples.demo.models import build_model, precision
    from examples.demo.tokenizer import load_tokenizer

    tok = load_tokenizer()
    constraint = load_constraint()
    vocab = 49152
    rows_out: list[dict[str, Any]] = []
    with precision(backend, "float32"):
        model = build_model(backend, "float32", 256)
        model.reset()
        model.prefill(np.asarray(tok.encode(REFERENCE)[:64]))
        device = model.mask_device
        for batch in (1, 8):
            matchers = _matchers(batch, tok, constraint)
            for nodes, (branch, widths) in SHAPES.items():
                rng = np.random.default_rng(batch * 100 + nodes)
                with ps.DraftSession(matchers, vocab) as planner:
                    levels = _plan(planner, widths, branch, rng, vocab)
                mask_s: list[list[float]] = [[] for _ in widths]
                upload_s: list[list[float]] = [[] for _ in widths]
                forward_s: list[list[float]] = [[] for _ in widths]
                for round_ in range(rounds + 1):  # the first round compiles (JAX): dropped
                    with ps.DraftSession(matchers, vocab, device=device) as session:
                        session.root_mask()
                        for i, (parents, tokens) in enumerate(levels):
                            before = session.timings["upload_s"]
                            t0 = time.perf_counter()
                            rows = session.extend(parents, tokens)
                            if round_:
                                mask_s[i].append(time.perf_counter() - t0)
                                upload_s[i].append(session.timings["upload_s"] - before)
                            # the level's forward: batch * k rows through the drafter
                            f = parents.size
                            state = model.draft_start(slots=f + 1, layers=24)
                            t0 = time.perf_counter()
                            model.draft_level(
                                state,
                                tokens.reshape(-1),
                                np.full(f, 64),
                                64,
                                np.arange(f),
                                np.eye(f, f + 1, dtype=bool),
                                rows,
                                branch=branch,
                                layers=24,
                            )
                            if round_:
                                forward_s[i].append(time.perf_counter() - t0)
                for i, k in enumerate(widths):
                    rec = {
                        "backend": backend,
                        "batch": batch,
                        "tree_nodes": nodes,
                        "level": i + 1,
                        "new_nodes": batch * k,
                        "mask_ms": 1e3 * float(np.median(mask_s[i])),
                        "upload_ms": 1e3 * float(np.median(upload_s[i])),
                        "forward_ms": 1e3 * float(np.median(forward_s[i])),
                        "load": _load(),
                    }
                    rec["mask_over_forward"] = rec["mask_ms"] / rec["forward_ms"]
                    rows_out.append(rec)
                    log(
                        f"{backend} bs {batch} {nodes} nodes level {i + 1}: mask "
                        f"{rec['mask_ms']:.3f} ms, forward {rec['forward_ms']:.1f} ms"
                    )
        model.close()
    return rows_out


def measure_acceptance(backend: str, max_new_tokens: int, log: Any) -> list[dict[str, Any]]:
    """Mean tokens per step of each drafter and masking mode on the three schemas."""
    from examples.demo.constraints import load_constraint
    from examples.demo.drafters import NgramDrafter, SelfDrafter
    from examples.demo.engine import generate, required_max_len
    from examples.demo.models import build_model, precision
    from examples.demo.tokenizer import load_tokenizer

    tok = load_tokenizer()
    modes = {
        "self, blind": lambda: SelfDrafter(6, masked=False),
        "self, root-only": lambda: SelfDrafter(6, root_only=True),
        "self, per level": lambda: SelfDrafter(6),
        "ngram, blind": lambda: NgramDrafter(6, masked=False),
        "ngram, grammar-aware": lambda: NgramDrafter(6),
    }
    out = []
    with precision(backend, "float32"):
        model = build_model(backend, "float32", 512)
        for name, (schema, prompt) in BENCH_SCHEMAS.items():
            constraint = load_constraint(schema=schema)
            text = prompt or constraint.default_prompt
            ids = tok.encode(tok.chat_prompt(text))
            assert required_max_len(len(ids), max_new_tokens, 6) <= model.max_len
            for mode, make in modes.items():
                gen = generate(
                    model,
                    constraint.matcher(),
                    ids,
                    max_new_tokens=max_new_tokens,
                    stop_ids=[tok.eos_id],
                    drafter=make(),
                )
                valid, _ = constraint.check(tok.decode(gen.tokens)) if gen.finished else (None, "")
                steps = max(1, len(gen.steps))
                rec = {
                    "backend": backend,
                    "schema": name,
                    "mode": mode,
                    "tokens": len(gen.tokens),
                    "steps": len(gen.steps),
                    "mean_accepted": gen.mean_accepted,
                    "drafted_per_step": sum(gen.draft_nodes_per_step) / steps,
                    "valid_per_step": sum(gen.valid_nodes_per_step) / steps,
                    "finished": gen.finished,
                    "valid_output": valid,
                }
                out.append(rec)
                log(f"{backend} {name} {mode}: {gen.mean_accepted:.3f} tokens/step")
        model.close()
    return out


def _tables(levels: list[dict[str, Any]], acceptance: list[dict[str, Any]]) -> str:
    lines = []
    if levels:
        lines += [
            "| backend | batch | tree | level | new nodes | mask (ms) | of which upload | "
            "level forward (ms) | mask / forward |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in levels:
            lines.append(
                f"| {r['backend']} | {r['batch']} | {r['tree_nodes']} nodes | {r['level']} | "
                f"{r['new_nodes']} | {r['mask_ms']:.3f} | {r['upload_ms']:.3f} | "
                f"{r['forward_ms']:.1f} | {100 * r['mask_over_forward']:.2f}% |"
            )
        lines.append("")
    if acceptance:
        lines += [
            "| backend | schema | mode | tokens | steps | tokens/step | drafted/step | "
            "valid/step | vs blind |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        blind = {
            (r["backend"], r["schema"], r["mode"].split(",")[0]): r["mean_accepted"]
            for r in acceptance
            if r["mode"].endswith("blind")
        }
        for r in acceptance:
            base = blind[(r["backend"], r["schema"], r["mode"].split(",")[0])]
            lines.append(
                f"| {r['backend']} | {r['schema']} | {r['mode']} | {r['tokens']} | {r['steps']} "
                f"| {r['mean_accepted']:.2f} | {r['drafted_per_step']:.2f} | "
                f"{r['valid_per_step']:.2f} | {r['mean_accepted'] / base:.2f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the measurements; Markdown on stdout, progress on stderr."""
    p = argparse.ArgumentParser(prog="python -m examples.demo.draftbench")
    p.add_argument("--backends", default="jax,torch")
    p.add_argument("--parts", default="levels,acceptance")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per level (default 7)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    parts = set(args.parts.split(","))
    levels, acceptance = [], []
    for backend in args.backends.split(","):
        if "levels" in parts:
            levels += measure_levels(backend, args.rounds, log)
        if "acceptance" in parts:
            acceptance += measure_acceptance(backend, args.max_new_tokens, log)
    print(_tables(levels, acceptance))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"levels": levels, "acceptance": acceptance, "cpus": os.cpu_count()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
