"""Grammar-aware drafting in sglang-jax's EAGLE draft loop, through
:class:`portable_spec.DraftSession`.

sglang-jax's ``EagleDraftWorker.draft_forward`` grows the draft tree level by level: the
root's top-k (computed by the previous step's draft extend, ``topk_probs_from_logits`` over
the draft head's logits), then per step ``select_top_k_tokens`` picks the level's nodes, the
draft head runs on them and ``topk_probs_from_logits`` gives their children. Here, for the
batch's requests with a grammar:

* the root's top-k is taken again from the same draft logits (kept when the draft extend
  computed them, per request) masked with the grammar's row after the committed tokens;
* each level's nodes are added to a ``DraftSession`` as ``select_top_k_tokens`` picks them,
  and their rows mask the draft head's logits before ``topk_probs_from_logits``.

So the drafts are tokens the grammar allows (a level whose nodes allow fewer than top-k tokens
still fills its slots, with ``-inf`` scores). sglang-jax's own functions do all the rest; this
module wraps ``topk_probs_from_logits`` and ``select_top_k_tokens`` of its draft worker module
and its ``draft_forward``, ``draft_extend_for_decode`` and ``draft_extend_for_prefill``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec.integrations.sglang_jax import internals
from portable_spec.integrations.sglang_jax.masks import active_matcher, slot_grammars
from portable_spec.integrations.sglang_jax.state import LOG

__all__ = ["DraftContext", "wrap_draft_forward", "wrap_extend", "wrap_select", "wrap_topk"]

_local = threading.local()  # .draft: the DraftContext of the running draft_forward; .capture


@dataclass
class DraftContext:
    """One ``draft_forward`` call's grammar state."""

    session: Any
    topk: int
    steps: int
    level_first: int = 0  # session id of the previous level's first node
    pending: Any = None  # rows for the next topk_probs_from_logits call
    constrained: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


# Root logits kept per request (its req_to_token pool index): (device array, row).
_roots: dict[int, tuple[Any, int]] = {}
_roots_lock = threading.Lock()


def wrap_topk(original: Callable[..., Any]) -> Callable[..., Any]:
    """``topk_probs_from_logits``: masked by the running draft's pending rows; while a draft
    extend runs, its logits are kept as the next step's root logits."""

    def topk_probs_from_logits(logits: Any, topk: int) -> Any:
        capture = getattr(_local, "capture", None)
        if capture is not None:
            capture.append(logits)
        context = getattr(_local, "draft", None)
        if context is not None and context.pending is not None:
            rows, context.pending = context.pending, None
            logits = ps.apply_vocab_mask(logits, rows)
        return original(logits, topk)

    return topk_probs_from_logits


def wrap_select(original: Callable[..., Any]) -> Callable[..., Any]:
    """``select_top_k_tokens``: the level's picked nodes join the running draft's session; their
    rows become the mask of the draft head's next logits."""

    def select_top_k_tokens(i: int, topk_p: Any, topk_index: Any, hidden_states: Any,
                            scores: Any, topk: int) -> Any:  # fmt: skip
        out = original(i, topk_p, topk_index, hidden_states, scores, topk)
        context = getattr(_local, "draft", None)
        if context is None or i >= context.steps - 1:
            return out
        input_ids, _, _, tree_info = out
        batch = context.session.batch
        tokens = np.asarray(input_ids).reshape(batch, topk)
        if i == 0:
            parents = np.zeros((batch, topk), dtype=np.int64)
        else:
            picked = np.asarray(tree_info[2]).reshape(batch, topk) - (topk * topk * (i - 1) + topk)
            parents = context.level_first + picked // topk
        context.level_first = context.session.nodes
        context.pending = context.session.extend(parents, tokens)
        return out

    return select_top_k_tokens


