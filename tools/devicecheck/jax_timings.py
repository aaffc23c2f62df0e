"""Part 2b, JAX timings: tree staging, mask upload and apply on JAX's GPU (its CPU under
``--cpu``), host time with ``block_until_ready`` (JAX has no user-visible device events).

staging (fresh ``[batch, nodes]`` int32 device arrays each round)
    ``from_device (launch)``, ``from_device+resolve`` and a blocking ``np.asarray`` (``plain``)
    (``tools.bench.staging.tree_methods``).
upload
    ``backend.upload`` (pooled host buffer, ``jax.device_put``), ``jax.device_put`` of a
    private copy (``plain copy``) and of the array itself (``plain alias``)
    (``tools.bench.staging.upload_methods``).
apply (each inside ``jax.jit(..., donate_argnums=0)``, fed its own previous output)
    ``apply_vocab_mask`` against a ``jnp.where`` select over an already unpacked
    ``[rows, vocab]`` bool mask. The warm-up round checks that both give identical logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tools.bench.staging import upload_methods
from tools.bench.timing import Method, median, run_rounds
from tools.bench.workloads import RequestPool, Setup, synthetic_setup
from tools.devicecheck.profiles import Profile
from tools.devicecheck.results import PartRecorder
from tools.devicecheck.workload import describe, json_pool, staging_timings, tiled_mask

__all__ = ["run"]


def run(rec: PartRecorder, profile: Profile) -> None:
    """All sections on JAX's default device, which must be a GPU on the GPU machine."""
    import jax

    platform = jax.default_backend()
    if profile.name == "gpu" and platform != "gpu":
        for name in ("staging", "upload", "apply"):
            rec.skip(name, f"JAX has no GPU device (default backend: {platform})")
        return
    setup = synthetic_setup(profile.vocab)
    biggest = max(profile.staging_batches + profile.upload_batches)
    pool = json_pool(setup, profile.nodes, biggest)
    device = jax.devices()[0]
    rec.note("workload", {**describe(setup, pool), "device": f"{device.platform}:{device.id}"})
    with rec.section("staging"):
        _staging(rec, profile, pool)
    with rec.section("upload"):
        _upload(rec, profile, setup)
    with rec.section("apply"):
        _apply(rec, profile, setup, pool)


def _staging(rec: PartRecorder, profile: Profile, pool: RequestPool) -> None:
    staging_timings(rec, profile, pool, "jax", "int32", "np.asarray")


def _upload(rec: PartRecorder, profile: Profile, setup: Setup) -> None:
    rng = np.random.default_rng(5)
    for batch in profile.upload_batches:
        rows = batch * profile.nodes
        host = rng.integers(-(2**31), 2**31, (rows, setup.words), dtype=np.int64).astype(np.int32)
        _upload_one(rec, profile, host)


def _upload_one(rec: PartRecorder, profile: Profile, host: np.ndarray) -> None:
    rows, words = host.shape
    agree: list[bool] = []

    def on_warmup(_data: None, results: dict[str, Any]) -> None:
        # the library's buffer holds whatever the pool gave it: only the plain copies carry
        # ``host``
        agree.append(
            np.array_equal(np.asarray(results["plain copy"]), host)
            and np.array_equal(np.asarray(results["plain alias"]), host)
        )

    methods = upload_methods("jax", host)
    seconds, _ = run_rounds(methods, lambda _r: None, profile.plan, on_warmup=on_warmup)
    med = {k: median(v) for k, v in seconds.items()}
    rec.check("upload", f"device_put round trip ({rows} rows)", all(agree))
    rec.add(
        "upload",
        {
            "framework": "jax",
            "rows": rows,
            "words": words,
            "bytes": int(host.nbytes),
            "rounds": len(seconds["plain copy"]),
            "seconds": med,
            "gb_per_s": {k: host.nbytes / v / 1e9 for k, v in med.items()},
            "library_over_plain_copy": med["backend.upload"] / med["plain copy"],
        },
    )


def _apply(rec: PartRecorder, profile: Profile, setup: Setup, pool: RequestPool) -> None:
    import jax
    import jax.numpy as jnp

    import portable_spec as ps

    @jax.jit
    def unpack(mask: jax.Array) -> jax.Array:
        shifts = jnp.arange(32, dtype=jnp.int32)[None, None, :]
        bits = jax.lax.shift_right_logical(mask[:, :, None], shifts) & 1
        return bits.astype(jnp.bool_).reshape(mask.shape[0], -1)

    def select(logits: jax.Array, allowed: jax.Array) -> jax.Array:
        return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, dtype=logits.dtype))

    jitted = (jax.jit(ps.apply_vocab_mask, donate_argnums=0), jax.jit(select, donate_argnums=0))
    for rows, vocab in profile.apply_shapes:
        mask = jnp.asarray(tiled_mask(pool, vocab, rows))
        allowed = unpack(mask)[:, :vocab]
        for dtype in profile.apply_dtypes:
            _apply_one(rec, profile, mask, allowed, jnp.dtype(dtype), jitted)
        del mask, allowed


def _apply_one(
    rec: PartRecorder,
    profile: Profile,
    mask: Any,
    allowed: Any,
    dtype: Any,
    jitted: tuple[Callable[..., Any], Callable[..., Any]],
) -> None:
    import jax
    import jax.numpy as jnp

    rows, vocab = allowed.shape
    apply_jit, where_jit = jitted
    logits = jax.random.normal(jax.random.key(rows), (rows, vocab), dtype=dtype)
    methods = [
        Method("apply_vocab_mask (donating jit)", _donated(apply_jit, logits, mask)),
        Method("jnp.where (donating jit, bool)", _donated(where_jit, logits, allowed)),
    ]
    agree: list[bool] = []

    def on_warmup(_data: None, results: dict[str, Any]) -> None:
        a, b = (np.asarray(r.astype(jnp.float32)) for r in results.values())
        agree.append(bool(np.array_equal(a, b)))

    seconds, _ = run_rounds(methods, lambda _r: None, profile.plan, on_warmup=on_warmup)
    med = {k: median(v) for k, v in seconds.items()}
    logits_rw = 2 * rows * vocab * dtype.itemsize
    moved = {
        "apply_vocab_mask (donating jit)": logits_rw + mask.size * 4,
        "jnp.where (donating jit, bool)": logits_rw + rows * vocab,
    }
    rec.check("apply", f"apply equals jnp.where ({rows}x{vocab} {dtype.name})", all(agree))
    rec.add(
        "apply",
        {
            "framework": "jax",
            "device": str(jax.devices()[0].platform),
            "rows": rows,
            "vocab": vocab,
            "dtype": dtype.name,
            "rounds": len(seconds["apply_vocab_mask (donating jit)"]),
            "seconds": med,
            "gb_per_s": {k: moved[k] / v / 1e9 for k, v in med.items()},
            "apply_over_where": med["apply_vocab_mask (donating jit)"]
            / med["jnp.where (donating jit, bool)"],
        },
    )


def _donated(
    fn: Callable[..., Any], logits: Any, extra: Any
) -> Callable[[None], Callable[[], Any]]:
    """A method calling ``fn(previous_output, extra)`` and waiting for it: the logits buffer is
    donated and reused round after round, as in an engine's sampler."""
    import jax.numpy as jnp

    cell = [jnp.array(logits, copy=True)]

    def prepare(_: None) -> Callable[[], Any]:
        def call() -> Any:
            cell[0] = fn(cell[0], extra)
            return cell[0].block_until_ready()

        return call

    return prepare
