"""What it takes to run sglang-jax's engine with SmolLM2 on JAX CPU (test harness only; not
part of the library).

* sglang-jax's native attention (the CPU backend) pads the KV cache's head dimension to a
  multiple of 128 and returns attention outputs of that width; SmolLM2's heads are 64 wide, so
  the output projection fails. The output is cut back to the query's head dimension.
* SmolLM2 ties its output head to its embeddings; an EAGLE-3 drafter asks the target for its
  head: the embeddings are returned.
* After a tree verify, sglang-jax keeps each draft node's KV at the slot of the node's index
  (``req_to_token[request, prefix + node]``), but the next step reads the accepted path's KV at
  ``prefix + depth``: for a path other than the first nodes, the target then attends to the
  wrong tokens. The request's slots in that window are reordered so that depth ``j`` holds the
  accepted node ``j`` (a permutation of its own slots; page size 1, as on CPU).
* Native attention has none of the EAGLE metadata calls and treats a target verify batch as a
  decode batch. With speculation on, the engine gets :class:`EagleNativeAttention` instead:
  the target's verify attends exactly (each draft node to the request's cached prefix and to
  its ancestors in the tree: sglang-jax's own tree mask, causal for chains), and the draft
  head attends to its own token only. The drafts are noise either way (a random-weight
  head): what is checked is the target's verification, which is exact.

``activate()`` applies the patches when the patched modules are imported, in this process;
``PORTABLE_SPEC_SGLANG_JAX_CPU_HARNESS=1`` with ``tests/real_sglang_jax/harness_site`` on
``PYTHONPATH`` applies them in every process the engine spawns (its ``sitecustomize``).
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
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


def _model_runner(module: Any) -> None:
    _flash_attention_on_cpu(module)
    _eagle_on_native(module)


_after["sgl_jax.srt.model_executor.model_runner"] = _model_runner


def _tpu_block_sizes(module: Any) -> None:
    """The ragged paged attention kernel picks block sizes by TPU generation; interpreted on
    CPU it takes a v6's."""
    import os

    if os.environ.get("PORTABLE_SPEC_SGLANG_JAX_CPU_FA") == "1":
        module.get_tpu_version = lambda: 6


_after["sgl_jax.srt.kernels.ragged_paged_attention.ragged_paged_attention_v3"] = _tpu_block_sizes


