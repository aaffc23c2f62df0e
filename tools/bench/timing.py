"""Interleaved rounds: every method runs once per round, in a fresh random order, on the same
inputs; figures are medians over rounds and ratios are taken between medians of one run.

The order is a random permutation per round (seeded), not a rotation: with a rotation each
method always follows the same predecessor, and a predecessor that leaves the process in a
costly state (thousands of freed small blocks that glibc coalesces on the next larger
allocation, after torch's scalar-tensor traffic) would always penalise the same method.
:func:`settle` also pays that coalescing, untimed, after every call.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

R = TypeVar("R")

__all__ = [
    "LoadMeter",
    "Method",
    "QuietPolicy",
    "RoundPlan",
    "Timer",
    "background_busy_cores",
    "cuda_event_timer",
    "geomean",
    "host_timer",
    "measure_quietly",
    "median",
    "run_rounds",
    "usable_cores",
    "wait_for_quiet",
]

T = TypeVar("T")

#: times one call: ``timer(call) -> seconds`` (the call's return value is dropped)
Timer = Callable[[Callable[[], Any]], float]


def host_timer(call: Callable[[], Any]) -> float:
    """Host wall time of ``call()`` (``time.perf_counter``): for host work, or device work the
    call itself waits for."""
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def cuda_event_timer(lead_cycles: int = 2_000_000) -> Timer:
    """A timer of the GPU work ``call()`` queues on the current CUDA stream, by CUDA events.

    Before the start event a ``torch.cuda._sleep(lead_cycles)`` spin (about 1 ms on an H200)
    keeps the stream busy while the host issues the call, so the measured span holds the
    queued work only, not the host's launch overhead (0: no spin, where ``_sleep`` is
    missing too). Blocks until the end event completed. Imports torch.
    """
    import torch

    sleep = getattr(torch.cuda, "_sleep", None) if lead_cycles > 0 else None

    def timer(call: Callable[[], Any]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        if sleep is not None:
            sleep(lead_cycles)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return timer


def usable_cores() -> int:
    """Cores this process may run on (the figure every table states)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Method(Generic[T]):
    """A competitor: ``prepare(inputs)`` (untimed) returns the zero-argument call to time.

    The call's return value is dropped right after the timing, except in the warm-up round,
    where :func:`run_rounds` hands every method's result to its ``on_warmup`` check.
    """

    name: str
    prepare: Callable[[T], Callable[[], Any]]


@dataclass(frozen=True)
class RoundPlan:
    """How many rounds a configuration gets.

    Rounds run until ``max_rounds`` or until ``budget_s`` seconds have passed, but never fewer
    than ``min_rounds``. One untimed warm-up round comes first.
    """

    min_rounds: int = 5
    max_rounds: int = 30
    budget_s: float = 2.0


def run_rounds(
    methods: Sequence[Method[T]],
    make_inputs: Callable[[int], T],
    plan: RoundPlan,
    *,
    on_warmup: Callable[[T, dict[str, Any]], None] | None = None,
    timer: Timer = host_timer,
) -> tuple[dict[str, list[float]], list[T]]:
    """Time ``methods`` in interleaved rounds.

    Args:
        methods: the competitors; each round runs them in a random order.
        make_inputs: ``round -> inputs`` (untimed; fresh inputs each round).
        plan: the round budget.
        on_warmup: called with the warm-up round's inputs and ``name -> return value`` (to
            check that the methods agree).
        timer: how one call is timed (default: host wall time; :func:`cuda_event_timer` for
            work queued on a GPU).

    Returns:
        ``(seconds, inputs)``: per method the duration of each timed round, and the inputs of
        each timed round (same order).
    """
    warm = make_inputs(-1)
    results = {m.name: m.prepare(warm)() for m in methods}
    if on_warmup is not None:
        on_warmup(warm, results)
    del results
    seconds: dict[str, list[float]] = {m.name: [] for m in methods}
    order_rng = np.random.default_rng(len(methods))
    inputs: list[T] = []
    start = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    rounds = 0
    # The heap built before the rounds (vocabularies, pools) is frozen, as vLLM's engine core
    # freezes its start-up heap: each round's collection then walks only what the rounds
    # allocate. A full-heap walk (0.17 s over the bench's ~770k objects) before every round
    # left the round's first call far colder than the others (K=1 batch-1 chains: 70 to 87 us
    # in first place against 28 to 50 us later), and calls sharing code with the one before
    # them warmer (a serial fill after the validating fill: 29 us, after the library's call:
    # 45 us). With the heap frozen every place measures alike (28 to 35 us).
    gc.collect()
    gc.freeze()
    try:
        while rounds < plan.max_rounds and (
            rounds < plan.min_rounds or time.perf_counter() - start < plan.budget_s
        ):
            data = make_inputs(rounds)
            order = order_rng.permutation(len(methods))
            gc.collect()
            gc.disable()  # no collection inside a timed call; garbage waits for the next round
            for k in order:
                method = methods[int(k)]
                call = method.prepare(data)
                elapsed = timer(call)
                del call
                settle()
                seconds[method.name].append(elapsed)
            if gc_was_enabled:
                gc.enable()
            inputs.append(data)
            rounds += 1
    finally:
        gc.unfreeze()
        if gc_was_enabled:
            gc.enable()
    return seconds, inputs


