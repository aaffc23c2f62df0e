"""The demo's Llama decoder in JAX: jitted forward with a KV cache and tree attention.

Every compiled function has static shapes: the KV cache is allocated for ``max_len``
positions, a verify tree always has ``nodes`` rows, and the context length is a traced
scalar, so a generation compiles each function once. The forward over ``M`` new tokens (a
verify tree, a prompt chunk or one token) attends to

* the cache's first ``ctx_len`` positions (the committed context), and
* the new tokens themselves, through an ``[M, M]`` boolean tree mask (ancestor-or-self),

and returns the new tokens' keys/values separately; :meth:`JaxLlama.commit` then copies the
accepted ones into the cache (donated, so no copy of the cache is made). The same layer code
drives the self-speculative drafter: the first layers plus the head, expanding a top-k tree
either all on the device (:meth:`JaxLlama.draft_tree`, no grammar) or one level per call
(:meth:`JaxLlama.draft_level`, the level's logits masked by the grammar rows of its nodes
before the top-k; the host picks the next level between calls).

The torch twin is ``examples.demo.torch_model`` (same methods, same arguments).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from examples.demo.weights import LlamaConfig, LlamaWeights
from portable_spec import apply_vocab_mask

__all__ = ["JaxLaunch", "JaxLlama"]

Params = dict[str, jax.Array]


# -- the math ----------------------------------------------------------------------------------
def _rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotate ``x`` ``[M, heads, hd]`` by ``positions`` ``[M]``; pairs are ``(i, i + hd/2)``."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=x.dtype) * 2 / x.shape[-1])
    angle = positions.astype(x.dtype)[:, None] * inv_freq[None, :]  # [M, half]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return jnp.concatenate((lo * cos - hi * sin, hi * cos + lo * sin), axis=-1)


def _attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    ctx_len: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    cfg: LlamaConfig,
) -> jax.Array:
    """Grouped-query attention of ``q`` ``[M, H, hd]`` over the cache ``[T, KVH, hd]`` (first
    ``ctx_len`` positions) and the tree keys ``[N, KVH, hd]`` (where ``tree_mask`` ``[M, N]``)."""
    m = q.shape[0]
    qg = q.reshape(m, cfg.n_kv_heads, cfg.group, cfg.head_dim)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    s_ctx = jnp.einsum("mkgd,tkd->kgmt", qg, k_ctx) * scale
    s_tree = jnp.einsum("mkgd,nkd->kgmn", qg, k_tree) * scale
    neg = jnp.asarray(-jnp.inf, dtype=q.dtype)
    ctx_ok = jnp.arange(k_ctx.shape[0]) < ctx_len
    s_ctx = jnp.where(ctx_ok[None, None, None, :], s_ctx, neg)
    s_tree = jnp.where(tree_mask[None, None, :, :], s_tree, neg)
    probs = jax.nn.softmax(jnp.concatenate((s_ctx, s_tree), axis=-1), axis=-1)
    p_ctx, p_tree = probs[..., : k_ctx.shape[0]], probs[..., k_ctx.shape[0] :]
    out = jnp.einsum("kgmt,tkd->mkgd", p_ctx, v_ctx) + jnp.einsum("kgmn,nkd->mkgd", p_tree, v_tree)
    return out.reshape(m, cfg.n_heads * cfg.head_dim)


def _layers(
    params: Params,
    x: jax.Array,
    positions: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    ctx_len: jax.Array,
    tree_k: jax.Array,
    tree_v: jax.Array,
    slots: jax.Array,
    tree_mask: jax.Array,
    cfg: LlamaConfig,
    n_layers: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Run the first ``n_layers`` layers on ``x`` ``[M, hidden]``.

    The rows' keys/values are written into ``tree_k``/``tree_v`` ``[n_layers, N, KVH, hd]`` at
    ``slots`` ``[M]`` before attending, so a row sees the tree keys its mask row allows,
    itself included. Returns ``(x, tree_k, tree_v)``.
    """
    m = x.shape[0]
    names = [k for k in params if k not in ("embed", "final_norm")]

    def layer(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[Any, ...]:
        # index the stacked weights in place: slicing [:n_layers] would copy them every call
        h, tree_k, tree_v = carry
        p = {k: jax.lax.dynamic_index_in_dim(params[k], i, keepdims=False) for k in names}
        k_ctx = jax.lax.dynamic_index_in_dim(cache_k, i, keepdims=False)
        v_ctx = jax.lax.dynamic_index_in_dim(cache_v, i, keepdims=False)
        a = _rms_norm(h, p["attn_norm"], cfg.rms_eps)
        q = (a @ p["wq"]).reshape(m, cfg.n_heads, cfg.head_dim)
        k = (a @ p["wk"]).reshape(m, cfg.n_kv_heads, cfg.head_dim)
        v = (a @ p["wv"]).reshape(m, cfg.n_kv_heads, cfg.head_dim)
        q, k = _rope(q, positions, cfg.rope_base), _rope(k, positions, cfg.rope_base)
        tree_k = tree_k.at[i, slots].set(k)
        tree_v = tree_v.at[i, slots].set(v)
        att = _attention(q, k_ctx, v_ctx, ctx_len, tree_k[i], tree_v[i], tree_mask, cfg)
        h = h + att @ p["wo"]
        f = _rms_norm(h, p["ffn_norm"], cfg.rms_eps)
        h = h + (jax.nn.silu(f @ p["w_gate"]) * (f @ p["w_up"])) @ p["w_down"]
        return h, tree_k, tree_v

    return jax.lax.fori_loop(0, n_layers, layer, (x, tree_k, tree_v))


def _head(params: Params, x: jax.Array, cfg: LlamaConfig) -> jax.Array:
    return _rms_norm(x, params["final_norm"], cfg.rms_eps) @ params["embed"].T


@partial(jax.jit, static_argnames=("cfg", "with_logits"))
def _forward(
    params: Params,
    cache_k: jax.Array,
    cache_v: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    ctx_len: jax.Array,
    tree_mask: jax.Array,
    cfg: LlamaConfig,
    with_logits: bool = True,
) -> tuple[jax.Array | None, jax.Array, jax.Array]:
    m = tokens.shape[0]
    shape = (cfg.n_layers, m, cfg.n_kv_heads, cfg.head_dim)
    tree_k = jnp.zeros(shape, cache_k.dtype)
    tree_v = jnp.zeros(shape, cache_v.dtype)
    x = params["embed"][tokens]
    slots = jnp.arange(m)
    x, tree_k, tree_v = _layers(
        params,
        x,
        positions,
        cache_k,
        cache_v,
        ctx_len,
        tree_k,
        tree_v,
        slots,
        tree_mask,
        cfg,
        cfg.n_layers,
    )
    logits = _head(params, x, cfg) if with_logits else None
    return logits, tree_k, tree_v


@partial(jax.jit, donate_argnums=(0, 1))
def _commit(
    cache_k: jax.Array,
    cache_v: jax.Array,
    tree_k: jax.Array,
    tree_v: jax.Array,
    src: jax.Array,
    dst: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    start = (jnp.zeros((), dst.dtype), dst, jnp.zeros((), dst.dtype), jnp.zeros((), dst.dtype))
    cache_k = jax.lax.dynamic_update_slice(cache_k, tree_k[:, src], start)
    cache_v = jax.lax.dynamic_update_slice(cache_v, tree_v[:, src], start)
    return cache_k, cache_v


@jax.jit
def _masked_argmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.argmax(apply_vocab_mask(logits, mask), axis=-1)


@partial(jax.jit, static_argnames=("cfg", "branch", "n_layers"), donate_argnums=(3, 4))
def _draft_level(
    params: Params,
    cache_k: jax.Array,
    cache_v: jax.Array,
    tree_k: jax.Array,
    tree_v: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    start: jax.Array,
    slots: jax.Array,
    anc: jax.Array,
    mask: jax.Array | None,
    cfg: LlamaConfig,
    branch: int,
    n_layers: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One level of the self drafter: run the frontier ``[F]`` through the first ``n_layers``
    layers and the head, mask each row's logits with its grammar row (``mask`` ``[F, words]``,
    or None), and return the top ``branch`` log-probabilities (renormalised over the allowed
    tokens) and tokens, with the updated shallow keys/values."""
    x = params["embed"][tokens]
    x, tree_k, tree_v = _layers(
        params, x, positions, cache_k, cache_v, start, tree_k, tree_v, slots, anc, cfg, n_layers
    )
    logits = _head(params, x, cfg)
    if mask is not None:
        logits = apply_vocab_mask(logits, mask)
    top_lp, top_tok = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), branch)
    return top_lp, top_tok, tree_k, tree_v


def _tree_links(parent: jax.Array) -> tuple[jax.Array, jax.Array]:
    """First-child and next-sibling links ``[N]`` of a parent array ``[N]`` (-1 for the root),
    children and siblings in node order."""
    n = parent.shape[0]
    ids = jnp.arange(n)
    is_child = parent[None, :] == ids[:, None]  # [p, i]
    next_token = jnp.where(is_child.any(axis=1), jnp.argmax(is_child, axis=1), -1)
    later_sibling = (parent[None, :] == parent[:, None]) & (ids[None, :] > ids[:, None])
    later_sibling &= (parent >= 0)[:, None]
    next_sibling = jnp.where(later_sibling.any(axis=1), jnp.argmax(later_sibling, axis=1), -1)
    return next_token.astype(jnp.int32), next_sibling.astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg", "nodes", "branch", "n_layers"))
def _draft_tree(
    params: Params,
    cache_k: jax.Array,
    cache_v: jax.Array,
    root: jax.Array,
    start: jax.Array,
    cfg: LlamaConfig,
    nodes: int,
    branch: int,
    n_layers: int,
    root_mask: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Grow a ``nodes``-node tree from ``root`` with the first ``n_layers`` layers + the head.

    Level by level: every frontier node (the nodes added last) is run through the shallow
    model (attending to the cache and to its ancestors' shallow keys), each proposes its top
    ``branch`` tokens, and the ``branch`` candidates with the highest cumulative
    log-probability become the next frontier. Node ids follow creation order (parents first).
    ``root_mask`` (int32 ``[1, words]``, optional): the root's grammar row, applied to the
    first level's logits only (root-only masking: no host round trip).
    """
    dt = params["embed"].dtype
    tokens = jnp.zeros((nodes,), jnp.int32).at[0].set(root.astype(jnp.int32))
    parent = jnp.full((nodes,), -1, jnp.int32)
    depth = jnp.zeros((nodes,), jnp.int32)
    score = jnp.zeros((nodes,), dt)
    anc = jnp.eye(nodes, dtype=jnp.bool_)
    shape = (n_layers, nodes, cfg.n_kv_heads, cfg.head_dim)
    tree_k, tree_v = jnp.zeros(shape, dt), jnp.zeros(shape, dt)
    frontier = np.array([0])
    added = 1
    while added < nodes:
        f = jnp.asarray(frontier)
        x = params["embed"][tokens[f]]
        x, tree_k, tree_v = _layers(
            params,
            x,
            start + depth[f],
            cache_k,
            cache_v,
            start,
            tree_k,
            tree_v,
            f,
            anc[f],
            cfg,
            n_layers,
        )
        logits = _head(params, x, cfg)
        if added == 1 and root_mask is not None:
            logits = apply_vocab_mask(logits, root_mask)
        logp = jax.nn.log_softmax(logits, axis=-1)  # [F, V]
        top_lp, top_tok = jax.lax.top_k(logp, branch)  # [F, branch]
        cand = (score[f][:, None] + top_lp).reshape(-1)
        take = min(branch, nodes - added, cand.shape[0])
        _, pick = jax.lax.top_k(cand, take)
        new = np.arange(added, added + take)
        par = f[pick // branch]
        tokens = tokens.at[new].set(top_tok.reshape(-1)[pick].astype(jnp.int32))
        parent = parent.at[new].set(par.astype(jnp.int32))
        depth = depth.at[new].set(depth[par] + 1)
        score = score.at[new].set(cand[pick])
        anc = anc.at[new].set(anc[par] | jnp.eye(nodes, dtype=jnp.bool_)[new])
        frontier, added = new, added + take
    next_token, next_sibling = _tree_links(parent)
    return {
        "next_token": next_token,
        "next_sibling": next_sibling,
        "tokens": tokens,
        "positions": start + depth,
        "tree_mask": anc,
    }


# -- the runner --------------------------------------------------------------------------------
class JaxLaunch:
    """A verify forward in flight: its outputs are ``jax.Array`` futures (async dispatch).

    ``finished_at`` (``time.perf_counter``) is recorded by a watcher thread when the outputs
    are ready; :meth:`wait` blocks until then and returns it.
    """

    def __init__(self, logits: jax.Array, tree_k: jax.Array, tree_v: jax.Array, watcher: Any):
        self._logits = logits
        self.tree_k = tree_k
        self.tree_v = tree_v
        self._done = watcher.submit(self._watch)

    def _watch(self) -> float:
        self._logits.block_until_ready()
        return time.perf_counter()

    def logits(self) -> jax.Array:
        """``[M, vocab]`` logits (a future: does not block)."""
        return self._logits

    def wait(self) -> float:
        """Block until the forward finished; returns its ``perf_counter`` finish time."""
        return self._done.result()


class JaxLlama:
    """SmolLM2 (any Llama GGUF) on a JAX device, with a ``[layers, max_len, KVH, hd]`` cache.

    Args:
        weights: dequantized weights (their dtype is the compute dtype; float64 needs
            ``jax.enable_x64(True)`` active while this object is built and used).
        max_len: cache positions (prompt + generated tokens + one verify tree must fit).
        device: a ``jax.Device`` (default: the first device).
    """

    framework = "jax"
    #: jitted: every distinct input shape compiles (drafters pad to few shapes)
    static_shapes = True

    def __init__(self, weights: LlamaWeights, *, max_len: int, device: Any = None) -> None:
        self.config = weights.config
        self.device = device or jax.devices()[0]
        self.max_len = int(max_len)
        self.dtype = weights.dtype
        if jnp.zeros((), weights.dtype).dtype != weights.dtype:
            raise ValueError(
                f"JAX cannot hold {weights.dtype} here: wrap the run in jax.enable_x64(True)"
            )
        self.params: Params = {
            k: jax.device_put(v, self.device) for k, v in weights.as_dict().items()
        }
        self._watcher = ThreadPoolExecutor(1, thread_name_prefix="jax-launch-watch")
        self.reset()

    @property
    def mask_device(self) -> Any:
        """Where grammar masks must go (``device=`` of ``build_grammar_vocab_mask``)."""
        return self.device

    def reset(self) -> None:
        """Empty the KV cache (allocates it on first use)."""
        cfg = self.config
        shape = (cfg.n_layers, self.max_len, cfg.n_kv_heads, cfg.head_dim)
        self.cache_k = jax.device_put(jnp.zeros(shape, self.dtype), self.device)
        self.cache_v = jax.device_put(jnp.zeros(shape, self.dtype), self.device)

    def prefill(self, tokens: np.ndarray, bucket: int = 64) -> None:
        """Write the KV of ``tokens`` ``[P]`` at positions ``0..P-1`` (padded to a multiple of
        ``bucket`` so prompt lengths share compilations). Blocks until the cache is written."""
        n = len(tokens)
        if n == 0:
            return
        m = min(-(-n // bucket) * bucket, self.max_len)
        if n > m:
            raise ValueError(f"prompt of {n} tokens does not fit max_len = {self.max_len}")
        padded = np.zeros(m, np.int32)
        padded[:n] = tokens
        causal = np.tril(np.ones((m, m), dtype=bool))
        _, tree_k, tree_v = _forward(
            self.params,
            self.cache_k,
            self.cache_v,
            padded,
            np.arange(m, dtype=np.int32),
            np.int32(0),
            causal,
            self.config,
            with_logits=False,
        )
        self.cache_k, self.cache_v = _commit(
            self.cache_k, self.cache_v, tree_k, tree_v, np.arange(m, dtype=np.int32), np.int32(0)
        )
        jax.block_until_ready((self.cache_k, self.cache_v))

    def launch(self, tokens: Any, positions: Any, ctx_len: int, tree_mask: Any) -> JaxLaunch:
        """Start the forward of ``M`` new tokens; returns at once (async dispatch).

        Args:
            tokens: int ``[M]`` token ids; positions: int ``[M]`` absolute positions.
            ctx_len: committed tokens in the cache (the rows attend to positions below it).
            tree_mask: bool ``[M, M]``: row ``i`` may attend to new token ``j``.
        Host (numpy) or device (``jax.Array``) inputs.
        """
        if ctx_len + len(tokens) > self.max_len:
            raise ValueError(f"{ctx_len} + {len(tokens)} tokens exceed max_len {self.max_len}")
        logits, tree_k, tree_v = _forward(
            self.params,
            self.cache_k,
            self.cache_v,
            tokens,
            positions,
            np.int32(ctx_len),
            tree_mask,
            self.config,
        )
        return JaxLaunch(logits, tree_k, tree_v, self._watcher)

    def masked_argmax(self, logits: jax.Array, mask: Any) -> np.ndarray:
        """Greedy token of each row after the grammar mask (``apply_vocab_mask``); blocks.

        ``mask``: int32 ``[M, words]`` ``jax.Array`` or numpy (uploaded). Returns int64 ``[M]``.
        """
        if mask is None:
            return np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int64)
        if isinstance(mask, np.ndarray):
            mask = jax.device_put(np.array(mask, copy=True), self.device)
        return np.asarray(_masked_argmax(logits, mask)).astype(np.int64)

    def commit(self, launch: JaxLaunch, src: np.ndarray, dst: int) -> None:
        """Copy the launch's keys/values of nodes ``src`` ``[R]`` to cache positions
        ``dst..dst+R-1`` (``dst + R <= max_len``). Does not block."""
        src = np.asarray(src, dtype=np.int32)
        if dst + len(src) > self.max_len:
            raise ValueError(f"commit of {len(src)} rows at {dst} exceeds max_len {self.max_len}")
        self.cache_k, self.cache_v = _commit(
            self.cache_k, self.cache_v, launch.tree_k, launch.tree_v, src, np.int32(dst)
        )

    def draft_tree(
        self,
        root: int,
        start: int,
        *,
        nodes: int,
        branch: int,
        layers: int,
        root_mask: Any = None,
    ) -> dict[str, jax.Array]:
        """Self-speculative draft tree, built on the device without blocking.

        Args:
            root: the last committed token (node 0), not yet in the cache.
            start: its position (= committed tokens in the cache).
            nodes: tree size ``N``; branch: children proposed per frontier node (top-k);
            layers: how many of the first layers the drafter runs before the head.
            root_mask: optional int32 ``[1, words]`` grammar row of the root, applied to the
                first level's logits (root-only masking).

        Returns:
            ``jax.Array`` s: ``next_token``, ``next_sibling``, ``tokens`` (int32 ``[N]``),
            ``positions`` (int ``[N]``), ``tree_mask`` (bool ``[N, N]``, ancestor-or-self).
        """
        if not 1 <= layers <= self.config.n_layers:
            raise ValueError(f"draft layers must be in 1..{self.config.n_layers}, got {layers}")
        return _draft_tree(
            self.params,
            self.cache_k,
            self.cache_v,
            np.int32(root),
            np.int32(start),
            self.config,
            nodes,
            branch,
            layers,
            root_mask,
        )

    def draft_start(self, *, slots: int, layers: int) -> dict[str, jax.Array]:
        """Shallow key/value buffers for a draft of ``slots`` tree slots (the nodes, plus one
        scratch slot for padding rows), for :meth:`draft_level`."""
        cfg = self.config
        shape = (layers, slots, cfg.n_kv_heads, cfg.head_dim)
        return {
            "tree_k": jax.device_put(jnp.zeros(shape, self.dtype), self.device),
            "tree_v": jax.device_put(jnp.zeros(shape, self.dtype), self.device),
        }

    def draft_level(
        self,
        state: dict[str, jax.Array],
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
        """One level of the self drafter (blocks for its result).

        Args:
            state: from :meth:`draft_start` (its buffers are updated).
            tokens, positions, slots: int ``[F]``: each frontier row's token, position and
                tree slot (padding rows: any token, the scratch slot).
            start: committed tokens in the cache.
            anc: bool ``[F, slots]``: the tree slots each row attends to (ancestors and
                itself).
            mask: int32 ``[F, words]`` grammar rows on this device, or None.
            branch: candidates per row; layers: layers run before the head.

        Returns:
            ``(logp, tokens)``: float64 and int64 ``[F, branch]`` host arrays.
        """
        lp, tok, state["tree_k"], state["tree_v"] = _draft_level(
            self.params,
            self.cache_k,
            self.cache_v,
            state["tree_k"],
            state["tree_v"],
            np.asarray(tokens, np.int32),
            np.asarray(positions, np.int32),
            np.int32(start),
            np.asarray(slots, np.int32),
            np.asarray(anc, bool),
            mask,
            self.config,
            branch,
            layers,
        )
        return np.asarray(lp, np.float64), np.asarray(tok, np.int64)

    def to_host(self, array: Any) -> np.ndarray:
        """Blocking copy of a device array to numpy."""
        return np.asarray(array)

    def close(self) -> None:
        """Stop the watcher thread."""
        self._watcher.shutdown(wait=True)