def _eagle_native_attention() -> Any:
    """The class (made on first use: it subclasses sglang-jax's native attention)."""
    global _EAGLE_CLASS
    if _EAGLE_CLASS is not None:
        return _EAGLE_CLASS
    from dataclasses import dataclass

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from jax.tree_util import register_pytree_node_class
    from sgl_jax.srt.layers.attention.native_backend import NativeAttention
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    @register_pytree_node_class
    @dataclass
    class VerifyMetadata:
        """Target verify: per request the KV slots it reads ``[bs, K]``, per draft token the
        keys it may attend ``[bs * q, K]`` and the slot its own KV goes to ``[bs * q]``."""

        kv_slots: Any = None
        kv_mask: Any = None
        write_slots: Any = None
        custom_mask: Any = None  # written by sglang-jax's draft padding; not read

        def tree_flatten(self) -> Any:
            return (self.kv_slots, self.kv_mask, self.write_slots), {}

        @classmethod
        def tree_unflatten(cls, aux: Any, children: Any) -> Any:
            return cls(*children)

    class EagleNativeAttention(NativeAttention):  # a pytree: nnx registers its subclasses
        def __init__(self, num_attn_heads: int, num_kv_heads: int, mesh: Any, is_draft: bool):
            super().__init__(num_attn_heads, num_kv_heads, mesh)
            self.is_draft = is_draft
            self.forward_metadata = nnx.data(VerifyMetadata())

        def get_forward_metadata(self, batch: Any) -> Any:
            return VerifyMetadata()

        def get_eagle_base_metadata(self, batch: Any) -> Any:
            return VerifyMetadata()

        def get_eagle_multi_step_metadata(self, batch: Any) -> Any:
            return [VerifyMetadata() for _ in range(batch.speculative_num_steps)]

        def get_eagle_forward_metadata(self, batch: Any, **_: Any) -> Any:
            if self.is_draft or batch.forward_mode != ForwardMode.TARGET_VERIFY:
                return VerifyMetadata()
            spec = batch.spec_info_padded
            q = int(spec.draft_token_num)
            prefix = np.asarray(batch.seq_lens, dtype=np.int64)  # cached tokens, root excluded
            bs = len(prefix)
            table = _RUNNERS[id(self)].req_to_token_pool.req_to_token
            pools = np.asarray(batch.req_pool_indices, dtype=np.int64)
            width = int(prefix.max()) + q if bs else q
            slots = np.zeros((bs, width), np.int32)
            mask = np.zeros((bs * q, width), bool)
            write = np.full(bs * q, -1, np.int32)
            tree = (
                None if spec.custom_mask is None else np.asarray(jax.device_get(spec.custom_mask))
            )
            offset = 0
            for b in range(bs):
                p = int(prefix[b])
                rows = slice(b * q, (b + 1) * q)
                if p <= 0 or pools[b] < 0:  # a padding slot: attends key 0 only
                    mask[rows, 0] = True
                    offset += q * (q - 1)
                    continue
                slots[b, : p + q] = table[pools[b], : p + q]
                write[rows] = table[pools[b], p : p + q]
                if tree is None:  # a chain: causal over the drafts
                    block = np.tril(np.ones((q, q), bool))
                    mask[rows, :p] = True
                    mask[rows, p : p + q] = block
                else:  # sglang-jax's full tree mask: q rows of (prefix + q) entries
                    block = tree[offset : offset + q * (p + q)].reshape(q, p + q).astype(bool)
                    mask[rows, : p + q] = block
                    offset += q * (p + q)
            return VerifyMetadata(jnp.asarray(slots), jnp.asarray(mask), jnp.asarray(write))

        def __call__(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                     token_to_kv_pool: Any, **kwargs: Any) -> Any:  # fmt: skip
            mode = forward_batch.forward_mode
            if self.is_draft and mode != ForwardMode.EXTEND:
                return self._own_token(q, v, layer, token_to_kv_pool)
            if mode == ForwardMode.TARGET_VERIFY:
                return self._verify(q, k, v, layer, forward_batch, token_to_kv_pool)
            return super().__call__(q, k, v, layer, forward_batch, token_to_kv_pool, **kwargs)

        def _own_token(self, q: Any, v: Any, layer: Any, pool: Any) -> Any:
            heads = q.shape[1] if q.ndim == 3 else self.num_heads
            values = v.reshape(v.shape[0], -1, v.shape[-1])
            out = jnp.repeat(
                values, heads // values.shape[1], axis=1, out_sharding=self.kv_sharding
            )
            return out.reshape(out.shape[0], -1), pool.get_fused_kv_buffer(layer.layer_id)

        def _verify(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                    pool: Any) -> Any:  # fmt: skip
            from types import SimpleNamespace

            meta = self.forward_metadata
            target = SimpleNamespace(
                forward_mode=ForwardMode.EXTEND, out_cache_loc=meta.write_slots
            )
            keys, values, fused = self._get_and_update_kv_cache(k, v, target, pool, layer.layer_id)
            tokens = q.shape[0]
            heads = self.num_heads
            q3 = q.reshape(tokens, heads, -1)
            head_dim = q3.shape[-1]
            padded = keys.shape[-1]
            if padded != head_dim:
                q3 = jnp.pad(q3, ((0, 0), (0, 0), (0, padded - head_dim)))
            nodes = tokens // meta.kv_slots.shape[0]
            request = jnp.arange(tokens) // nodes
            slots = meta.kv_slots[request]  # [T, K]
            kk = keys[slots]  # [T, K, kv_heads, d]
            vv = values[slots]
            repeat = heads // kk.shape[2]
            spread = NamedSharding(self.mesh, P(None, None, "tensor", None))
            kk = jnp.repeat(kk, repeat, axis=2, out_sharding=spread)
            vv = jnp.repeat(vv, repeat, axis=2, out_sharding=spread)
            scale = layer.scaling if layer.scaling is not None else 1.0 / np.sqrt(layer.head_dim)
            logits = jnp.einsum("thd,tkhd->thk", q3, kk).astype(jnp.float32) * scale
            logits = jnp.where(meta.kv_mask[:, None, :], logits, -jnp.inf)
            weights = jax.nn.softmax(logits, axis=-1).astype(vv.dtype)
            out = jnp.einsum("thk,tkhd->thd", weights, vv)[..., :head_dim]
            return out.reshape(tokens, heads * head_dim), fused

    _EAGLE_CLASS = EagleNativeAttention
    return _EAGLE_CLASS