#: bytes :func:`cache_evictor` writes: more than the last-level cache of the machines benched
EVICT_BYTES = 32 << 20


def cache_evictor() -> Callable[[], None]:
    """A zero-argument call that writes one word per 64-byte line of a private
    :data:`EVICT_BYTES` buffer, evicting the CPU caches the way an engine's forward pass does
    between two steps. Call it (untimed) right before a timed call so that every method starts
    from the same cold caches: otherwise a method that shares code with the one timed just
    before it (a loop and the same loop plus a pass) runs warm and the other cold."""
    buffer = np.zeros(EVICT_BYTES // 8, dtype=np.int64)

    def evict() -> None:
        buffer[::8] += 1

    return evict


def settle() -> None:
    """Leave the allocator as the next method should find it (untimed, after every call).

    glibc coalesces its free lists of small chunks on the next larger ``malloc``; after a
    method that frees thousands of small blocks (torch scalar tensors do) that coalescing costs
    up to a millisecond, billed to whichever code allocates next. Allocating one larger block
    here pays it outside any timing.
    """
    bytearray(1 << 16)


def median(values: Sequence[float]) -> float:
    """The median (``nan`` for no values)."""
    return statistics.median(values) if values else float("nan")


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of positive values (``nan`` for none)."""
    values = [v for v in values if v > 0]
    if not values:
        return float("nan")
    return statistics.geometric_mean(values)


# -- other processes ----------------------------------------------------------------------------


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


class LoadMeter:
    """CPU used by *other* processes since construction: the machine's busy time (from
    ``/proc/stat``) minus this process's own CPU time (all its threads)."""

    def __init__(self) -> None:
        self._start = _cpu_jiffies()
        self._own = _own_cpu()
        self._wall = time.perf_counter()

    def busy_cores(self) -> float | None:
        """Average cores kept busy by other processes (None where unknown)."""
        end = _cpu_jiffies()
        wall = time.perf_counter() - self._wall
        if self._start is None or end is None or wall <= 0:
            return None
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = (end[0] - self._start[0]) / tick
        return max(0.0, busy - (_own_cpu() - self._own)) / wall


def background_busy_cores(seconds: float = 0.5) -> float | None:
    """Cores other processes keep busy, sampled over ``seconds`` while we sleep."""
    meter = LoadMeter()
    time.sleep(seconds)
    return meter.busy_cores()


def wait_for_quiet(threshold: float, timeout_s: float, *, sample_s: float = 1.0) -> float:
    """Sleep until two consecutive ``sample_s`` samples show other processes below
    ``threshold`` busy cores, or ``timeout_s`` passed. Returns the seconds waited."""
    start = time.perf_counter()
    quiet = 0
    while quiet < 2 and time.perf_counter() - start < timeout_s:
        busy = background_busy_cores(sample_s)
        if busy is None:
            break
        quiet = quiet + 1 if busy < threshold else 0
    return time.perf_counter() - start


@dataclass
class QuietPolicy:
    """What to do when other processes load the machine during a measurement.

    A configuration measured while other processes kept more than ``threshold`` cores busy
    (on average) is measured again after waiting for a quiet machine, at most ``retries``
    times, while the run's waiting budget ``wait_s`` lasts; the quietest attempt is kept and
    its load is reported. ``wait_s = 0`` (the default) never retries: the load is only
    recorded.
    """

    threshold: float = 0.2
    wait_s: float = 0.0
    retries: int = 3
    waited_s: float = 0.0
    retried: int = 0

    def budget_left(self) -> float:
        """Seconds of waiting left."""
        return max(0.0, self.wait_s - self.waited_s)


def measure_quietly(fn: Callable[[], R], policy: QuietPolicy) -> tuple[R, float | None]:
    """Run ``fn`` under ``policy``; return its result and the other processes' busy cores
    during the attempt kept."""
    best: tuple[R, float | None] | None = None
    for attempt in range(policy.retries + 1):
        meter = LoadMeter()
        result = fn()
        busy = meter.busy_cores()
        if best is None or (busy is not None and (best[1] is None or busy < best[1])):
            best = (result, busy)
        if busy is None or busy <= policy.threshold or policy.budget_left() <= 0:
            break
        if attempt == policy.retries:
            break
        policy.retried += 1
        policy.waited_s += wait_for_quiet(policy.threshold, min(policy.budget_left(), 300.0))
    assert best is not None
    return best
