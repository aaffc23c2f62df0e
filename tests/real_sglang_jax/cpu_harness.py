"""What it takes to run sglang-jax's engine with SmolLM2 on JAX CPU (test harness only; not
part of the library).

* sglang-jax's native attention (the CPU backend) pads the KV cache's head dimension to a
  multiple of 128 and returns attention outputs of that width; SmolLM2's heads are 64 wide, so
  the output projection fails. The output is cut back to the query's head dimension.

``activate()`` applies the patches when the patched modules are imported, in this process;
``PORTABLE_SPEC_SGLANG_JAX_CPU_HARNESS=1`` with ``tests/real_sglang_jax/harness_site`` on
``PYTHONPATH`` applies them in every process the engine spawns (its ``sitecustomize``).
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX_CPU_HARNESS"

_after: dict[str, Callable[[Any], None]] = {}


def _native_head_dim(module: Any) -> None:
    original = module.forward_attention
    if getattr(original, "_harness", False):
        return

    @functools.wraps(original)
    def forward_attention(q: Any, k_cache: Any, v_cache: Any, *args: Any, **kwargs: Any) -> Any:
        num_heads = kwargs["num_heads"] if "num_heads" in kwargs else args[4]
        head_dim = q.shape[-1] // num_heads if q.ndim == 2 else q.shape[-1]
        out = original(q, k_cache, v_cache, *args, **kwargs)
        width = v_cache.shape[-1]
        if width != head_dim:
            tokens = out.shape[0]
            out = out.reshape(tokens, num_heads, width)[..., :head_dim]
            out = out.reshape(tokens, num_heads * head_dim)
        return out

    forward_attention._harness = True
    module.forward_attention = forward_attention


_after["sgl_jax.srt.layers.attention.native_backend"] = _native_head_dim


def _tied_head(module: Any) -> None:
    """SmolLM2 ties its output head to the embeddings: ``LlamaForCausalLM`` then has no
    ``lm_head``, which an EAGLE-3 drafter asks the target for. The embeddings are the head."""
    cls = module.LlamaForCausalLM
    original = cls.get_embed_and_head
    if getattr(original, "_harness", False):
        return

    def get_embed_and_head(self: Any) -> Any:
        if getattr(self.config, "tie_word_embeddings", False) and not hasattr(self, "lm_head"):
            embed = self.model.embed_tokens.embedding.value
            return embed, embed
        return original(self)

    get_embed_and_head._harness = True
    cls.get_embed_and_head = get_embed_and_head


_after["sgl_jax.srt.models.llama"] = _tied_head


def _flash_attention_on_cpu(module: Any) -> None:
    """sglang-jax replaces its FlashAttention backend (Pallas TPU kernels, with the EAGLE
    metadata) by native attention on CPU; with ``PORTABLE_SPEC_SGLANG_JAX_CPU_FA=1`` the
    FlashAttention backend is kept and its kernels run in Pallas' interpret mode."""
    import os

    if os.environ.get("PORTABLE_SPEC_SGLANG_JAX_CPU_FA") != "1":
        return
    cls = module.ModelRunner
    original = cls._get_attention_backend
    if getattr(original, "_harness", False):
        return

    def _get_attention_backend(self: Any) -> Any:
        device = self.server_args.device
        self.server_args.device = "tpu"
        try:
            return original(self)
        finally:
            self.server_args.device = device

    _get_attention_backend._harness = True
    cls._get_attention_backend = _get_attention_backend


_after["sgl_jax.srt.model_executor.model_runner"] = _flash_attention_on_cpu


def _tpu_block_sizes(module: Any) -> None:
    """The ragged paged attention kernel picks block sizes by TPU generation; interpreted on
    CPU it takes a v6's."""
    import os

    if os.environ.get("PORTABLE_SPEC_SGLANG_JAX_CPU_FA") == "1":
        module.get_tpu_version = lambda: 6


_after["sgl_jax.srt.kernels.ragged_paged_attention.ragged_paged_attention_v3"] = _tpu_block_sizes


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _after:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, _after[fullname])
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, then: Callable[[Any], None]) -> None:
        self._loader, self._then = loader, then

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def activate(interpret: bool = True) -> None:
    """Patch the modules already imported, and the others when they are; with ``interpret``,
    Pallas TPU kernels (sglang-jax's speculative kernels) run in interpret mode."""
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        pltpu.set_tpu_interpret_mode()
    for name, patch in _after.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
