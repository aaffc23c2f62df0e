"""Pick and build the demo's model runner for a framework and a dtype."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from examples.demo.weights import load_weights

__all__ = ["BACKENDS", "DTYPES", "build_model", "precision"]

BACKENDS = ("jax", "torch")
DTYPES = ("float32", "float64")


def _check(backend: str, dtype: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


@contextlib.contextmanager
def precision(backend: str, dtype: str) -> Iterator[None]:
    """Scope in which a ``dtype`` model of ``backend`` is built and run.

    For JAX in float64 this enables 64-bit types (``jax.enable_x64``) only inside the block;
    everything else needs no setup.
    """
    _check(backend, dtype)
    if backend == "jax" and dtype == "float64":
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


def build_model(backend: str, dtype: str, max_len: int, *, gguf_path: str | None = None) -> Any:
    """A ``JaxLlama`` or ``TorchLlama`` with SmolLM2's weights (cached per dtype) and a KV
    cache of ``max_len`` positions. Call it (and use the model) inside :func:`precision`.

    The JAX model lives on JAX's default device; the torch model on CUDA when available,
    else on the CPU.
    """
    _check(backend, dtype)
    weights = load_weights(gguf_path, dtype)
    if backend == "jax":
        from examples.demo.jax_model import JaxLlama

        return JaxLlama(weights, max_len=max_len)
    import torch

    from examples.demo.torch_model import TorchLlama

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return TorchLlama(weights, max_len=max_len, device=device)
