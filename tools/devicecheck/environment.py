"""Part 0, environment: the machine, the GPU, and which packages were imported from where.

Checks (a failed one fails the check): on the GPU machine, that torch sees a CUDA device and
JAX a GPU; everywhere, that torch, JAX and numpy were not imported from the check's private
package folder (``$PORTABLE_SPEC_CHECK_SITE``: the carried wheels must never replace them).
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
from importlib import metadata
from typing import Any

from tools.bench.timing import usable_cores
from tools.devicecheck.profiles import Profile
from tools.devicecheck.results import PartRecorder

__all__ = ["run"]

PACKAGES = (
    "portable-spec",
    "numpy",
    "torch",
    "triton",
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "xgrammar",
    "apache-tvm-ffi",
    "pydantic",
    "pytest",
    "hypothesis",
    "ml-dtypes",
)
MODULES = ("numpy", "torch", "jax", "xgrammar", "portable_spec", "tvm_ffi", "pydantic")
ENV_VARS = (
    "JAX_PLATFORMS",
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "PYTHONPATH",
    "PORTABLE_SPEC_VOCAB",
    "PORTABLE_SPEC_CHECK_SITE",
    "TVM_FFI_DISABLE_TORCH_C_DLPACK",
    "CUDA_VISIBLE_DEVICES",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def host_facts() -> dict[str, Any]:
    """CPU, cores, memory, OS and Python."""
    return {
        "cpu": _cpu_model(),
        "usable_cores": usable_cores(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "python": platform.python_version(),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def package_facts() -> dict[str, Any]:
    """Installed versions (metadata) and where each module was imported from."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    files = {}
    for module in MODULES:
        try:
            files[module] = getattr(importlib.import_module(module), "__file__", None)
        except Exception as exc:  # record why it does not import
            files[module] = f"not importable: {type(exc).__name__}: {exc}"
    from portable_spec.native import native

    return {"versions": versions, "files": files, "native_helper": native is not None}


def torch_facts() -> dict[str, Any]:
    """torch's build and its CUDA device, if any."""
    import torch

    facts: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "threads": torch.get_num_threads(),
    }
    if facts["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        facts.update(
            device_count=torch.cuda.device_count(),
            gpu=torch.cuda.get_device_name(0),
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
    return facts


def jax_facts() -> dict[str, Any]:
    """JAX's backends and devices."""
    import jax

    devices = jax.devices()
    facts: dict[str, Any] = {
        "version": jax.__version__,
        "default_backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices[:4]],
        "device_count": len(devices),
    }
    for platform_name in ("gpu", "cpu"):
        try:
            facts[f"{platform_name}_devices"] = len(jax.devices(platform_name))
        except RuntimeError:
            facts[f"{platform_name}_devices"] = 0
    return facts


def nvidia_smi() -> dict[str, Any]:
    """``nvidia-smi``'s view of the GPU (read-only query), or why there is none."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return {"available": False}
    fields = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu"
    done = subprocess.run(
        [tool, f"--query-gpu={fields}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    return {"available": True, "fields": fields, "output": done.stdout.strip() or done.stderr}


def run(rec: PartRecorder, profile: Profile) -> None:
    """Record the facts; check the GPU (GPU mode) and that the image's packages were used."""
    gpu = profile.name == "gpu"
    with rec.section("host"):
        rec.add("host", host_facts())
    with rec.section("packages"):
        packages = package_facts()
        rec.add("packages", packages)
        site = os.environ.get("PORTABLE_SPEC_CHECK_SITE")
        if site:
            site = os.path.realpath(site)
            for module in ("torch", "jax", "numpy"):
                where = packages["files"].get(module) or ""
                rec.check(
                    "packages",
                    f"{module} from the image",
                    not os.path.realpath(where).startswith(site + os.sep),
                    where,
                )
    with rec.section("torch"):
        facts = torch_facts()
        rec.add("torch", facts)
        if gpu:
            rec.check("torch", "CUDA device visible to torch", facts["cuda_available"])
    with rec.section("jax"):
        facts = jax_facts()
        rec.add("jax", facts)
        if gpu:
            rec.check("jax", "GPU visible to JAX", facts["gpu_devices"] > 0)
    with rec.section("nvidia-smi"):
        rec.add("nvidia-smi", nvidia_smi())