_EAGLE_CLASS: Any = None
_RUNNERS: dict[int, Any] = {}


def _eagle_on_native(module: Any) -> None:
    """With speculation on, native attention becomes :class:`EagleNativeAttention`."""
    cls = module.ModelRunner
    original = cls._get_attention_backend
    if getattr(original, "_harness_eagle", False):
        return

    def _get_attention_backend(self: Any) -> Any:
        backend = original(self)
        if type(backend).__name__ == "NativeAttention" and self.server_args.speculative_algorithm:
            backend = _eagle_native_attention()(
                backend.num_heads, backend.num_kv_heads, backend.mesh, bool(self.is_draft_worker)
            )
            _RUNNERS[id(backend)] = self  # host side: the model runner's req_to_token pool
        return backend

    _get_attention_backend._harness_eagle = True
    cls._get_attention_backend = _get_attention_backend


#: sglang-jax's idle-time KV check in this process: ``checks`` (how many ran), ``leak`` (the
#: last one's message, ``None`` when it found every slot accounted for)
KV_CHECK: dict[str, Any] = {"checks": 0, "leak": None}


def _kv_accounting(module: Any) -> None:
    """sglang-jax's idle-time check of its KV pools (``Scheduler.check_memory``, which raises
    and stops the engine when slots are missing) records its outcome in :data:`KV_CHECK` for
    the tests to assert, and logs a failure instead of stopping the engine (the run then
    reports it rather than hanging its caller)."""
    cls = module.Scheduler
    original = cls.check_memory
    if getattr(original, "_harness", False):
        return

    def check_memory(self: Any) -> Any:
        try:
            result = original(self)
        except ValueError as exc:
            if "memory leak" not in str(exc):
                raise
            import logging

            if KV_CHECK["leak"] != str(exc):
                logging.getLogger("sgl_jax.harness").warning("sglang-jax's KV check: %s", exc)
            KV_CHECK.update(leak=str(exc), checks=KV_CHECK["checks"] + 1)
            return None
        KV_CHECK.update(leak=None, checks=KV_CHECK["checks"] + 1)
        return result

    check_memory._harness = True
    cls.check_memory = check_memory


def kv_check_after(checks: int, timeout: float = 120.0) -> str | None:
    """Wait (at most ``timeout`` seconds) for an idle-time KV check after the ``checks``-th
    (its count read once the requests were done) and return its leak message (``None``: no
    slot missing). Raises TimeoutError when none ran (the scheduler was never idle)."""
    import time

    deadline = time.monotonic() + timeout
    while KV_CHECK["checks"] <= checks:
        if time.monotonic() > deadline:
            raise TimeoutError("sglang-jax's scheduler ran no idle-time KV check")
        time.sleep(0.01)
    return KV_CHECK["leak"]


_trees: dict[int, tuple] = {}  # batch id -> the verify tree of that step (host arrays)


