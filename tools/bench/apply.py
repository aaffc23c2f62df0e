"""Section 3, apply: ``apply_vocab_mask`` per backend against an elementwise pass over the
same logits in the same framework (the floor), at a 131072-token vocabulary.

The mask is a real one: built with ``build_host_bitmask`` for SmolLM2 requests at the wide
vocabulary (the bits past the grammar's 49152 tokens are 0, as for a padded model vocab).

Per framework and dtype (float32, bfloat16):

numpy
    ``apply_vocab_mask`` in place vs ``np.multiply(logits, 1, out=logits)``. (numpy has no
    native bfloat16: skipped.)
torch
    ``apply_vocab_mask`` (xgrammar's kernels, in place) vs ``logits.mul_(1)``.
jax
    standalone: ``jax.jit(apply_vocab_mask)`` vs ``jax.jit(where(logits > -1e30, logits,
    -inf))``; donating: the same inside ``jax.jit(..., donate_argnums=0)`` (the engine's
    sampler), each fed its own previous output. The target reference for JAX inside a
    donating jit is ``numpy copy``: ``np.copyto`` of the same logits into a preallocated
    array (``ml_dtypes.bfloat16`` for bfloat16).
"""

from __future__ import annotations

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

__all__ = ["APPLY_DTYPES", "build_wide_mask", "run_apply_section"]

APPLY_DTYPES = ("float32", "bfloat16")


def build_wide_mask(pool: RequestPool, rows: int, vocab_size: int) -> np.ndarray:
    """A real ``[rows, ceil(vocab_size / 32)]`` mask from ``pool``'s requests (rows must be a
    multiple of the pool's node count)."""
    import portable_spec as ps

    nodes = pool.next_token.shape[1]
    if rows % nodes:
        raise ValueError(f"apply rows ({rows}) must be a multiple of the nodes ({nodes})")
    batch = rows // nodes
    if batch > pool.size:
        raise ValueError(f"apply rows need {batch} requests, the pool has {pool.size}")
    sample = pool.sample(batch)
    tree = ps.GrammarTree.from_host(sample.next_token, sample.next_sibling, sample.draft_tokens)
    mask = ps.build_host_bitmask(sample.matchers, tree, vocab_size)
    assert mask is not None
    return mask


def _logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, vocab), dtype=np.float32)


def _numpy_copy(source: np.ndarray) -> Method[None]:
    target = np.empty_like(source)

    def prepare(_: None) -> Callable[[], Any]:
        return lambda: np.copyto(target, source)

    return Method("numpy copy", prepare)


def _numpy_methods(logits: np.ndarray, mask: np.ndarray) -> list[Method[None]]:
    import portable_spec as ps

    mine, floor = logits.copy(), logits.copy()
    return [
        Method("apply_vocab_mask", lambda _: lambda: ps.apply_vocab_mask(mine, mask)),
        Method("elementwise floor", lambda _: lambda: np.multiply(floor, 1, out=floor)),
        _numpy_copy(logits),
    ]


def _torch_methods(logits: np.ndarray, mask: np.ndarray, dtype: str) -> list[Method[None]]:
    import torch

    import portable_spec as ps

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch_dtype = getattr(torch, dtype)
    mine = torch.from_numpy(logits).to(device=device, dtype=torch_dtype)
    floor = mine.clone()
    mask_t = torch.from_numpy(mask).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def apply(_: None) -> Callable[[], Any]:
        def call() -> None:
            ps.apply_vocab_mask(mine, mask_t)
            sync()

        return call

    def elementwise(_: None) -> Callable[[], Any]:
        def call() -> None:
            floor.mul_(1)
            sync()

        return call

    methods = [Method("apply_vocab_mask", apply), Method("elementwise floor", elementwise)]
    # the same bytes on the host (bfloat16 viewed as int16: numpy has no bfloat16)
    raw = mine if dtype == "float32" else mine.view(torch.int16)
    methods.append(_numpy_copy(raw.cpu().numpy()))
    return methods


