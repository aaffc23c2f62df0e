"""Section 4, overlap: how much of the mask build hides behind the verify forward.

A jitted JAX computation (a loop of ``tanh(x @ w)``, sized to take about ``forward_factor``
times the build) stands in for the target model's verify forward. On the CPU platform JAX
dispatches it asynchronously, so the host can build the mask while it runs, which is the
ordering the library is designed for. Two stand-ins are measured:

``one core``
    small matmuls (``[32, 256] @ [256, 256]``) that XLA runs on one thread: the forward keeps
    one core busy and leaves the others to the host, as an accelerator's forward does.
``all cores``
    wide matmuls (``[128, 512] @ [512, 512]``) that XLA spreads over every core: a CPU-only
    engine, where the build can only take cores away from the forward.

The step::

    tree = GrammarTree.from_device(...)        # after the draft kernels
    logits = verify_forward(...)               # async dispatch, returns at once
    mask = build_grammar_vocab_mask(...)       # host work while the forward runs
    apply ... (waits for both)

Methods per round (same fresh JAX tree arrays for all):

``forward``          the forward alone (dispatch + wait)
``build``            ``from_device`` + ``build_grammar_vocab_mask`` + wait for the upload
``serial step``      wait for the forward, then build (no overlap)
``overlapped step``  build while the forward runs, then wait for both

``hidden = (serial - overlapped) / build``: the fraction of the build the forward hid (1 is
all of it). On a CPU both compete for the same cores, so this is a lower bound of what an
accelerator forward allows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tools.bench.timing import (
    Method,
    QuietPolicy,
    RoundPlan,
    measure_quietly,
    median,
    run_rounds,
    usable_cores,
)
from tools.bench.workloads import RequestPool, Setup

__all__ = ["run_overlap_section"]


FORWARDS = {"one core": (32, 256), "all cores": (128, 512)}


def _make_forward(target_s: float, rows: int, width: int) -> tuple[Callable[[], Any], int, float]:
    """A jitted stand-in forward taking about ``target_s`` seconds: a loop of
    ``tanh(h @ w)`` with ``h: [rows, width]``. Returns the call, its loop steps and the cores
    it keeps busy (process CPU time over wall time while it runs alone)."""
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(np.random.default_rng(2).standard_normal((rows, width), dtype=np.float32))
    w = jnp.asarray(np.random.default_rng(3).standard_normal((width, width), dtype=np.float32))
    w = w / np.float32(np.sqrt(width))

    def compiled(steps: int) -> Callable[[], Any]:
        fn = jax.jit(lambda x, w: jax.lax.fori_loop(0, steps, lambda _, h: jnp.tanh(h @ w), x))
        fn(x, w).block_until_ready()  # compile
        return lambda: fn(x, w)

    probe_steps = 50
    probe = compiled(probe_steps)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        probe().block_until_ready()
        times.append(time.perf_counter() - t0)
    per_step = max(min(times) / probe_steps, 1e-7)
    steps = max(1, round(target_s / per_step))
    forward = compiled(steps)
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        forward().block_until_ready()
    busy = (_cpu_seconds() - cpu0) / (time.perf_counter() - t0)
    return forward, steps, busy


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def run_overlap_section(
    setup: Setup,
    pool: RequestPool,
    batch: int,
    plan: RoundPlan,
    *,
    forward_factor: float = 1.5,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure the four methods on JAX (CPU here) with each stand-in forward; return one
    record per stand-in."""
    import jax
    import jax.numpy as jnp

    import portable_spec as ps

    vocab = setup.vocab_size
    policy = policy or QuietPolicy()

    def inputs(_r: int) -> tuple[list[Any], tuple[Any, Any, Any]]:
        sample = pool.sample(batch)
        arrays = tuple(
            jnp.array(a.astype(np.int32), copy=True)
            for a in (sample.next_token, sample.next_sibling, sample.draft_tokens)
        )
        jax.block_until_ready(arrays)
        return sample.matchers, arrays  # type: ignore[return-value]

    def build(matchers: list[Any], arrays: tuple[Any, Any, Any]) -> Any:
        tree = ps.GrammarTree.from_device(*arrays)
        return ps.build_grammar_vocab_mask(matchers, tree, vocab)

    # calibrate the stand-in forwards on the build time of a few batches
    build_times = []
    for r in range(5):
        matchers, arrays = inputs(r)
        t0 = time.perf_counter()
        build(matchers, arrays).block_until_ready()
        build_times.append(time.perf_counter() - t0)
    target = forward_factor * float(np.median(build_times))

    records = []
    for variant, (rows, width) in FORWARDS.items():
        forward, steps, forward_busy = _make_forward(target, rows, width)
        seconds, busy = measure_quietly(
            lambda f=forward: _measure(f, build, inputs, plan, vocab), policy
        )
        med = {k: median(v) for k, v in seconds.items()}
        dispatch = []
        for _ in range(5):
            t0 = time.perf_counter()
            pending = forward()
            dispatch.append(time.perf_counter() - t0)
            pending.block_until_ready()
        records.append(
            {
                "framework": f"jax {jax.__version__} ({jax.devices()[0].platform})",
                "forward": variant,
                "forward_shape": [rows, width],
                "forward_steps": steps,
                "forward_busy_cores": forward_busy,
                "kind": pool.kind,
                "shape": pool.shape,
                "nodes": pool.next_token.shape[1],
                "batch": batch,
                "rounds": len(seconds["build"]),
                "cores": usable_cores(),
                "threads": ps.get_num_threads(),
                "forward_dispatch_seconds": median(dispatch),
                "seconds": med,
                "hidden_fraction": (med["serial step"] - med["overlapped step"]) / med["build"],
                "overlapped_over_serial": med["overlapped step"] / med["serial step"],
                "other_busy_cores": busy,
            }
        )
        if advance is not None:
            advance(f"overlap ({variant} forward)")
    return records


def _measure(
    forward: Callable[[], Any],
    build: Callable[[list[Any], tuple[Any, Any, Any]], Any],
    inputs: Callable[[int], Any],
    plan: RoundPlan,
    vocab: int,
) -> dict[str, list[float]]:
    import portable_spec as ps

    def m_forward(_: Any) -> Callable[[], Any]:
        return lambda: forward().block_until_ready()

    def m_build(data: Any) -> Callable[[], Any]:
        return lambda: build(*data).block_until_ready()

    def m_serial(data: Any) -> Callable[[], Any]:
        matchers, arrays = data

        def call() -> None:
            tree = ps.GrammarTree.from_device(*arrays)
            forward().block_until_ready()
            ps.build_grammar_vocab_mask(matchers, tree, vocab).block_until_ready()

        return call

    def m_overlapped(data: Any) -> Callable[[], Any]:
        matchers, arrays = data

        def call() -> None:
            tree = ps.GrammarTree.from_device(*arrays)
            logits = forward()
            mask = ps.build_grammar_vocab_mask(matchers, tree, vocab)
            logits.block_until_ready()
            mask.block_until_ready()

        return call

    methods = [
        Method("forward", m_forward),
        Method("build", m_build),
        Method("serial step", m_serial),
        Method("overlapped step", m_overlapped),
    ]
    seconds, _ = run_rounds(methods, inputs, plan)
    return seconds
