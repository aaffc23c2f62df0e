"""The overlap schedule's fused verify (sglang-jax's ``draft_extend_fused``: EAGLE-3 and NEXTN
chains, target forward and verification in one jitted step) with grammar masks.

* The mask is a static-shape input of the jitted step: it rides in the step's logits metadata
  (a :class:`MaskedLogitsMetadata`, ``row_capacity`` = the batch bucket's ``bs * N`` rows, so
  the masked step compiles once per bucket, like sglang-jax's own), and sglang-jax's
  ``LogitsProcessor`` applies it to the target verify logits inside the step, before greedy
  verification or rejection sampling read them.
* The chain of the step is computed on the device by sglang-jax's own functions (the relay
  buffers' gather, the EAGLE-3 id map, the chain arrays) in a small jitted call, staged to the
  host (``GrammarTree.from_linear_chain``) and masked before the step is launched.

The step's grammars must have seen the previous step's tokens by then; sglang-jax's overlap
loop processes them one step late, which :data:`.fixes.RUN_ORDER` puts right.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import portable_spec as ps
from portable_spec.integrations.sglang_jax import internals
from portable_spec.integrations.sglang_jax.internals import logger
from portable_spec.integrations.sglang_jax.masks import active_matcher, slot_grammars
from portable_spec.integrations.sglang_jax.state import STATS

__all__ = [
    "fused_verify_builder",
    "logits_processor",
    "masked_logits_metadata",
    "spec_decode_verify",
]

_local = threading.local()  # .slots: the grammar objects per slot of the running fused verify


@lru_cache(maxsize=1)
def masked_logits_metadata() -> type:
    """``LogitsMetadata`` with a grammar mask among its pytree children (made on first use:
    it subclasses sglang-jax's class)."""
    from jax.tree_util import register_pytree_node_class

    LogitsMetadata = internals.logits_metadata_class()

    @register_pytree_node_class
    class MaskedLogitsMetadata(LogitsMetadata):
        """sglang-jax's logits metadata of a target verify step, and its grammar mask
        (int32 ``[row_capacity, words]``)."""

        grammar_mask: Any = None

        def tree_flatten(self) -> Any:
            children, aux = super().tree_flatten()
            return (*children, self.grammar_mask), aux

        @classmethod
        def tree_unflatten(cls, aux: Any, children: Any) -> Any:
            base = LogitsMetadata.tree_unflatten.__func__(cls, aux, children[:-1])
            base.grammar_mask = children[-1]
            return base

        @classmethod
        def of(cls, metadata: Any, mask: Any) -> Any:
            out = cls.__new__(cls)
            out.__dict__.update(metadata.__dict__)
            out.grammar_mask = mask
            return out

    return MaskedLogitsMetadata


def logits_processor(original: Callable[..., Any]) -> Callable[..., Any]:
    """``LogitsProcessor.__call__``: a verify step whose metadata carries a grammar mask gets
    its logits masked (inside the step's jit: the apply fuses into what reads the logits)."""

    def __call__(self: Any, hidden_states: Any, lm_head: Any, logits_metadata: Any,
                 aux_hidden_states: Any = None) -> Any:  # fmt: skip
        output = original(self, hidden_states, lm_head, logits_metadata, aux_hidden_states)
        mask = getattr(logits_metadata, "grammar_mask", None)
        if mask is not None and logits_metadata.forward_mode.is_target_verify():
            logits = output.next_token_logits
            rows = logits.shape[0]
            width = logits.shape[-1]
            vocab = min(width, 32 * mask.shape[-1])
            output.next_token_logits = ps.apply_vocab_mask(logits, mask[:rows], vocab_size=vocab)
        return output

    return __call__


def spec_decode_verify(original: Callable[..., Any]) -> Callable[..., Any]:
    """``draft_extend_fused.spec_decode_verify``: tells the fused step which grammar each slot
    has (``None`` when no request of the batch has one)."""

    def wrapper(spec_worker: Any, model_worker_batch: Any, *args: Any, **kwargs: Any) -> Any:
        batch = int(model_worker_batch.seq_lens.shape[0])
        slots = slot_grammars(model_worker_batch, batch)
        if slots is not None and all(active_matcher(g) is None for g in slots):
            slots = None
        vocab = int(model_worker_batch.sampling_info.vocab_size)
        _local.slots = None if slots is None else (slots, vocab)
        try:
            return original(spec_worker, model_worker_batch, *args, **kwargs)
        finally:
            _local.slots = None

    return wrapper


def _refused(slot: int, error: Exception) -> None:
    logger.warning(
        "portable_spec: verify slot %d keeps sglang-jax's unmasked verify this step: %s",
        slot,
        error,
    )
    STATS.add("refused_requests")


def _recorded(seconds: float, mask: Any) -> None:
    """One fused verify step's mask: staged and built before the launch."""
    counts = {"fused_steps": 1, "grammar_steps": 1}
    if mask is not None:
        counts.update(masked_steps=1, masked_rows=int(mask.shape[0]))
    STATS.update(counts, {"fused_build_s": seconds})


def fused_verify_builder(
    original: Callable[..., Any],
    refuse: Callable[[int, Exception], None] = _refused,
    record: Callable[[float, Any], None] = _recorded,
) -> Callable[..., Any]:
    """``draft_extend_fused._build_verify``: the built step, masked when the running verify has
    grammar requests (``refuse(slot, error)`` reports a request left unmasked,
    ``record(seconds, mask)`` each mask's staging and build time; by default: a log line and
    the integration's counters)."""

    def _build_verify(topk: int) -> Any:
        step = original(topk)

        def fused_verify(*args: Any, **kwargs: Any) -> Any:
            context = getattr(_local, "slots", None)
            if context is None:
                return step(*args, **kwargs)
            started = time.perf_counter()
            mask = _chain_mask(args, kwargs, context, refuse)
            record(time.perf_counter() - started, mask)
            if mask is None:
                return step(*args, **kwargs)
            args = list(args)
            args[5] = masked_logits_metadata().of(args[5], mask)
            return step(*args, **kwargs)

        return fused_verify

    return _build_verify


_ARGS = (
    "target_model_def",
    "target_model_state_def",
    "target_leaves",
    "target_forward_batch",
    "target_memory_pools",
    "target_logits_metadata",
    "previous_verified_id",
    "previous_token_list",
    "draft_to_target_token_ids",
    "relay_buffers",
    "relay_future_indices",
)


def _chain_mask(
    args: Any, kwargs: dict, context: Any, refuse: Callable[[int, Exception], None]
) -> Any:
    """The grammar mask of the step's chains (``bs * N`` rows), or None."""
    named = dict(zip(_ARGS, args, strict=False))
    slots, vocab = context
    forward_batch = named["target_forward_batch"]
    batch = int(forward_batch.seq_lens.shape[0])
    nodes = int(kwargs["speculative_num_draft_tokens"])
    chains = chain_tokens(
        named["previous_verified_id"],
        named["previous_token_list"],
        named["draft_to_target_token_ids"],
        named["relay_buffers"] if kwargs.get("use_relay_state") else None,
        named["relay_future_indices"] if kwargs.get("use_relay_state") else None,
        forward_batch.seq_lens,
        nodes=nodes,
        dp_size=int(kwargs.get("dp_size", 1)),
        batch=batch,
    )
    matchers = [active_matcher(g) for g in slots]
    tree = ps.GrammarTree.from_linear_chain(chains)
    capacity = batch * nodes
    try:
        return ps.build_grammar_vocab_mask(matchers, tree, vocab, row_capacity=capacity)
    except (ValueError, TypeError, ps.MatcherError) as exc:
        index = getattr(exc, "request_index", None)
        if index is None:
            for b, m in enumerate(matchers):
                if m is not None:
                    refuse(b, exc)
            return None
        refuse(index, exc)
        matchers[index] = None
        if all(m is None for m in matchers):
            return None
        return ps.build_grammar_vocab_mask(matchers, tree, vocab, row_capacity=capacity)


def chain_tokens(
    verified_id: Any,
    token_list: Any,
    draft_to_target: Any,
    relay_buffers: Any,
    future_indices: Any,
    seq_lens: Any,
    *,
    nodes: int,
    dp_size: int,
    batch: int,
) -> Any:
    """int32 ``[batch, nodes]`` on the device: the chains the fused step verifies (node 0 the
    last committed token), computed as the step computes them, by sglang-jax's functions."""
    return _chain_fn(nodes, dp_size, batch, relay_buffers is not None, draft_to_target is not None)(
        verified_id, token_list, draft_to_target, relay_buffers, future_indices, seq_lens
    )


@lru_cache(maxsize=64)
def _chain_fn(nodes: int, dp_size: int, batch: int, relay: bool, mapped: bool) -> Any:
    import jax

    build_chain, map_eagle3_ids, gather_relay = internals.chain_verify_functions()

    def chains(verified_id: Any, token_list: Any, draft_to_target: Any, relay_buffers: Any,
               future_indices: Any, seq_lens: Any) -> Any:  # fmt: skip
        if relay:
            token_list, _, verified_id, _ = gather_relay(
                relay_buffers, future_indices, dp_size=dp_size
            )
        if mapped:
            token_list = map_eagle3_ids(token_list, draft_to_target)
        draft, *_ = build_chain(
            verified_id=verified_id,
            token_list=token_list,
            seq_lens=seq_lens,
            num_verify_tokens=nodes,
            batch_size=batch,
        )
        return draft.reshape(batch, nodes)

    return jax.jit(chains)
