"""Part 2a, torch timings: tree staging, mask upload and apply, on CUDA (CPU under ``--cpu``).

Medians of interleaved rounds (``tools.bench.timing.run_rounds``); GPU work is timed
with CUDA events (``cuda_event_timer``: the span of the queued work, host launch overhead kept
out by a short spin queued first), host-visible latencies with ``time.perf_counter``.

staging (host time; fresh ``[batch, nodes]`` int64 device tensors each round)
    ``from_device (launch)``: what the engine pays before launching the verify forward;
    ``from_device+resolve``: until the host arrays are readable; ``plain``: a blocking
    ``.cpu().numpy()`` of the three tensors. (``tools.bench.staging.tree_methods``.)
upload (GPU only; host time until ``torch.cuda.synchronize()`` returns, which also covers a
copy the library may issue on a stream of its own)
    ``backend.upload``: the library's upload of a pooled pinned buffer (filled untimed);
    ``pinned copy_``: ``dst.copy_(pinned, non_blocking=True)`` into a preallocated tensor;
    ``pageable .to()``: ``torch.from_numpy(mask).to(device)``.
apply (CUDA events on the GPU, host time on the CPU)
    ``apply_vocab_mask`` (xgrammar's kernels, in place) against two elementwise floors over an
    already unpacked ``[rows, vocab]`` bool mask: ``masked_fill_`` (in place) and
    ``torch.where`` (a new tensor). The warm-up round checks that all three agree exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tools.bench.timing import (
    Method,
    Timer,
    cuda_event_timer,
    host_timer,
    median,
    run_rounds,
)
from tools.bench.workloads import RequestPool, Setup, synthetic_setup
from tools.devicecheck.profiles import Profile
from tools.devicecheck.results import PartRecorder, SkipSection
from tools.devicecheck.workload import describe, json_pool, staging_timings, tiled_mask

__all__ = ["run", "unpack_mask_torch", "upload_one"]


def run(rec: PartRecorder, profile: Profile) -> None:
    """All sections; each records its own failure and the next one still runs."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    setup = synthetic_setup(profile.vocab)
    biggest = max(profile.staging_batches + profile.upload_batches)
    pool = json_pool(setup, profile.nodes, biggest)
    rec.note("workload", {**describe(setup, pool), "device": str(device)})
    with rec.section("staging"):
        _staging(rec, profile, pool)
    with rec.section("upload"):
        if not cuda:
            raise SkipSection("no CUDA device")
        _upload(rec, profile, setup, device)
    with rec.section("apply"):
        _apply(rec, profile, setup, pool, device)


def _staging(rec: PartRecorder, profile: Profile, pool: RequestPool) -> None:
    staging_timings(rec, profile, pool, "torch", "int64", ".cpu()")


def _upload(rec: PartRecorder, profile: Profile, setup: Setup, device: Any) -> None:
    rng = np.random.default_rng(5)
    for batch in profile.upload_batches:
        rows = batch * profile.nodes
        host = rng.integers(-(2**31), 2**31, (rows, setup.words), dtype=np.int64).astype(np.int32)
        upload_one(rec, profile, host, device)


def _synchronized(issue: Callable[[], Any], device: Any) -> Callable[[], Any]:
    """``issue()`` then ``torch.cuda.synchronize()`` (every stream of the device; nothing to
    wait for on the CPU)."""
    import torch

    def call() -> Any:
        out = issue()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    return call


