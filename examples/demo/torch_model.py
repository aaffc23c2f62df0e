"""The demo's Llama decoder in torch: forward with a KV cache and tree attention.

The torch twin of ``examples.demo.jax_model`` (same class interface, same math):
a forward over ``M`` new tokens attends to the cache's first ``ctx_len`` positions and to the
new tokens through an ``[M, M]`` tree mask, returns the new keys/values separately, and
:meth:`TorchLlama.commit` copies the accepted ones into the cache in place. The
self-speculative drafter runs the first layers plus the head and expands a top-k tree with
tensor ops only (:meth:`TorchLlama.draft_tree`, no host synchronization on accelerators), or
one level per call with the level's logits masked by its grammar rows
(:meth:`TorchLlama.draft_level`).

On an accelerator the forward is asynchronous by nature (kernels are queued). On the CPU,
torch runs ops eagerly, so :meth:`TorchLlama.launch` runs the forward on a worker thread:
the caller's host work (the grammar mask build) overlaps it the same way.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from portable_spec.backends.cuda.devices import current_stream_event

from examples.demo.weights import LlamaConfig, LlamaWeights
from portable_spec import apply_vocab_mask

__all__ = ["TorchLaunch", "TorchLlama"]


def _rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * gain


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x`` ``[M, heads, hd]`` by ``positions`` ``[M]``; pairs are ``(i, i + hd/2)``."""
    half = x.shape[-1] // 2
    exponent = torch.arange(half, dtype=x.dtype, device=x.device) * 2 / x.shape[-1]
    inv_freq = base**-exponent
    angle = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)


def _attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    ctx_len: int | torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor,
    cfg: LlamaConfig,
) -> torch.Tensor:
    """Grouped-query attention of ``q`` ``[M, H, hd]`` over the cache ``[T, KVH, hd]`` (first
    ``ctx_len`` positions) and the tree keys ``[N, KVH, hd]`` (where ``tree_mask`` ``[M, N]``)."""
    m = q.shape[0]
    qg = q.reshape(m, cfg.n_kv_heads, cfg.group, cfg.head_dim)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    s_ctx = torch.einsum("mkgd,tkd->kgmt", qg, k_ctx) * scale
    s_tree = torch.einsum("mkgd,nkd->kgmn", qg, k_tree) * scale
    ctx_ok = torch.arange(k_ctx.shape[0], device=q.device) < ctx_len
    s_ctx = s_ctx.masked_fill(~ctx_ok, float("-inf"))
    s_tree = s_tree.masked_fill(~tree_mask, float("-inf"))
    probs = torch.softmax(torch.cat((s_ctx, s_tree), dim=-1), dim=-1)
    t = k_ctx.shape[0]
    out = torch.einsum("kgmt,tkd->mkgd", probs[..., :t], v_ctx)
    out = out + torch.einsum("kgmn,nkd->mkgd", probs[..., t:], v_tree)
    return out.reshape(m, cfg.n_heads * cfg.head_dim)


def _finish_time(event: Any) -> float:
    event.synchronize()
    return time.perf_counter()


class TorchLaunch:
    """A verify forward in flight: queued kernels on an accelerator (an event is recorded
    after them), a worker-thread future on the CPU. A watcher records the
    ``time.perf_counter`` at which the forward completed."""

    def __init__(self, outputs: Future, done: Future) -> None:
        self._outputs = outputs
        self._done = done

    def logits(self) -> torch.Tensor:
        """``[M, vocab]`` logits (on the CPU this waits for the worker thread)."""
        return self._outputs.result()[0]

    @property
    def tree_k(self) -> torch.Tensor:
        return self._outputs.result()[1]

    @property
    def tree_v(self) -> torch.Tensor:
        return self._outputs.result()[2]

    def wait(self) -> float:
        """Block until the forward finished; returns its ``perf_counter`` finish time."""
        return self._done.result()