def _keep_tree(module: Any) -> None:
    cls = module.EagleVerifyInput
    original = cls.prepare_for_verify
    if getattr(original, "_harness", False):
        return

    def prepare_for_verify(self: Any, model_worker_batch: Any) -> Any:
        result = original(self, model_worker_batch)
        if self.retrive_next_sibling is not None and self.custom_mask is not None:
            import numpy as np

            bs, n = np.asarray(self.retrive_next_token).shape
            _trees[int(model_worker_batch.bid)] = (
                np.asarray(self.retrive_next_token),
                np.asarray(self.retrive_next_sibling),
                np.asarray(self.draft_token).reshape(bs, n),
                np.asarray(model_worker_batch.seq_lens).copy(),  # the cached prefix
                np.asarray(model_worker_batch.req_pool_indices).copy(),
            )
        return result

    prepare_for_verify._harness = True
    cls.prepare_for_verify = prepare_for_verify


_after["sgl_jax.srt.speculative.eagle_info"] = _keep_tree


def _accepted_kv(scheduler: Any, result: Any) -> None:
    """Reorder the request's slots after a tree verify: depth ``j`` gets accepted node ``j``."""
    import numpy as np

    tree = _trees.pop(int(result.bid), None)
    if tree is None or result.next_token_ids is None or result.accept_lens is None:
        return
    next_token, next_sibling, draft, prefix, pools = tree
    tokens = np.asarray(result.next_token_ids).reshape(-1)
    lengths = np.asarray(result.accept_lens).reshape(-1)
    table = scheduler.req_to_token_pool.req_to_token
    bs, n = draft.shape
    for b in range(min(bs, len(lengths))):
        if prefix[b] <= 0 or pools[b] < 0:
            continue
        path, node = [0], 0
        for j in range(int(lengths[b]) - 1):
            child = int(next_token[b, node])
            while child != -1 and int(draft[b, child]) != int(tokens[b * n + j]):
                child = int(next_sibling[b, child])
            if child == -1:
                break
            path.append(child)
            node = child
        if path == list(range(len(path))):
            continue
        p = int(prefix[b])
        old = np.array(table[pools[b], p : p + n])
        rest = [i for i in range(n) if i not in path]
        table[pools[b], p : p + n] = old[path + rest]


def _kv_accounting_and_trees(module: Any) -> None:
    _kv_accounting(module)
    cls = module.Scheduler
    original = cls.process_batch_result_decode
    if getattr(original, "_harness", False):
        return

    def process_batch_result_decode(self: Any, batch: Any, result: Any, *args: Any) -> Any:
        if result is not None:
            _accepted_kv(self, result)
        return original(self, batch, result, *args)

    process_batch_result_decode._harness = True
    cls.process_batch_result_decode = process_batch_result_decode


_after["sgl_jax.srt.managers.scheduler"] = _kv_accounting_and_trees


def _tree_draft_mask(module: Any) -> None:
    """sglang-jax's tree drafting (topk > 1) asks ``build_tree_mask_for_draft_decode`` for the
    first step's mask with ``parents_list=None``, which it refuses (``len(None)``): trees never
    reach their first draft step. The first step has no parents to read: it gets a list with
    that one (unread) entry."""
    original = module.build_tree_mask_for_draft_decode
    if getattr(original, "_harness", False):
        return

    def build_tree_mask_for_draft_decode(seq_lens: Any, topk: int, speculative_step_id: int,
                                         parents_list: Any) -> Any:  # fmt: skip
        if parents_list is None and speculative_step_id == 0:
            parents_list = [None]
        return original(seq_lens, topk, speculative_step_id, parents_list)

    build_tree_mask_for_draft_decode._harness = True
    module.build_tree_mask_for_draft_decode = build_tree_mask_for_draft_decode


_after["sgl_jax.srt.speculative.eagle_draft_worker"] = _tree_draft_mask


class _Finder(importlib.abc.MetaPathFinder):
    _searching = threading.local()  # no answer while asking the others (they may ask back)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _after or getattr(self._searching, "on", False):
            return None
        self._searching.on = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None:
                        spec.loader = _Loader(spec.loader, _after[fullname])
                    return spec
            return None
        finally:
            self._searching.on = False


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
