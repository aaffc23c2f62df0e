"""``scripts/soak.sh`` (``python -m tools soak``): many build+upload steps with varying
batches; memory stays flat.

Runs the steady state of an engine for a long time on SmolLM2's vocabulary: every step a
new batch size, new trees, persistent matchers per request slot, the mask built, uploaded to
the chosen backend and (every ``--check-every`` steps) compared with a rebuild on fresh data.
It samples resident memory, threads, the host-buffer pool and (for torch on CUDA) pinned and
device memory, and fails if any of them grows after warm-up beyond the given tolerance.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

__all__ = ["main", "rss_bytes", "run_soak"]


def rss_bytes() -> int:
    """Current resident set size of this process in bytes (Linux ``/proc``; else peak RSS)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sample(backend: Any) -> dict[str, float]:
    import portable_spec as ps
    from portable_spec.pool import pool_stats

    gc.collect()
    sample: dict[str, float] = {
        "rss_mb": rss_bytes() / 2**20,
        "threads": threading.active_count(),
        "pool_workers": pool_stats()["workers"],
    }
    pool = getattr(backend, "pool", None)
    if pool is not None:
        stats = pool.stats()
        sample["host_buffer_mb"] = stats["allocated_bytes"] / 2**20
        sample["host_buffers_lent"] = stats["lent"] + stats["in_flight"]
    if backend.name == "torch":
        import torch

        if torch.cuda.is_available():
            sample["cuda_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
    sample["slow_requests"] = ps.grammar_stats()["slow_requests"]
    return sample


def run_soak(
    steps: int,
    backend_name: str = "numpy",
    *,
    max_batch: int = 16,
    nodes: int = 16,
    check_every: int = 500,
    sample_every: int = 250,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Run ``steps`` build+upload steps and return the samples and a verdict.

    Returns a dict with ``samples`` (list of per-interval readings), ``warmup`` (index of the
    first sample after warm-up), ``growth`` (max - first-after-warm-up per reading),
    ``checks`` (correctness comparisons done) and ``seconds``.
    """
    import xgrammar as xgr

    import portable_spec as ps
    from portable_spec.testing import compile_sample, load_vocab, tokenizer_info
    from tools.masks import sample_batch

    vocab = load_vocab()
    compiler = xgr.GrammarCompiler(tokenizer_info(vocab))
    grammars = [compile_sample(compiler, k) for k in ("json_schema", "ebnf", "regex")]
    rng = np.random.default_rng(seed)
    backend = ps.get_backend(backend_name)
    put = _framework_put(backend.name)
    # a fixed pool of pre-generated batches keeps generation cost out of the loop
    batches = []
    for k in range(8):
        matchers, nt, ns, dt = sample_batch(
            grammars[k % 3], max_batch, nodes, vocab.size, rng, 0.85
        )
        batches.append((matchers, nt, ns, dt))
    samples = []
    checks = 0
    start = time.perf_counter()
    for step in range(steps):
        matchers, nt, ns, dt = batches[step % len(batches)]
        batch = int(rng.integers(1, max_batch + 1))
        grammars_now = [m if rng.random() < 0.9 else None for m in matchers[:batch]]
        tree = ps.GrammarTree.from_device(put(nt[:batch]), put(ns[:batch]), put(dt[:batch]))
        mask = ps.build_grammar_vocab_mask(grammars_now, tree, vocab.size)
        if mask is not None and step % check_every == 0:
            want = ps.build_host_bitmask(
                grammars_now,
                ps.GrammarTree.from_host(nt[:batch], ns[:batch], dt[:batch]),
                vocab.size,
            )
            if not np.array_equal(np.asarray(_to_numpy(mask)), want):
                raise AssertionError(f"step {step}: uploaded mask differs from a fresh host build")
            checks += 1
        del mask, tree
        if step % sample_every == 0 or step == steps - 1:
            samples.append({"step": step, **_sample(backend)})
            if progress:
                s = samples[-1]
                print(
                    f"step {step:6d}  rss {s['rss_mb']:.1f} MB  threads {s['threads']}",
                    file=sys.stderr,
                )
    warmup = min(len(samples) - 1, max(1, len(samples) // 10))
    keys = [k for k in samples[0] if k != "step"]
    growth = {k: max(s[k] for s in samples[warmup:]) - samples[warmup][k] for k in keys}
    return {
        "steps": steps,
        "backend": backend_name,
        "samples": samples,
        "warmup": warmup,
        "growth": growth,
        "checks": checks,
        "seconds": time.perf_counter() - start,
    }


def _framework_put(name: str) -> Any:
    if name == "torch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return lambda a: torch.from_numpy(a).to(device)
    if name == "jax":
        import jax.numpy as jnp

        return lambda a: jnp.asarray(a, dtype=jnp.int32)
    return lambda a: a


def _to_numpy(mask: Any) -> np.ndarray:
    if hasattr(mask, "detach"):
        return mask.detach().cpu().numpy()
    return np.asarray(mask)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/soak.sh",
        description="Long build+upload run; fails if memory, threads or buffers grow.",
    )
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--backend", default="numpy", choices=["numpy", "torch", "cuda", "jax"])
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--rss-tolerance-mb", type=float, default=16.0)
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.max_batch < 1 or args.nodes < 1:
        parser.error("--steps must be at least 2, --max-batch and --nodes positive")
    name = "torch" if args.backend == "cuda" else args.backend
    result = run_soak(
        args.steps, name, max_batch=args.max_batch, nodes=args.nodes, progress=not args.json
    )
    growth = result["growth"]
    ok = (
        growth["rss_mb"] <= args.rss_tolerance_mb
        and growth["threads"] == 0
        and growth["pool_workers"] == 0
        and growth.get("host_buffer_mb", 0) <= 64
    )
    result["ok"] = ok
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        first, last = result["samples"][result["warmup"]], result["samples"][-1]
        print(
            f"{result['steps']} steps on {name} in {result['seconds']:.1f} s, "
            f"{result['checks']} correctness checks\n"
            f"after warm-up (step {first['step']}): rss {first['rss_mb']:.1f} -> "
            f"{last['rss_mb']:.1f} MB (max growth {growth['rss_mb']:.1f} MB), threads "
            f"{first['threads']} -> {last['threads']}, pool workers {first['pool_workers']} -> "
            f"{last['pool_workers']}, host buffers {first.get('host_buffer_mb', 0):.1f} -> "
            f"{last.get('host_buffer_mb', 0):.1f} MB\n" + ("OK" if ok else "GROWTH DETECTED")
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
