"""Time the grammar mask of a tpu-inference step: its own per-request apply vs the integration.

Usage: ``.venv-vllm/bin/python scripts/bench-tpu-inference.py [--repeat 40] [BATCH ...]``
(default batches 1 16 64; run ``bash scripts/setup-tpu-inference.sh`` first).

Per batch: one step of tpu-inference 0.32's own runner on JAX CPU (its input batch and
spec-decode metadata, ``tests/real_tpu_inference/steps.py``) with 4 drafts per request, every
request constrained (JSON schemas and a regex over SmolLM2's 49152-token vocabulary), the
rows from vLLM 0.32's own ``grammar_bitmask``. Both versions of
``prepare_structured_decoding_input`` followed by ``structured_decode_fn`` run on the same
step and the same logits, alternating call by call, each until the masked logits are ready:
the time the mask adds to the sampler. The logits are fresh for every call, as the model's
forward leaves them: the integration donates them to the masked result, tpu-inference's own
apply writes a new array. Prints the medians (µs) of the host part (prepare and upload) and
of the whole, and the ratio of the wholes.

tpu-inference's own code runs only where its ``max_num_reqs`` covers the logits rows (with
speculation there are ``1 + drafts`` rows per request; below that it fails to broadcast): its
buffers get exactly the logits rows here. Its rows are misplaced (that is the defect); the
work it does per step is what is timed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "real_tpu_inference"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import tpu_env  # noqa: E402

K = 4


def main() -> None:
    """Build one step per batch and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batches", nargs="*", type=int, default=[1, 16, 64])
    parser.add_argument("--repeat", type=int, default=40, help="timed calls of each version")
    args = parser.parse_args()
    reason = tpu_env.available()
    if reason:
        sys.exit(reason)
    tpu = tpu_env.load()
    import steps
    from tpu_inference.runner.structured_decoding_manager import StructuredDecodingManager

    from portable_spec.integrations import tpu_inference

    versions = {"tpu-inference": _methods(StructuredDecodingManager)}
    assert tpu_inference.install()
    versions["portable_spec"] = _methods(StructuredDecodingManager)
    grammars = steps.grammars()
    print(f"grammar mask of a tpu-inference step, K={K}, vocab {steps.VOCAB}, JAX CPU, µs")
    print(
        f"{'batch':>5} {'rows':>5} | {'tpu-inference host':>18} {'total':>7} | "
        f"{'portable_spec host':>18} {'total':>7} | {'ratio':>6}"
    )
    for batch_size in args.batches:
        rng = random.Random(batch_size)
        runner = steps.make_runner(tpu, max(8, batch_size), K)
        batch = [
            steps.random_request(rng, f"r{i}", grammars, K, "valid", full=True)
            for i in range(batch_size)
        ]
        step = steps.build_step(runner, tpu, batch, rng)
        rows, words = step.logits.shape[0], step.grammar_output.grammar_bitmask.shape[1]
        # tpu-inference's own buffers, as large as its max_num_reqs must be to run this step
        runner.grammar_bitmask_cpu = np.zeros((max(rows, runner.max_num_reqs), words), np.int32)
        runner.require_structured_out_cpu = np.zeros((len(runner.grammar_bitmask_cpu), 1), bool)
        runner.execute_model_state = step.state
        times: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in versions}
        for i in range(args.repeat + 3):
            order = list(versions) if i % 2 == 0 else list(versions)[::-1]
            for name in order:
                host, total = _time(runner, step, *versions[name])
                if i >= 3:  # the first calls compile
                    times[name][0].append(host)
                    times[name][1].append(total)
        (own_host, own_total), (our_host, our_total) = (
            tuple(statistics.median(t) * 1e6 for t in times[v]) for v in versions
        )
        print(
            f"{batch_size:>5} {rows:>5} | {own_host:>18.0f} {own_total:>7.0f} | "
            f"{our_host:>18.0f} {our_total:>7.0f} | {our_total / own_total:>6.2f}"
        )
    tpu_inference.uninstall()
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")


def _methods(manager_class: type) -> tuple:
    return (
        manager_class.prepare_structured_decoding_input,
        manager_class.__dict__["structured_decode_fn"],
    )


def _time(runner: object, step: object, prepare: object, decode: object) -> tuple[float, float]:
    from tpu_inference.utils import device_array

    manager = runner.structured_decoding_manager
    # this step's logits, fresh as the model's forward leaves them (the integration donates
    # them to the masked result; tpu-inference's own apply writes a new array)
    logits = device_array(runner.mesh, step.logits_host.copy()).block_until_ready()
    start = time.perf_counter()
    first, second, third = prepare(manager, logits, step.grammar_output)
    host = time.perf_counter()
    decode(manager, first, second, logits, third).block_until_ready()
    end = time.perf_counter()
    return host - start, end - start


if __name__ == "__main__":
    main()
