"""Time vLLM's grammar_bitmask with the plugin on vs vLLM's own, inside one real engine run.

Usage: ``.venv-vllm/bin/python scripts/bench-vllm.py [--backend xgrammar] [BATCH ...]``
(default batches 1 16 32; run ``bash scripts/setup-vllm.sh`` first).

One engine (n-gram speculation, K=4, the end-to-end test's prompts), the plugin in shadow
mode: every ``grammar_bitmask`` call runs both builds, in alternating order, so both see the
same steps, matchers and machine load. Prints the median time per call of each build by
batch (the number of structured requests in the call; a generate call of N prompts runs
most of its steps at batch N) and their ratio, and the rows compared and differing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    """Run the engine once in shadow mode and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batches", nargs="*", type=int, default=[1, 16, 32])
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--repeat", type=int, default=3, help="generate calls per batch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        env = dict(
            os.environ,
            PORTABLE_SPEC_TEST_MODES="shadow",
            PORTABLE_SPEC_TEST_REPEAT=str(args.repeat),
        )
        runner = os.path.join(ROOT, "tests", "real_vllm", "engine_run.py")
        cmd = [sys.executable, runner, args.backend, out, *map(str, args.batches)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            stats = json.load(f)["runs"]["shadow/stats"]
    ours, theirs = stats["median_us"]["portable_spec"], stats["median_us"]["vllm"]
    samples = stats["samples"]["portable_spec"]
    print(f"vLLM grammar_bitmask per call, {args.backend}, K=4, shadow mode (same engine run)")
    print(f"{'batch':>6} {'calls':>6} {'vLLM µs':>9} {'plugin µs':>10} {'plugin/vLLM':>12}")
    for batch in args.batches:
        key = str(batch)
        if key not in ours or key not in theirs:
            print(f"{batch:>6} {'-':>6} (no call at exactly this batch)")
            continue
        ratio = ours[key] / theirs[key]
        print(f"{batch:>6} {samples[key]:>6} {theirs[key]:>9.0f} {ours[key]:>10.0f} {ratio:>12.2f}")
    print(f"rows compared {stats['rows_compared']}, differing {stats['rows_differing']}")
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
