"""Section 2, staging: the tree's device-to-host copy and the mask's host-to-device upload.

Tree download, per framework (torch, JAX), on fresh device arrays each round:

``from_device+resolve``
    ``GrammarTree.from_device(...)`` then ``resolve()``: what the library does (private
    C-contiguous int64 host copies; on CUDA a pinned ``non_blocking`` copy and an event, on
    JAX ``copy_to_host_async``).
``from_device (launch)``
    ``from_device`` alone: what the engine pays before it launches the verify forward.
``plain``
    A blocking ``.cpu().numpy()`` (torch) or ``np.asarray`` (JAX) of the three arrays.

Mask upload, per framework, of a ``[batch * nodes, words]`` int32 host mask:

``backend.upload``
    The library's path: a pooled (pinned where possible) host buffer handed to the backend's
    non-blocking upload, waited for (JAX ``block_until_ready``; CUDA synchronize).
``plain copy``
    ``torch.from_numpy(mask).to(device)`` / ``jax.device_put(mask.copy())`` (a private copy,
    since ``device_put`` may alias host memory on the CPU platform).
``plain alias``
    JAX only: ``jax.device_put(mask)``, unsafe when the host buffer is reused (it may alias).
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

__all__ = [
    "STAGING_FRAMEWORKS",
    "device_tree",
    "run_staging_section",
    "tree_methods",
    "upload_methods",
]

STAGING_FRAMEWORKS = ("torch", "jax")


def _torch_device() -> Any:
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _synchronize(framework: str) -> None:
    if framework == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def tree_methods(framework: str) -> list[Method[tuple[Any, Any, Any]]]:
    """The tree-download methods (``"from_device+resolve"``, ``"from_device (launch)"``,
    ``"plain"``) of ``framework`` (``"torch"`` or ``"jax"``); inputs: three device arrays."""
    import portable_spec as ps

    def library(arrays: tuple[Any, Any, Any]) -> Callable[[], Any]:
        return lambda: ps.GrammarTree.from_device(*arrays).resolve()

    def launch(arrays: tuple[Any, Any, Any]) -> Callable[[], Any]:
        return lambda: ps.GrammarTree.from_device(*arrays)

    if framework == "torch":

        def plain(arrays: tuple[Any, Any, Any]) -> Callable[[], Any]:
            return lambda: [a.cpu().numpy() for a in arrays]

    else:

        def plain(arrays: tuple[Any, Any, Any]) -> Callable[[], Any]:
            return lambda: [np.asarray(a) for a in arrays]

    return [
        Method("from_device+resolve", library),
        Method("from_device (launch)", launch),
        Method("plain", plain),
    ]


def device_tree(framework: str, batch_arrays: tuple[np.ndarray, ...]) -> tuple[Any, Any, Any]:
    """Fresh device arrays (no cached host copy) holding the tree, ready before timing."""
    if framework == "torch":
        import torch

        device = _torch_device()
        tensors = tuple(torch.from_numpy(a).to(device).clone() for a in batch_arrays)
        _synchronize(framework)
        return tensors  # type: ignore[return-value]
    import jax
    import jax.numpy as jnp

    arrays = tuple(jnp.array(a.astype(np.int32), copy=True) for a in batch_arrays)
    jax.block_until_ready(arrays)
    return arrays  # type: ignore[return-value]


def upload_methods(framework: str, mask: np.ndarray) -> list[Method[None]]:
    """The mask-upload methods of ``framework`` for the host ``mask``; each call waits for
    its upload (torch: to CUDA when available; JAX: to the default device)."""
    import portable_spec as ps

    rows, words = mask.shape
    if framework == "torch":
        import torch

        backend = ps.get_backend("cuda")
        device = _torch_device()

        def library(_: None) -> Callable[[], Any]:
            def call() -> Any:
                buffer = backend.acquire_host_mask(rows, words)
                out = backend.upload(buffer, device)
                _synchronize(framework)
                return out

            return call

        def plain(_: None) -> Callable[[], Any]:
            def call() -> Any:
                out = torch.from_numpy(mask).to(device)
                _synchronize(framework)
                return out

            return call

        return [Method("backend.upload", library), Method("plain copy", plain)]

    import jax

    backend = ps.get_backend("jax")
    device = jax.devices()[0]

    def jax_library(_: None) -> Callable[[], Any]:
        def call() -> Any:
            buffer = backend.acquire_host_mask(rows, words)
            return backend.upload(buffer, device).block_until_ready()

        return call

    def jax_copy(_: None) -> Callable[[], Any]:
        return lambda: jax.device_put(mask.copy(), device).block_until_ready()

    def jax_alias(_: None) -> Callable[[], Any]:
        return lambda: jax.device_put(mask, device).block_until_ready()

    return [
        Method("backend.upload", jax_library),
        Method("plain copy", jax_copy),
        Method("plain alias", jax_alias),
    ]


def run_staging_section(
    setup: Setup,
    pool: RequestPool,
    batches: tuple[int, ...],
    plan: RoundPlan,
    *,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Tree download and mask upload for torch and JAX at each batch size of ``pool``'s trees.

    Returns one record per (framework, operation, batch): median seconds per method and the
    ratio ``plain / library`` (above 1: the library is faster).
    """
    policy = policy or QuietPolicy()
    results: list[dict[str, Any]] = []
    nodes = pool.next_token.shape[1]
    cores = usable_cores()
    for framework in STAGING_FRAMEWORKS:
        for batch in batches:
            methods = tree_methods(framework)

            def inputs(_r: int, batch: int = batch, framework: str = framework) -> Any:
                sample = pool.sample(batch)
                host = (sample.next_token, sample.next_sibling, sample.draft_tokens)
                return device_tree(framework, host)

            (seconds, _), busy = measure_quietly(
                lambda m=methods, i=inputs: run_rounds(m, i, plan), policy
            )
            med = {k: median(v) for k, v in seconds.items()}
            results.append(
                {
                    "framework": framework,
                    "operation": "tree download",
                    "batch": batch,
                    "nodes": nodes,
                    "bytes": 3 * batch * nodes * (8 if framework == "torch" else 4),
                    "rounds": len(seconds["plain"]),
                    "cores": cores,
                    "seconds": med,
                    "plain_over_library": med["plain"] / med["from_device+resolve"],
                    "other_busy_cores": busy,
                }
            )
            if advance is not None:
                advance(f"staging {framework} tree bs={batch}")

            mask = np.full((batch * nodes, setup.words), -1, dtype=np.int32)
            methods_up = upload_methods(framework, mask)
            (seconds, _), busy = measure_quietly(
                lambda m=methods_up: run_rounds(m, lambda _r: None, plan), policy
            )
            med = {k: median(v) for k, v in seconds.items()}
            results.append(
                {
                    "framework": framework,
                    "operation": "mask upload",
                    "batch": batch,
                    "nodes": nodes,
                    "bytes": int(mask.nbytes),
                    "rounds": len(seconds["plain copy"]),
                    "cores": cores,
                    "seconds": med,
                    "plain_over_library": med["plain copy"] / med["backend.upload"],
                    "other_busy_cores": busy,
                }
            )
            if advance is not None:
                advance(f"staging {framework} upload bs={batch}")
    return results