def wrap_extend(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """``draft_extend_for_decode`` / ``draft_extend_for_prefill``: keep the draft logits their
    top-k came from, per request, for the next draft step's root."""

    def draft_extend(self: Any, model_worker_batch: Any, *args: Any) -> Any:
        if not _active(model_worker_batch):
            return original(self, model_worker_batch, *args)
        captured: list[Any] = []
        _local.capture = captured
        try:
            result = original(self, model_worker_batch, *args)
        finally:
            _local.capture = None
        if captured:
            _keep_roots(model_worker_batch, captured[-1])
        return result

    draft_extend.__name__ = kind
    return draft_extend


def _active(model_worker_batch: Any) -> bool:
    info = getattr(model_worker_batch, "sampling_info", None)
    grammars = getattr(info, "grammars", None) if info is not None else None
    return bool(grammars) and any(active_matcher(g) is not None for g in grammars)


def _keep_roots(model_worker_batch: Any, logits: Any) -> None:
    selector = getattr(model_worker_batch, "logits_indices_selector", None)
    pools = np.asarray(model_worker_batch.req_pool_indices)
    rows = np.arange(len(pools)) if selector is None else np.asarray(selector)
    with _roots_lock:
        for row in rows.tolist():
            if 0 <= row < len(pools) and row < logits.shape[0] and pools[row] >= 0:
                _roots[int(pools[row])] = (logits, int(row))


def wrap_draft_forward(
    original: Callable[..., Any], enabled: Callable[[], bool]
) -> Callable[..., Any]:
    """``EagleDraftWorker.draft_forward`` under a ``DraftSession`` of the batch's grammars."""

    def draft_forward(self: Any, model_worker_batch: Any) -> Any:
        context = _open(self, model_worker_batch) if enabled() else None
        if context is None:
            return original(self, model_worker_batch)
        _local.draft = context
        try:
            return original(self, model_worker_batch)
        finally:
            _local.draft = None
            context.session.close()

    return draft_forward


def _open(worker: Any, model_worker_batch: Any) -> DraftContext | None:
    """The draft's session, with the root's top-k taken again from masked logits; ``None``
    when no request has a grammar or the draft is not a level-by-level one. Never raises: a
    failure leaves sglang-jax's own drafts (one log line)."""
    spec = model_worker_batch.spec_info_padded
    topk_index = getattr(spec, "topk_index", None)
    if topk_index is None or worker._has_precomputed_recurrent_chain(topk_index):
        return None
    batch = int(model_worker_batch.seq_lens.shape[0])
    slots = slot_grammars(model_worker_batch, batch)
    if slots is None:
        return None
    matchers = [active_matcher(g) for g in slots]
    if all(m is None for m in matchers):
        return None
    try:
        return _start(worker, model_worker_batch, matchers)
    except Exception as exc:
        LOG.warning(
            f"draft:{type(exc).__name__}",
            "portable_spec: drafting without grammar masks (this step and any other failing "
            "so): %s",
            exc,
        )
        return None


def _start(worker: Any, model_worker_batch: Any, matchers: list[Any]) -> DraftContext:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = model_worker_batch.spec_info_padded
    vocab = int(model_worker_batch.sampling_info.vocab_size)
    hot = worker.hot_token_ids
    d2t = None if hot is None else np.asarray(jax.device_get(hot)).astype(np.int64)
    device = NamedSharding(worker.mesh, P()) if worker.mesh is not None else None
    session = ps.DraftSession(matchers, vocab, device=device, d2t=d2t)
    topk, steps = int(worker.topk), int(worker.speculative_num_steps)
    context = DraftContext(session, topk, steps)
    try:
        _mask_root(worker, model_worker_batch, spec, session, matchers, jnp)
    except BaseException:
        session.close()
        raise
    return context


def _mask_root(worker: Any, batch: Any, spec: Any, session: Any, matchers: list, jnp: Any) -> None:
    """The root's top-k from the kept draft logits masked with the root rows (requests whose
    logits were kept and that have a grammar; the others keep sglang-jax's top-k)."""
    pools = np.asarray(batch.req_pool_indices)
    with _roots_lock:
        kept = {
            b: _roots.get(int(p)) for b, p in enumerate(pools.tolist()) if matchers[b] is not None
        }
    kept = {b: v for b, v in kept.items() if v is not None}
    if not kept:
        return
    order = sorted(kept)
    rows = [jnp.take(kept[b][0], jnp.asarray([kept[b][1]]), axis=0) for b in order]
    logits = jnp.concatenate(rows, axis=0)
    mask = session.root_mask()  # [batch, words] in the draft vocabulary
    picked = jnp.asarray(np.asarray(order))
    masked = ps.apply_vocab_mask(logits, jnp.take(mask, picked, axis=0))
    probs, index = internals.topk_probs_from_logits()(masked, worker.topk)
    if worker.hot_token_ids is not None:
        index = worker._map_hot_token_ids(index)
    topk_p = jnp.asarray(spec.topk_p).at[picked].set(probs.astype(jnp.asarray(spec.topk_p).dtype))
    topk_index = jnp.asarray(spec.topk_index).at[picked].set(index.astype(jnp.int32))
    spec.topk_p, spec.topk_index = topk_p, topk_index
