"""The sglang plugin's speed against sglang 0.5.23's own code, inside its verify step and its
plain fill, on CPU.

Usage: ``.venv-sglang/bin/python scripts/bench-sglang.py [--rounds R] [--batches 1,8,64]
[--backend xgrammar|llguidance] [--out FILE]`` (run ``bash scripts/setup-sglang.sh`` first).

What is timed, the same way on both sides (sglang's own function and the plugin's, called in
turn in each round, their order alternating from round to round, over the same grammar
objects and trees; medians and spread):

* ``verify``: ``build_grammar_vocab_mask`` called as sglang's ``run_eagle_verify`` calls it:
  the tree from ``GrammarTree.from_device`` of the verify input sglang's own draft-tree code
  built (``select_top_k_tokens``, ``organize_draft_results``, ``build_eagle_verify_input``;
  topk 8, 5 steps, 64 nodes, a draft favouring a grammatical path), ``device`` the CPU, no
  barrier; requests with SmolLM2's JSON-schema grammar (49152 tokens) in random states. The
  rows of both builds are compared every round.
* ``fill``: sglang's ``SamplingBatchInfo.update_regex_vocab_mask`` (its allocation, the fill,
  the move) over the same kind of grammars, one row per request: sglang's serial loop against
  the plugin's (xgrammar's batched fill). The masks are compared every round.

torch runs one thread (``torch.set_num_threads(1)``) and, on this CPU-only torch, sglang's
masks are not pinned (``pin_memory`` is False without CUDA): without these, torch's intra-op
threads on busy cores make sglang's per-step ``torch.full`` of the mask cost milliseconds, a
figure of the machine, not of either build. The library builds on its own thread pool
(``PORTABLE_SPEC_NUM_THREADS``, default: the cores), which is what it brings.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "real_sglang")


def _setup() -> None:
    sys.path.insert(0, TESTS)
    import conftest  # noqa: F401  sglang on CPU: Triton's interpreter, the import stubs
    import torch

    torch.set_num_threads(1)


def _grammars(backend: str, batch: int, rng: Any) -> list:
    import _sgl

    words = (_sgl.VOCAB + 31) // 32
    out = []
    for _ in range(batch):
        made = _sgl.grammar(backend, "json_schema")
        _sgl.advance(made, int(rng.integers(0, 40)), rng, words)
        out.append(made)
    return out


def _spread(values: list[float]) -> str:
    return f"{1e3 * min(values):.3f}..{1e3 * max(values):.3f}"


SHAPES = {"tree": (8, 5, 64), "chain": (1, 3, 4)}  # (topk, steps, nodes)


def _sides(round_: int) -> tuple[str, str]:
    """The order of the two sides in a round: alternated, so that neither is always the one
    timed right after the other."""
    return ("sglang", "portable_spec") if round_ % 2 else ("portable_spec", "sglang")


def bench_verify(backend: str, shape: str, batch: int, rounds: int, rng: Any) -> dict:
    import _eagle
    import _sgl
    import torch
    from sglang.srt.speculative import spec_utils

    from portable_spec.integrations.sglang import internals, state

    grammars = _grammars(backend, batch, rng)
    reqs = [_sgl.Req(g) for g in grammars]
    print(f"  building sglang's EAGLE trees for batch {batch} (Triton's interpreter)...",
          flush=True)  # fmt: skip
    started = time.perf_counter()
    topk, steps, nodes = SHAPES[shape]
    verify_input = _eagle.draft_tree(grammars, topk, steps, nodes, _sgl.VOCAB, rng)
    print(f"  trees built in {time.perf_counter() - started:.0f} s", flush=True)
    tree = _eagle.tree_of(verify_input)
    assert _sgl.plugin.install("on")
    try:
        build = {
            "sglang": state.INTEGRATION.patch_set().original(internals.BUILD),
            "portable_spec": spec_utils.build_grammar_vocab_mask,
        }
        times: dict[str, list[float]] = {"sglang": [], "portable_spec": []}
        for round_ in range(rounds + 1):
            masks = {}
            for side in _sides(round_):
                info = _sgl.SamplingInfo(_sgl.VOCAB)
                started = time.perf_counter()
                made = spec_utils.GrammarTree.from_device(*tree)
                got = build[side](
                    reqs=reqs, tree=made, sampling_info=info, device=torch.device("cpu"),
                    barrier=None,
                )  # fmt: skip
                elapsed = time.perf_counter() - started
                masks[side] = got.vocab_mask
                if round_:  # the first round warms both up
                    times[side].append(elapsed)
            if not torch.equal(masks["sglang"], masks["portable_spec"]):
                sys.exit(f"rows differ at batch {batch}")
    finally:
        _sgl.plugin.uninstall()
    rows = masks["sglang"].shape[0]
    constrained = int((masks["sglang"] != -1).any(dim=1).sum())
    return {"times": times, "rows": rows, "constrained": constrained}


def bench_fill(backend: str, batch: int, rounds: int, rng: Any) -> dict:
    import _sgl
    import torch
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
    from test_fill import update

    from portable_spec.integrations.sglang import internals, state

    grammars = _grammars(backend, batch, rng)
    times: dict[str, list[float]] = {"sglang": [], "portable_spec": []}
    assert _sgl.plugin.install("on")
    fill = {
        "sglang": staticmethod(state.INTEGRATION.patch_set().original(internals.FILL)),
        "portable_spec": vars(BaseGrammarObject)["fill_vocab_mask_batched"],
    }
    try:
        for round_ in range(rounds + 1):
            masks = {}
            for side in _sides(round_):
                BaseGrammarObject.fill_vocab_mask_batched = fill[side]
                started = time.perf_counter()
                got = update(grammars, _sgl.VOCAB)
                elapsed = time.perf_counter() - started
                masks[side] = got.vocab_mask
                if round_:
                    times[side].append(elapsed)
            if not torch.equal(masks["sglang"], masks["portable_spec"]):
                sys.exit(f"plain rows differ at batch {batch}")
    finally:
        BaseGrammarObject.fill_vocab_mask_batched = fill["portable_spec"]
        _sgl.plugin.uninstall()
    return {"times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--backend", default="xgrammar", choices=["xgrammar", "llguidance"])
    parser.add_argument("--shapes", default="tree,chain", help="of: " + ", ".join(SHAPES))
    parser.add_argument("--skip-verify", action="store_true")
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    args = parser.parse_args()
    _setup()
    import numpy as np
    import torch

    import portable_spec as ps

    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; torch {torch.__version__} on {torch.get_num_threads()} "
        f"thread; library pool {ps.get_num_threads()} threads; backend {args.backend}; "
        f"{args.rounds} rounds, interleaved; 1-minute load before: {os.getloadavg()[0]:.1f}",
        "",
    ]
    if not args.skip_verify:
        lines += [
            "verify step: build_grammar_vocab_mask over sglang's EAGLE trees (tree: topk 8, 5 "
            "steps, 64 nodes; chain: topk 1, 3 steps, 4 nodes)",
            "",
            "| shape | batch | rows | constrained rows | sglang ms | portable_spec ms | speed-up "
            "| sglang spread | portable_spec spread |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for shape in args.shapes.split(","):
            for batch in batches:
                print(f"verify, {shape}, batch {batch}", flush=True)
                got = bench_verify(args.backend, shape, batch, args.rounds, rng)
                own, ours = (
                    statistics.median(got["times"][s]) for s in ("sglang", "portable_spec")
                )
                lines.append(
                    f"| {shape} | {batch} | {got['rows']} | {got['constrained']} | "
                    f"{1e3 * own:.3f} | {1e3 * ours:.3f} | {own / ours:.1f}x | "
                    f"{_spread(got['times']['sglang'])} | "
                    f"{_spread(got['times']['portable_spec'])} |"
                )
                print(lines[-1], flush=True)
        lines.append("")
    lines += [
        "plain fill: update_regex_vocab_mask (allocation, fill, move), one row per request",
        "",
        "| batch | sglang ms | portable_spec ms | speed-up | sglang spread "
        "| portable_spec spread |",
        "|---|---|---|---|---|---|",
    ]
    for batch in batches:
        print(f"fill, batch {batch}", flush=True)
        got = bench_fill(args.backend, batch, max(args.rounds, 30), rng)
        own, ours = (statistics.median(got["times"][s]) for s in ("sglang", "portable_spec"))
        lines.append(
            f"| {batch} | {1e3 * own:.3f} | {1e3 * ours:.3f} | {own / ours:.2f}x | "
            f"{_spread(got['times']['sglang'])} | {_spread(got['times']['portable_spec'])} |"
        )
        print(lines[-1], flush=True)
    lines.append(f"\n1-minute load after: {os.getloadavg()[0]:.1f}")
    text = "\n".join(lines)
    print()
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
