"""sglang-jax's grammar-aware EAGLE drafting (the integration's ``DraftSession`` on the draft
steps), off and on, on the JSON-schema workloads every engine's drafting benchmark uses
(``portable_spec.testing.SCHEMA_WORKLOADS``: an invoice, a tool call; long fixed keys, enums).

Usage: ``.venv-sglang-jax/bin/python -P scripts/bench-sglang-jax-drafting.py [--tokens N]
[--rounds R] [--shapes chain tree] [--workloads invoice tool_call] [--no-warmup]`` (run
``bash scripts/setup-sglang-jax.sh`` first).

sglang-jax's own engine on JAX CPU, SmolLM2-135M as the target and the random-weight EAGLE-3
head as the drafter (its own guesses are never right: the only head that can be made offline),
in-process, without the overlap schedule (sglang-jax's EAGLE-3 path on CPU), the integration
installed. First a non-speculative engine generates each workload's request (greedy): the
reference. Then one engine per drafting shape (chains: 3 steps, 4 verify nodes; trees: top-2,
3 steps, 4 verify nodes) generates each workload's request alone: a warm-up call (unless
``--no-warmup``: the token figures are the same, the first call's time then includes
compiles), then ``R`` rounds of one call with the drafting masks and one without,
interleaved. Printed per shape, workload and drafting mode, from the integration's counters
(what sglang-jax committed per request and verify step) and sglang-jax's outputs:

* ``verifies``: the request's verify steps (request-steps after its prefill);
* ``acc/verify``: tokens committed per verify step, the bonus token included (1.00: only the
  target's own token; the head's drafts all rejected);
* ``tok/req-step``: output tokens per step the request took, its prefill included;
* ``greedy``: whether every call's output is the reference's token for token (``same``);
* ``s/call``: the median wall time of the measured calls (JAX CPU; a ratio, not a TPU figure);
* ``kv``: sglang-jax's idle-time check of its KV pools after every call (``ok``: nothing left).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "real_sglang_jax")
SHAPES = {"chain": (1, 3, 4), "tree": (2, 3, 4)}
COLUMNS = (
    ("shape", 5),
    ("workload", 9),
    ("drafting", 8),
    ("tokens", 6),
    ("verifies", 8),
    ("acc/verify", 10),
    ("tok/req-step", 12),
    ("greedy", 6),
    ("s/call", 7),
    ("kv", 4),
)


def workload_requests(names: list[str]) -> list[dict[str, str]]:
    """One request per workload: its prompt, its schema as sglang-jax's ``json_schema``."""
    from portable_spec.testing import SCHEMA_WORKLOADS

    return [
        {"prompt": SCHEMA_WORKLOADS[n][1], "json_schema": json.dumps(SCHEMA_WORKLOADS[n][0])}
        for n in names
    ]


def launch_engine(config: dict[str, Any], what: str) -> dict[str, Any]:
    """tests/real_sglang_jax/_engine.launch; a failed run stops the bench."""
    sys.path.insert(0, TESTS)
    from _engine import launch

    with tempfile.TemporaryDirectory() as tmp:
        report, log, code = launch(Path(tmp), config, {"JAX_PLATFORMS": "cpu"})
    if report is None:
        sys.exit(f"{what}: engine run failed ({code}):\n{log[-4000:]}")
    return report


def reference(requests: list[dict], tokens: int) -> list[tuple[list[int], str]]:
    """Each request's greedy output from sglang-jax's non-speculative engine, and how it
    finished (``stop``: its grammar's end; ``length``)."""
    engine = {"disable_overlap_schedule": True, "enable_single_process": True}
    calls = [(True, [i]) for i in range(len(requests))]
    config = {"engine": engine, "install": True, "requests": requests, "calls": calls,
              "max_new_tokens": tokens}  # fmt: skip
    report = launch_engine(config, "reference")
    return [(run["ids"][0], run["finish"][0]["type"]) for run in report["runs"]]


def speculative(
    shape: str, requests: list[dict], tokens: int, rounds: int, warmup: bool = True
) -> list[dict]:
    """One EAGLE-3 engine: per request a warm-up call (``warmup``), then ``rounds``
    interleaved on/off pairs; the measured calls' runs (each tagged with its request)."""
    sys.path.insert(0, TESTS)
    from _engine import eagle3

    topk, steps, nodes = SHAPES[shape]
    calls = []
    for i in range(len(requests)):
        if warmup:
            calls.append((True, [i]))
        calls += [(drafting, [i]) for _ in range(rounds) for drafting in (True, False)]
    config = eagle3(topk, steps, nodes, max_new_tokens=tokens, requests=requests, calls=calls)
    runs = launch_engine(config, f"EAGLE-3 {shape}")["runs"]
    warm = {1 + i * (1 + 2 * rounds) for i in range(len(requests))} if warmup else set()
    return [run for n, run in enumerate(runs, 1) if n not in warm]


def same_output(ids: list[int], reference: tuple[list[int], str]) -> bool:
    """Token for token; where the reference was cut at the token limit, a speculative step may
    commit a few more (sglang-jax stops after the step): it only has to begin with it."""
    ref, finish = reference
    return ids[: len(ref)] == ref if finish == "length" else ids == ref


def main() -> None:
    """Run every shape and workload and print the table."""
    from portable_spec.testing import SCHEMA_WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="max new tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="measured calls per mode")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--workloads", nargs="*", default=list(SCHEMA_WORKLOADS),
                        choices=list(SCHEMA_WORKLOADS))  # fmt: skip
    parser.add_argument("--no-warmup", action="store_true", help="no warm-up call per request")
    args = parser.parse_args()
    requests = workload_requests(args.workloads)
    greedy = reference(requests, args.tokens)
    print("sglang-jax on JAX CPU, SmolLM2-135M target, random EAGLE-3 head, no overlap schedule;")
    print(f"one request per call, max {args.tokens} new tokens, {args.rounds} rounds per mode")
    print(" ".join(f"{name:>{width}}" for name, width in COLUMNS))
    for shape in args.shapes:
        runs = speculative(shape, requests, args.tokens, args.rounds, not args.no_warmup)
        for i, name in enumerate(args.workloads):
            figures = {}
            for drafting in (False, True):
                mine = [r for r in runs if r["cases"] == [i] and r["drafting"] == drafting]
                out = mine[0]  # greedy: every call of a mode commits the same tokens
                stats = out["stats"]
                verifies, committed = stats["constrained_verifies"], stats["accepted_tokens"]
                tokens = out["completion_tokens"][0]
                same = all(same_output(r["ids"][0], greedy[i]) for r in mine)
                clean = all(r["kv_leak"] is None for r in mine)
                seconds = statistics.median(r["seconds"] for r in mine)
                per_verify = committed / verifies if verifies else float("nan")
                figures[drafting] = (per_verify, seconds)
                print(f"{shape:>5} {name:>9} {'on' if drafting else 'off':>8} {tokens:>6} "
                      f"{verifies:>8} {per_verify:>10.2f} {tokens / (verifies + 1):>12.2f} "
                      f"{'same' if same else 'DIFF':>6} {seconds:>7.1f} "
                      f"{'ok' if clean else 'LEAK':>4}")  # fmt: skip
            (off, t_off), (on, t_on) = figures[False], figures[True]
            print(f"{shape:>5} {name:>9} {'on/off':>8} {'':>6} {'':>8} {on / off:>10.2f}x "
                  f"{'':>11} {'':>6} {t_on / t_off:>6.2f}x")  # fmt: skip
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