def upload_one(rec: PartRecorder, profile: Profile, host: np.ndarray, device: Any) -> None:
    """Time the three uploads of the ``[rows, words]`` int32 ``host`` mask to ``device`` (a
    CUDA device in the check; the tests run it on the CPU) and add an ``upload`` record."""
    import torch

    import portable_spec as ps

    backend = ps.get_backend("cuda")
    rows, words = host.shape
    pinned = (
        torch.from_numpy(host).pin_memory() if device.type == "cuda" else torch.from_numpy(host)
    )
    dst = torch.empty((rows, words), dtype=torch.int32, device=device)

    def library(_: None) -> Callable[[], Any]:
        buffer = backend.acquire_host_mask(rows, words, device)
        buffer.array[...] = host  # untimed: the build fills it in an engine
        return _synchronized(lambda: backend.upload(buffer, device), device)

    methods = [
        Method("backend.upload", library),
        Method(
            "pinned copy_",
            lambda _: _synchronized(lambda: dst.copy_(pinned, non_blocking=True), device),
        ),
        Method(
            "pageable .to()",
            lambda _: _synchronized(lambda: torch.from_numpy(host).to(device), device),
        ),
    ]
    agree: list[bool] = []

    def on_warmup(_data: None, results: dict[str, Any]) -> None:
        agree.append(all(np.array_equal(r.cpu().numpy(), host) for r in results.values()))

    seconds, _ = run_rounds(methods, lambda _r: None, profile.plan, on_warmup=on_warmup)
    med = {k: median(v) for k, v in seconds.items()}
    rec.check("upload", f"uploaded masks equal the host mask ({rows} rows)", all(agree))
    rec.add(
        "upload",
        {
            "framework": "torch",
            "rows": rows,
            "words": words,
            "bytes": int(host.nbytes),
            "rounds": len(seconds["pinned copy_"]),
            "seconds": med,
            "gb_per_s": {k: host.nbytes / v / 1e9 for k, v in med.items()},
            "library_over_pinned_copy": med["backend.upload"] / med["pinned copy_"],
        },
    )


def unpack_mask_torch(mask: Any, vocab: int) -> Any:
    """``[rows, words]`` int32 bitmask -> ``[rows, vocab]`` bool (True: allowed), on the mask's
    device (``[rows, words, 32]`` int32 temporaries)."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask[:, :, None] >> shifts) & 1
    return bits.to(torch.bool).reshape(mask.shape[0], -1)[:, :vocab].contiguous()


def _apply(
    rec: PartRecorder, profile: Profile, setup: Setup, pool: RequestPool, device: Any
) -> None:
    import torch

    timer: Timer = cuda_event_timer() if device.type == "cuda" else host_timer
    for rows, vocab in profile.apply_shapes:
        mask = torch.from_numpy(tiled_mask(pool, vocab, rows)).to(device)
        allowed = unpack_mask_torch(mask, vocab)
        for dtype in profile.apply_dtypes:
            _apply_one(rec, profile, mask, allowed, getattr(torch, dtype), timer)
        del mask, allowed
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _apply_one(
    rec: PartRecorder, profile: Profile, mask: Any, allowed: Any, dtype: Any, timer: Timer
) -> None:
    import torch

    import portable_spec as ps

    rows, vocab = allowed.shape
    device = mask.device
    banned = ~allowed
    gen = torch.Generator(device=device).manual_seed(rows)
    source = torch.randn((rows, vocab), generator=gen, device=device).to(dtype)
    mine, filled = source.clone(), source.clone()
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=device)
    methods = [
        Method("apply_vocab_mask", lambda _: lambda: ps.apply_vocab_mask(mine, mask)),
        Method("masked_fill_ (bool)", lambda _: lambda: filled.masked_fill_(banned, -math.inf)),
        Method("torch.where (bool)", lambda _: lambda: torch.where(allowed, source, neg_inf)),
    ]
    agree: list[bool] = []

    def on_warmup(_data: None, results: dict[str, Any]) -> None:
        ours = results["apply_vocab_mask"]
        agree.append(
            torch.equal(ours, results["masked_fill_ (bool)"])
            and torch.equal(ours, results["torch.where (bool)"])
        )

    seconds, _ = run_rounds(
        methods, lambda _r: None, profile.plan, on_warmup=on_warmup, timer=timer
    )
    med = {k: median(v) for k, v in seconds.items()}
    logits_rw = 2 * rows * vocab * source.element_size()
    moved = {
        "apply_vocab_mask": logits_rw + mask.numel() * 4,
        "masked_fill_ (bool)": logits_rw + rows * vocab,
        "torch.where (bool)": logits_rw + rows * vocab,
    }
    name = str(dtype).removeprefix("torch.")
    rec.check("apply", f"apply equals both floors ({rows}x{vocab} {name})", all(agree))
    rec.add(
        "apply",
        {
            "framework": "torch",
            "device": str(device),
            "rows": rows,
            "vocab": vocab,
            "dtype": name,
            "rounds": len(seconds["apply_vocab_mask"]),
            "seconds": med,
            "gb_per_s": {k: moved[k] / v / 1e9 for k, v in med.items()},
            "apply_over_masked_fill": med["apply_vocab_mask"] / med["masked_fill_ (bool)"],
            "apply_over_where": med["apply_vocab_mask"] / med["torch.where (bool)"],
        },
    )
