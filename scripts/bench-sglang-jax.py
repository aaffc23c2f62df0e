"""The sglang-jax integration's mask time inside sglang-jax's engine on JAX CPU: how much of the
mask build the target verify forward does not hide, per verify step, and the accepted tokens
per step with and without the drafting masks.

Usage: ``.venv-sglang-jax/bin/python -P scripts/bench-sglang-jax.py [--tokens N] [--rounds R]``
(run ``bash scripts/setup-sglang-jax.sh`` first).

One engine per drafting shape (EAGLE-3 chains: 3 steps, 4 verify nodes; trees: top-2, 3 steps,
4 verify nodes), SmolLM2 with the random-weight EAGLE-3 head, in-process, the integration in
timing mode (each masked step also waits for the verify logits, to tell when the forward was
done). Per batch (1: the JSON request alone; 4: JSON, date regex, free text, another JSON) a
warm-up generate call, then ``R`` rounds of one call with the drafting masks and one without,
interleaved. Prints per verify step the medians of: the mask build's wait (how long ``sample``
waited for the build), the exposed mask time (mask ready after the logits: the part of the
build the forward did not hide), the verify step (``BaseSpecWorker.verify``), their ratio, and
the accepted tokens per constrained verify (bonus included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "real_sglang_jax")
SHAPES = {"chain": (1, 3, 4), "tree": (2, 3, 4)}
BATCHES = {1: [0], 4: [0, 1, 2, 3]}


def run(shape: str, batch: int, tokens: int, rounds: int) -> list[dict]:
    """One engine (tests/real_sglang_jax/_engine.launch): a warm-up call, then the measured
    calls; their stats. A failed run, or one without a masked verify step, stops the bench."""
    sys.path.insert(0, TESTS)
    from _engine import eagle3, launch

    topk, steps, nodes = SHAPES[shape]
    drafting = [True] + [True, False] * rounds
    config = eagle3(topk, steps, nodes, max_new_tokens=tokens, drafting=drafting, timing=True,
                    case_indices=BATCHES[batch])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        report, log, code = launch(Path(tmp), config, {"JAX_PLATFORMS": "cpu"})
    if report is None:
        sys.exit(f"engine run failed ({code}):\n{log[-4000:]}")
    runs = report["runs"][1:]
    if not all(r["stats"]["masked_steps"] > 0 for r in runs):
        sys.exit(f"a run without a masked verify step ({shape}, batch {batch}):\n{log[-4000:]}")
    return runs


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def main() -> None:
    """Run every shape and batch and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24, help="max new tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="measured calls per drafting mode")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    args = parser.parse_args()
    print(
        "sglang-jax on JAX CPU, SmolLM2-135M target, random EAGLE-3 head; medians per verify step"
    )
    print(
        f"{'shape':>6} {'batch':>5} {'drafting':>8} {'steps':>5} {'wait ms':>8} "
        f"{'exposed ms':>10} {'verify ms':>9} {'exposed/verify':>14} {'tokens/step':>11}"
    )
    for shape in args.shapes:
        for batch in args.batches:
            runs = run(shape, batch, args.tokens, args.rounds)
            for drafting in (True, False):
                stats = [r["stats"] for r in runs if r["drafting"] == drafting]
                waits = [w for s in stats for w in s["waited_s"]]
                exposed = [e for s in stats for e in s["exposed_s"]]
                steps = [t for s in stats for t in s["step_s"]]
                ratios = [
                    e / t
                    for s in stats
                    for e, t in zip(s["exposed_s"], s["step_s"], strict=False)
                    if t > 0
                ]
                accepted = sum(s["accepted_tokens"] for s in stats)
                verifies = sum(s["constrained_verifies"] for s in stats)
                per_step = accepted / verifies if verifies else float("nan")
                ratio = statistics.median(ratios) if ratios else float("nan")
                print(f"{shape:>6} {batch:>5} {'on' if drafting else 'off':>8} {len(steps):>5} "
                      f"{median_ms(waits):>8.3f} {median_ms(exposed):>10.3f} "
                      f"{median_ms(steps):>9.1f} {ratio:>14.4f} {per_step:>11.2f}")  # fmt: skip
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
