"""The cross-backend matrix: every place a tree can come from and a mask can go to.

Each :class:`Target` turns host (numpy) test data into one framework's arrays placed one way,
and brings results back, so the same cases and the same oracle run on all of them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Target:
    name: str  # matrix id, e.g. "jax-cpu-sharded"
    backend: str  # portable_spec backend name
    available: Callable[[], str | None]  # None when usable, else the reason to skip
    put: Callable[[np.ndarray], Any]  # host array -> framework array (tree arrays, logits)
    get: Callable[[Any], np.ndarray]  # framework array -> host array
    float_dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    device: Callable[[], Any] = lambda: None  # explicit upload destination (None: the tree's)
    check_placement: Callable[[Any], None] = lambda mask: None
    row_parts: int = 1  # row shards of the mask of a tree staged from this target

    def skip_reason(self) -> str | None:
        return self.available()


def _need(module: str) -> str | None:
    return None if importlib.util.find_spec(module) else f"{module} is not installed"


# -- numpy --------------------------------------------------------------------------------------
def _numpy_target() -> Target:
    return Target(
        "numpy",
        "numpy",
        lambda: None,
        lambda a: np.array(a),
        np.asarray,
        float_dtypes=("float32", "float16", "float64"),
    )


# -- torch --------------------------------------------------------------------------------------
def _torch_dtype(np_dtype: Any) -> Any:
    import torch

    name = np.dtype(np_dtype).name
    return getattr(torch, name)


def _to_torch(a: np.ndarray, device: str) -> Any:
    import ml_dtypes
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(device)
    t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
    if t.dim() == 2 and t.shape[0] > 1 and t.dtype in (torch.int32, torch.int64):
        # exercise strided inputs: same values through a non-contiguous view
        t = t.t().contiguous().t()
    return t


def _from_torch(t: Any) -> np.ndarray:
    import ml_dtypes
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.to(torch.float32).numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


def _torch_cuda_available() -> str | None:
    missing = _need("torch")
    if missing:
        return missing
    import torch

    return None if torch.cuda.is_available() else "no CUDA device on this machine"


def _torch_targets() -> list[Target]:
    def placement(device: str) -> Callable[[Any], None]:
        def check(mask: Any) -> None:
            assert mask.device.type == device, mask.device

        return check

    return [
        Target(
            "torch-cpu",
            "torch",
            lambda: _need("torch"),
            lambda a: _to_torch(a, "cpu"),
            _from_torch,
            float_dtypes=("float32", "float16", "bfloat16", "float64"),
            check_placement=placement("cpu"),
        ),
        Target(
            "torch-cuda",
            "torch",
            _torch_cuda_available,
            lambda a: _to_torch(a, "cuda"),
            _from_torch,
            check_placement=placement("cuda"),
        ),
    ]


# -- jax ----------------------------------------------------------------------------------------
def _jax_devices(platform: str) -> list[Any]:
    import jax

    try:
        return jax.devices(platform)
    except RuntimeError:
        return []


def _jax_available(platform: str, count: int = 1) -> Callable[[], str | None]:
    def check() -> str | None:
        missing = _need("jax")
        if missing:
            return missing
        n = len(_jax_devices(platform))
        if n < count:
            return f"jax has {n} {platform} device(s), this target needs {count}"
        return None

    return check


def _to_jax(a: np.ndarray, placement: Callable[[], Any]) -> Any:
    import jax

    if a.dtype == np.int64:
        a = a.astype(np.int32)  # JAX's default integer width, as engines hand it over
    return jax.device_put(a, placement())


def _jax_targets() -> list[Target]:
    def single(platform: str) -> Callable[[], Any]:
        return lambda: _jax_devices(platform)[0]

    def mesh_sharding(spec: tuple) -> Callable[[], Any]:
        def make() -> Any:
            from jax.sharding import Mesh, NamedSharding, PartitionSpec

            mesh = Mesh(np.array(_jax_devices("cpu")[:8]), ("b",))
            return NamedSharding(mesh, PartitionSpec(*spec))

        return make

    def on_platform(platform: str) -> Callable[[Any], None]:
        def check(mask: Any) -> None:
            assert {d.platform for d in mask.devices()} == {platform}

        return check

    def row_sharded(mask: Any) -> None:
        assert len(mask.devices()) == 8 and not mask.is_fully_replicated
        rows = {s.index[0].start for s in mask.addressable_shards}
        assert len(rows) == 8

    def replicated(mask: Any) -> None:
        assert len(mask.devices()) == 8 and mask.is_fully_replicated

    targets = [
        Target(
            "jax-cpu",
            "jax",
            _jax_available("cpu"),
            lambda a: _to_jax(a, single("cpu")),
            np.asarray,
            check_placement=on_platform("cpu"),
        ),
        Target(
            "jax-cpu-sharded",
            "jax",
            _jax_available("cpu", 8),
            lambda a: _to_jax(a, mesh_sharding(("b",) if a.ndim == 2 else ())),
            np.asarray,
            check_placement=row_sharded,
            row_parts=8,
        ),
        Target(
            "jax-cpu-replicated",
            "jax",
            _jax_available("cpu", 8),
            lambda a: _to_jax(a, mesh_sharding(())),
            np.asarray,
            check_placement=replicated,
        ),
    ]
    for platform in ("gpu", "tpu"):
        targets.append(
            Target(
                f"jax-{platform}",
                "jax",
                _jax_available(platform),
                lambda a, p=platform: _to_jax(a, single(p)),
                np.asarray,
                check_placement=on_platform(platform),
            )
        )
    return targets


TARGETS: list[Target] = [_numpy_target(), *_torch_targets(), *_jax_targets()]
BY_NAME = {t.name: t for t in TARGETS}