class TorchLlama:
    """SmolLM2 (any Llama GGUF) as torch tensors, with a ``[layers, max_len, KVH, hd]`` cache.

    Args:
        weights: dequantized weights (their dtype is the compute dtype).
        max_len: cache positions (prompt + generated tokens + one verify tree must fit).
        device: a torch device (default CPU). CPU weights share memory with ``weights``.
    """

    framework = "torch"
    #: eager: any input shape runs as it is
    static_shapes = False

    def __init__(self, weights: LlamaWeights, *, max_len: int, device: Any = None) -> None:
        self.config = weights.config
        self.device = torch.device(device or "cpu")
        self.max_len = int(max_len)
        self.dtype = weights.dtype
        self.params = {k: torch.from_numpy(v).to(self.device) for k, v in weights.as_dict().items()}
        self._torch_dtype = self.params["embed"].dtype
        # CPU: the forward runs on this thread (torch ops release the GIL). Accelerator: the
        # forward is only queued; this thread waits for its event to time it.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="torch-forward")
        self.reset()

    @property
    def mask_device(self) -> torch.device:
        """Where grammar masks must go (``device=`` of ``build_grammar_vocab_mask``)."""
        return self.device

    def reset(self) -> None:
        """Empty the KV cache (allocates it on first use)."""
        cfg = self.config
        shape = (cfg.n_layers, self.max_len, cfg.n_kv_heads, cfg.head_dim)
        self.cache_k = torch.zeros(shape, dtype=self._torch_dtype, device=self.device)
        self.cache_v = torch.zeros(shape, dtype=self._torch_dtype, device=self.device)

    # -- the model -----------------------------------------------------------------------------
    def _tensor(self, x: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(self.device, dtype)
        return torch.as_tensor(np.asarray(x), device=self.device).to(dtype)

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_len: int | torch.Tensor,
        tree_k: torch.Tensor,
        tree_v: torch.Tensor,
        slots: torch.Tensor,
        tree_mask: torch.Tensor,
        n_layers: int,
    ) -> torch.Tensor:
        """Run the first ``n_layers`` layers on ``x`` ``[M, hidden]``; the rows' keys/values
        are written into ``tree_k``/``tree_v`` ``[n_layers, N, KVH, hd]`` at ``slots`` (in
        place) before attending. Returns the hidden states."""
        cfg, p = self.config, self.params
        m = x.shape[0]
        for i in range(n_layers):
            a = _rms_norm(x, p["attn_norm"][i], cfg.rms_eps)
            q = (a @ p["wq"][i]).reshape(m, cfg.n_heads, cfg.head_dim)
            k = (a @ p["wk"][i]).reshape(m, cfg.n_kv_heads, cfg.head_dim)
            v = (a @ p["wv"][i]).reshape(m, cfg.n_kv_heads, cfg.head_dim)
            q, k = _rope(q, positions, cfg.rope_base), _rope(k, positions, cfg.rope_base)
            tree_k[i, slots] = k
            tree_v[i, slots] = v
            att = _attention(
                q, self.cache_k[i], self.cache_v[i], ctx_len, tree_k[i], tree_v[i], tree_mask, cfg
            )
            x = x + att @ p["wo"][i]
            f = _rms_norm(x, p["ffn_norm"][i], cfg.rms_eps)
            x = x + (F.silu(f @ p["w_gate"][i]) * (f @ p["w_up"][i])) @ p["w_down"][i]
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.params["final_norm"], self.config.rms_eps) @ self.params["embed"].T

    def _forward(
        self, tokens: Any, positions: Any, ctx_len: int, tree_mask: Any, with_logits: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            cfg = self.config
            tokens = self._tensor(tokens, torch.long)
            positions = self._tensor(positions, torch.long)
            tree_mask = self._tensor(tree_mask, torch.bool)
            m = tokens.shape[0]
            shape = (cfg.n_layers, m, cfg.n_kv_heads, cfg.head_dim)
            tree_k = torch.zeros(shape, dtype=self._torch_dtype, device=self.device)
            tree_v = torch.zeros(shape, dtype=self._torch_dtype, device=self.device)
            x = self.params["embed"][tokens]
            slots = torch.arange(m, device=self.device)
            x = self._layers(x, positions, ctx_len, tree_k, tree_v, slots, tree_mask, cfg.n_layers)
            logits = self._head(x) if with_logits else None
        return logits, tree_k, tree_v

    # -- the runner interface (same as JaxLlama) -----------------------------------------------
    def prefill(self, tokens: np.ndarray, bucket: int = 64) -> None:
        """Write the KV of ``tokens`` ``[P]`` at positions ``0..P-1``. Blocks on the CPU.
        (``bucket`` is accepted for interface parity; torch needs no padding.)"""
        n = len(tokens)
        if n == 0:
            return
        if n > self.max_len:
            raise ValueError(f"prompt of {n} tokens does not fit max_len = {self.max_len}")
        causal = np.tril(np.ones((n, n), dtype=bool))
        _, tree_k, tree_v = self._forward(
            np.asarray(tokens), np.arange(n), 0, causal, with_logits=False
        )
        self._commit(tree_k, tree_v, np.arange(n), 0)

    def launch(self, tokens: Any, positions: Any, ctx_len: int, tree_mask: Any) -> TorchLaunch:
        """Start the forward of ``M`` new tokens; returns at once.

        Args:
            tokens: int ``[M]`` token ids; positions: int ``[M]`` absolute positions.
            ctx_len: committed tokens in the cache (the rows attend to positions below it).
            tree_mask: bool ``[M, M]``: row ``i`` may attend to new token ``j``.
        Host (numpy) or torch inputs.
        """
        if ctx_len + len(tokens) > self.max_len:
            raise ValueError(f"{ctx_len} + {len(tokens)} tokens exceed max_len {self.max_len}")
        args = (tokens, positions, int(ctx_len), tree_mask, True)
        if self.device.type == "cpu":
            outputs = self._worker.submit(self._forward, *args)
            done = self._worker.submit(time.perf_counter)  # runs right after the forward
            return TorchLaunch(outputs, done)
        outputs = Future()
        outputs.set_result(self._forward(*args))  # queued on the current stream
        event = current_stream_event(self.device)
        if event is None:  # no events: the work above already ran synchronously
            done = Future()
            done.set_result(time.perf_counter())
        else:
            done = self._worker.submit(_finish_time, event)
        return TorchLaunch(outputs, done)

    def masked_argmax(self, logits: torch.Tensor, mask: Any) -> np.ndarray:
        """Greedy token of each row after the grammar mask (``apply_vocab_mask``, in place on
        ``logits``); blocks. ``mask``: int32 ``[M, words]`` tensor or numpy. Returns int64
        ``[M]``."""
        with torch.inference_mode():
            if mask is not None:
                if isinstance(mask, np.ndarray):
                    mask = torch.from_numpy(np.array(mask, copy=True)).to(self.device)
                apply_vocab_mask(logits, mask)
            return torch.argmax(logits, dim=-1).cpu().numpy().astype(np.int64)

    def _commit(self, tree_k: torch.Tensor, tree_v: torch.Tensor, src: Any, dst: int) -> None:
        src_t = self._tensor(src, torch.long)
        with torch.inference_mode():
            r = src_t.shape[0]
            self.cache_k[:, dst : dst + r] = tree_k[:, src_t]
            self.cache_v[:, dst : dst + r] = tree_v[:, src_t]

    def commit(self, launch: TorchLaunch, src: np.ndarray, dst: int) -> None:
        """Copy the launch's keys/values of nodes ``src`` ``[R]`` to cache positions
        ``dst..dst+R-1`` (``dst + R <= max_len``)."""
        if dst + len(src) > self.max_len:
            raise ValueError(f"commit of {len(src)} rows at {dst} exceeds max_len {self.max_len}")
        self._commit(launch.tree_k, launch.tree_v, src, dst)

    def draft_tree(
        self,
        root: int,
        start: int,
        *,
        nodes: int,
        branch: int,
        layers: int,
        root_mask: Any = None,
    ) -> dict[str, torch.Tensor]:
        """Self-speculative draft tree from the first ``layers`` layers plus the head.

        Same algorithm and outputs as ``JaxLlama.draft_tree``: level by level, each frontier
        node proposes its top ``branch`` tokens and the ``branch`` candidates with the best
        cumulative log-probability become the next frontier; node ids follow creation order.
        ``root_mask`` (int32 ``[1, words]``, optional): the root's grammar row, applied to the
        first level's logits only.

        Returns:
            tensors on the model's device: ``next_token``, ``next_sibling``, ``tokens`` (int32
            ``[N]``), ``positions`` (int64 ``[N]``), ``tree_mask`` (bool ``[N, N]``).
        """
        cfg = self.config
        if not 1 <= layers <= cfg.n_layers:
            raise ValueError(f"draft layers must be in 1..{cfg.n_layers}, got {layers}")
        dev = self.device
        with torch.inference_mode():
            tokens = torch.zeros(nodes, dtype=torch.long, device=dev)
            tokens[0] = root
            parent = torch.full((nodes,), -1, dtype=torch.long, device=dev)
            depth = torch.zeros(nodes, dtype=torch.long, device=dev)
            score = torch.zeros(nodes, dtype=self._torch_dtype, device=dev)
            eye = torch.eye(nodes, dtype=torch.bool, device=dev)
            anc = eye.clone()
            shape = (layers, nodes, cfg.n_kv_heads, cfg.head_dim)
            tree_k = torch.zeros(shape, dtype=self._torch_dtype, device=dev)
            tree_v = torch.zeros(shape, dtype=self._torch_dtype, device=dev)
            frontier = torch.zeros(1, dtype=torch.long, device=dev)
            added = 1
            while added < nodes:
                x = self.params["embed"][tokens[frontier]]
                x = self._layers(
                    x,
                    start + depth[frontier],
                    start,
                    tree_k,
                    tree_v,
                    frontier,
                    anc[frontier],
                    layers,
                )
                logits = self._head(x)
                if added == 1 and root_mask is not None:
                    apply_vocab_mask(logits, root_mask)
                logp = torch.log_softmax(logits, dim=-1)
                top_lp, top_tok = torch.topk(logp, branch, dim=-1)
                cand = (score[frontier][:, None] + top_lp).reshape(-1)
                take = min(branch, nodes - added, cand.shape[0])
                pick = torch.topk(cand, take).indices
                new = torch.arange(added, added + take, device=dev)
                par = frontier[pick // branch]
                tokens[new] = top_tok.reshape(-1)[pick]
                parent[new] = par
                depth[new] = depth[par] + 1
                score[new] = cand[pick]
                anc[new] = anc[par] | eye[new]
                frontier, added = new, added + take
            ids = torch.arange(nodes, device=dev)
            is_child = parent[None, :] == ids[:, None]
            next_token = torch.where(is_child.any(dim=1), is_child.int().argmax(dim=1), -1)
            later = (parent[None, :] == parent[:, None]) & (ids[None, :] > ids[:, None])
            later &= (parent >= 0)[:, None]
            next_sibling = torch.where(later.any(dim=1), later.int().argmax(dim=1), -1)
        return {
            "next_token": next_token.to(torch.int32),
            "next_sibling": next_sibling.to(torch.int32),
            "tokens": tokens.to(torch.int32),
            "positions": start + depth,
            "tree_mask": anc,
        }

    def draft_start(self, *, slots: int, layers: int) -> dict[str, torch.Tensor]:
        """Shallow key/value buffers for a draft of ``slots`` tree slots (the nodes, plus one
        scratch slot for padding rows), for :meth:`draft_level`."""
        cfg = self.config
        shape = (layers, slots, cfg.n_kv_heads, cfg.head_dim)
        return {
            "tree_k": torch.zeros(shape, dtype=self._torch_dtype, device=self.device),
            "tree_v": torch.zeros(shape, dtype=self._torch_dtype, device=self.device),
        }

    def draft_level(
        self,
        state: dict[str, torch.Tensor],
        tokens: np.ndarray,
        positions: np.ndarray,
        start: int,
        slots: np.ndarray,
        anc: np.ndarray,
        mask: Any,
        *,
        branch: int,
        layers: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One level of the self drafter; same arguments and results as
        ``JaxLlama.draft_level`` (blocks for its result)."""
        with torch.inference_mode():
            x = self.params["embed"][self._tensor(tokens, torch.long)]
            x = self._layers(
                x,
                self._tensor(positions, torch.long),
                start,
                state["tree_k"],
                state["tree_v"],
                self._tensor(slots, torch.long),
                self._tensor(anc, torch.bool),
                layers,
            )
            logits = self._head(x)
            if mask is not None:
                apply_vocab_mask(logits, mask)
            top_lp, top_tok = torch.topk(torch.log_softmax(logits, dim=-1), branch, dim=-1)
            return (
                top_lp.cpu().numpy().astype(np.float64),
                top_tok.cpu().numpy().astype(np.int64),
            )

    def to_host(self, array: Any) -> np.ndarray:
        """Blocking copy of a tensor to numpy."""
        return array.detach().cpu().numpy()

    def close(self) -> None:
        """Stop the worker thread."""
        self._worker.shutdown(wait=True)
