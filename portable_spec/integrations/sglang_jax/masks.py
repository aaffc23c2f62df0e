"""The verify mask of one sglang-jax speculative step: which request has which grammar, the
staged tree and the build running while the target forward does, and the per-request
fallback.

sglang-jax's verify layout is the library's: per request ``retrive_next_token`` and
``retrive_next_sibling`` ``[bs, N]`` (local node indices, -1 for none), ``draft_token``
``[bs * N]`` (node 0: the last committed token) and logits row ``b * N + i`` for node ``i``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec.integrations.sglang_jax.internals import logger

__all__ = [
    "MaskJob",
    "active_matcher",
    "apply_mask",
    "slot_grammars",
    "start_mask",
]

# Set on one verify step's EagleVerifyInput (a dataclass without __slots__) by the patched
# BaseSpecWorker.verify; the patched sample takes it from there.
JOB_ATTR = "_portable_spec_mask_job"


def active_matcher(grammar: Any) -> Any:
    """The ``llguidance.LLMatcher`` of a request's sglang-jax grammar object if the request is
    constrained this step, else ``None`` (no grammar, finished, or not an llguidance grammar)."""
    if grammar is None or getattr(grammar, "finished", False):
        return None
    matcher = getattr(grammar, "ll_matcher", None)
    if matcher is None:
        return None
    try:
        if grammar.is_terminated():
            return None
    except Exception:  # a grammar object that cannot say: leave the request alone
        return None
    return matcher


def slot_grammars(model_worker_batch: Any, batch: int) -> list[Any] | None:
    """Per verify slot ``0 .. batch - 1``, the request's sglang-jax grammar object (``None``
    for padding slots and requests without one); ``None`` when no request has a grammar.

    ``sampling_info.grammars`` lists the real requests in their original order;
    ``logits_indices_selector`` maps that order to the (padded, DP-interleaved) slots.
    """
    info = getattr(model_worker_batch, "sampling_info", None)
    grammars = getattr(info, "grammars", None) if info is not None else None
    if not grammars or all(g is None for g in grammars):
        return None
    selector = getattr(model_worker_batch, "logits_indices_selector", None)
    slots: list[Any] = [None] * batch
    for k, grammar in enumerate(grammars):
        slot = k if selector is None or k >= len(selector) else int(selector[k])
        if 0 <= slot < batch:
            slots[slot] = grammar
    return slots


@dataclass
class MaskJob:
    """One verify step's mask, built while the target forward runs.

    ``pending`` is the library's :class:`portable_spec.PendingMask` (or ``None`` when the
    start itself was refused); ``finish`` returns the device mask or ``None`` (no request kept
    a grammar)."""

    grammars: list[Any]  # per slot: the LLMatcher, or None
    tree: Any  # the staged GrammarTree
    vocab_size: int
    pending: Any
    started: float
    refused: set[int] = field(default_factory=set)
    finished_at: float = 0.0
    waited: float = 0.0

    def finish(self) -> Any:
        """Wait for the build (blocks only if it is still running); on a build the library
        refuses, rebuild without the requests at fault (their rows stay all-allowed, one log
        line each) and return that mask. Never raises for bad grammars or trees."""
        t0 = time.perf_counter()
        mask = None
        try:
            if self.pending is None:
                raise _Refused
            mask = self.pending.result()
        except (_Refused, ValueError, TypeError, ps.MatcherError) as exc:
            mask = self._rebuild(exc)
        t1 = time.perf_counter()
        self.waited = t1 - t0
        self.finished_at = t1
        return mask

    def _rebuild(self, exc: BaseException) -> Any:
        """The mask without the requests the library refuses, found one by one on their own
        host tree (a refused check moves no matcher). Requests left out get no links, so
        that their tree cannot fail the batch's checks again."""
        next_token, next_sibling, draft = self.tree.resolve()
        reasons: dict[int, Any] = {}
        if isinstance(exc, ps.MatcherError):
            reasons[exc.request_index] = exc.error
        for b, matcher in enumerate(self.grammars):
            if matcher is None or b in reasons:
                continue
            one = ps.GrammarTree.from_host(
                next_token[b : b + 1], next_sibling[b : b + 1], draft[b : b + 1]
            )
            try:
                ps.build_host_bitmask([matcher], one, self.vocab_size)
            except (ValueError, TypeError, ps.MatcherError) as err:
                reasons[b] = err
        for b, reason in sorted(reasons.items()):
            logger.warning(
                "portable_spec: verify slot %d keeps sglang-jax's unmasked verify this step: %s",
                b,
                reason,
            )
        self.refused |= set(reasons)
        kept = [None if b in reasons else m for b, m in enumerate(self.grammars)]
        if all(m is None for m in kept):
            return None
        free = [b for b, m in enumerate(kept) if m is None]
        next_token, next_sibling = next_token.copy(), next_sibling.copy()
        next_token[free] = -1
        next_sibling[free] = -1
        tree = ps.GrammarTree.from_host(next_token, next_sibling, draft)
        host = ps.build_host_bitmask(kept, tree, self.vocab_size)
        if host is None:
            return None
        return _upload_like(host, self.tree)


class _Refused(Exception):
    """The build could not even be started (its checks refused the call)."""


def _upload_like(host: np.ndarray, tree: Any) -> Any:
    """Upload a host mask to where the tree's mask would go (JAX: the tree's placement)."""
    backend = tree.backend
    if backend.name == "numpy":
        return host
    import jax

    return jax.device_put(np.array(host, copy=True), tree.device)


def start_mask(
    retrive_next_token: Any,
    retrive_next_sibling: Any,
    draft_token: Any,
    slots: Sequence[Any],
    vocab_size: int,
) -> MaskJob | None:
    """Stage the verify tree to the host and start its mask build in the background.

    Args:
        retrive_next_token, retrive_next_sibling: ``[bs, N]`` device (or host) arrays.
        draft_token: ``[bs * N]`` (or ``[bs, N]``) draft tokens, node 0 the last committed one.
        slots: per slot, the request's sglang-jax grammar object or ``None``.
        vocab_size: the model's vocabulary size (the verify logits' width).

    Returns ``None`` when no slot has an active grammar. Never blocks: the device-to-host copy
    of the tree is started (``copy_to_host_async``) and the build waits for it on the
    library's background thread, while the caller launches the target forward.
    """
    matchers = [active_matcher(g) for g in slots]
    if all(m is None for m in matchers):
        return None
    batch, nodes = retrive_next_token.shape
    tree = ps.GrammarTree.from_device(
        retrive_next_token, retrive_next_sibling, draft_token.reshape(batch, nodes)
    )
    started = time.perf_counter()
    try:
        pending = ps.build_grammar_vocab_mask(matchers, tree, vocab_size, wait=False)
    except (ValueError, TypeError):
        pending = None
    return MaskJob(matchers, tree, vocab_size, pending, started)


def apply_mask(logits: Any, mask: Any, vocab_size: int) -> Any:
    """``logits`` ``[rows, V]`` with the disallowed tokens at ``-inf``; columns at or past
    ``vocab_size`` (padding of the logits) too."""
    if mask is None:
        return logits
    width = logits.shape[-1]
    if width > vocab_size:
        return ps.apply_vocab_mask(logits, mask, vocab_size=vocab_size)
    return ps.apply_vocab_mask(logits, mask)