def _jax_methods(logits: np.ndarray, mask: np.ndarray, dtype: str) -> list[Method[None]]:
    import jax
    import jax.numpy as jnp

    import portable_spec as ps

    jdtype = jnp.dtype(dtype)
    source = jnp.asarray(logits, dtype=jdtype)
    mask_j = jnp.asarray(mask)

    def floor_fn(x: jax.Array) -> jax.Array:
        # a select XLA cannot fold away (``x * 1`` is simplified to nothing)
        return jnp.where(x > -1e30, x, jnp.asarray(-jnp.inf, dtype=x.dtype))

    standalone_apply = jax.jit(ps.apply_vocab_mask)
    standalone_floor = jax.jit(floor_fn)
    donating_apply = jax.jit(ps.apply_vocab_mask, donate_argnums=0)
    donating_floor = jax.jit(floor_fn, donate_argnums=0)

    def fixed(fn: Callable[..., Any], *args: Any) -> Callable[[None], Callable[[], Any]]:
        return lambda _: lambda: fn(*args).block_until_ready()

    def donated(fn: Callable[..., Any], *args: Any) -> Callable[[None], Callable[[], Any]]:
        cell = [jnp.array(source, copy=True)]

        def prepare(_: None) -> Callable[[], Any]:
            def call() -> None:
                cell[0] = fn(cell[0], *args)
                cell[0].block_until_ready()

            return call

        return prepare

    return [
        Method("apply_vocab_mask", fixed(standalone_apply, source, mask_j)),
        Method("elementwise floor", fixed(standalone_floor, source)),
        Method("apply_vocab_mask (donating jit)", donated(donating_apply, mask_j)),
        Method("elementwise floor (donating jit)", donated(donating_floor)),
        _numpy_copy(np.asarray(source)),
    ]


def run_apply_section(
    setup: Setup,
    pool: RequestPool,
    rows: int,
    vocab_size: int,
    plan: RoundPlan,
    *,
    frameworks: tuple[str, ...] = ("numpy", "torch", "jax"),
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Time apply against its floors for each framework and dtype.

    Returns one record per (framework, dtype): median seconds per method, the achieved
    bandwidth of the library's apply (logits read + written + mask read, GB/s), and ratios
    ``apply / floor`` and (JAX) ``donating apply / numpy copy`` (at most 1 meets the target).
    """
    policy = policy or QuietPolicy()
    mask = build_wide_mask(pool, rows, vocab_size)
    logits = _logits(rows, vocab_size, seed=1)
    cores = usable_cores()
    results: list[dict[str, Any]] = []
    for framework in frameworks:
        for dtype in APPLY_DTYPES:
            if framework == "numpy" and dtype != "float32":
                continue  # numpy has no native bfloat16
            if framework == "numpy":
                methods = _numpy_methods(logits, mask)
            elif framework == "torch":
                methods = _torch_methods(logits, mask, dtype)
            else:
                methods = _jax_methods(logits, mask, dtype)
            (seconds, _), busy = measure_quietly(
                lambda m=methods: run_rounds(m, lambda _r: None, plan), policy
            )
            med = {k: median(v) for k, v in seconds.items()}
            itemsize = 4 if dtype == "float32" else 2
            moved = 2 * rows * vocab_size * itemsize + mask.nbytes
            record: dict[str, Any] = {
                "framework": framework,
                "dtype": dtype,
                "rows": rows,
                "vocab": vocab_size,
                "rounds": len(seconds["apply_vocab_mask"]),
                "cores": cores,
                "seconds": med,
                "apply_gbps": moved / med["apply_vocab_mask"] / 1e9,
                "apply_over_floor": med["apply_vocab_mask"] / med["elementwise floor"],
                "other_busy_cores": busy,
            }
            if "numpy copy" in med:
                record["apply_over_numpy_copy"] = med["apply_vocab_mask"] / med["numpy copy"]
            if framework == "jax":
                donating = med["apply_vocab_mask (donating jit)"]
                record["donating_apply_over_floor"] = (
                    donating / med["elementwise floor (donating jit)"]
                )
                record["donating_apply_over_numpy_copy"] = donating / med["numpy copy"]
            results.append(record)
            if advance is not None:
                advance(f"apply {framework} {dtype}")
            del methods
    return results
