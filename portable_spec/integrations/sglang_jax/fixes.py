"""sglang-jax's own bugs that grammar-constrained speculative decoding runs into, worked around
one by one: each :class:`Patch` here carries, in ``fixes``, the heading of its entry in
``docs/sglang-jax-upstream.md``, which names the patch back. None of them adds a mask.

When sglang-jax fixes one, the entry of that revision in :mod:`.internals` drops the fix's
target (or names its bug in ``fixed`` where the mask work patches the same function), and
that patch alone is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from portable_spec.integrations.patching import Patch
from portable_spec.integrations.sglang_jax import internals
from portable_spec.integrations.sglang_jax.grammar import (
    accept_tokens,
    own_grammar_objects,
    truncate_at_grammar_end,
)
from portable_spec.integrations.sglang_jax.masks import active_matcher
from portable_spec.integrations.sglang_jax.state import STATS

__all__ = [
    "FIXES",
    "LIST_ACCEPT",
    "LIST_END",
    "OWN_GRAMMARS",
    "ROW_DEFAULTS",
    "RUN_ORDER",
    "TREE_PATH",
    "commit_accepted",
]

# The headings of docs/sglang-jax-upstream.md.
ACCEPT_LIST_BUG = "The scheduler gives accept_token a list"
TREE_BUG = "Trees commit predict's first slots"
ROWS_BUG = "The non-speculative mask leaves rows zero or stale"
ORDER_BUG = "The overlap loop runs a step before the grammars see the last one"
SHARED_BUG = "Requests with one grammar share one grammar object"


# -- accept_token(list) ------------------------------------------------------------------------
def _accept_list(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GuidanceGrammar.accept_token``: a list advances the matcher token by token, as far as
    verify accepted and no further than the grammar's end; an int is sglang-jax's own call."""

    def accept_token(self: Any, token: Any) -> Any:
        if isinstance(token, (list, tuple, np.ndarray)):
            return accept_tokens(self, token, original)
        return original(self, token)

    return accept_token


def _end_at_grammar_end(original: Callable[..., Any]) -> Callable[..., Any]:
    """``resolve_spec_decode_token_ids``: a request whose grammar ends inside the step's
    accepted tokens (its end token) commits them up to that token and finishes there."""

    def resolve_spec_decode_token_ids(result: Any, batch: Any, draft_token_num: int) -> Any:
        tokens, accept_lens = original(result, batch, draft_token_num)
        per_dp = batch.per_dp_bs_size
        reqs = [
            (dp_rank * per_dp + j, req)
            for dp_rank, info in enumerate(batch.reqs_info)
            for j, req in enumerate(info.reqs or [])
            if not req.finished()
        ]
        cut = truncate_at_grammar_end(reqs, tokens, accept_lens, _finish_request)
        if cut:
            STATS.add("grammar_ends", cut)
        return tokens, accept_lens

    return resolve_spec_decode_token_ids


def _finish_request(req: Any, token: int) -> None:
    """Finish ``req`` on ``token`` (its grammar's end) when the scheduler next checks it."""
    if req.finished() or getattr(req, "to_finish", None) is not None:
        return
    req.to_finish = internals.finish_on_token(token)


# -- a tree's accepted path --------------------------------------------------------------------
def commit_accepted(
    predict: Any, accept_index: Any, accept_length: Any, nodes: int, width: int
) -> np.ndarray:
    """``predict`` rewritten so that request ``b``'s committed tokens are its first
    ``accept_length[b]`` entries from ``b * nodes``, in path order.

    sglang-jax's verify writes each accepted node's next token at that node's row
    (``predict[accept_index[b, j]]``) and its scheduler commits ``predict[b * N : b * N + a]``:
    the same for chains, but for trees the accepted nodes are not the first ``a`` nodes.
    Host numpy in and out (``predict`` ``[bs * N (+1)]``, ``accept_index`` ``[bs * width]``,
    ``accept_length`` ``[bs]``).
    """
    predict = np.asarray(predict)
    index = np.asarray(accept_index).reshape(-1, width)
    length = np.asarray(accept_length).reshape(-1)
    out = predict.copy()
    batch = min(len(length), index.shape[0])
    taken = np.arange(width)[None, :] < np.minimum(length[:batch], width)[:, None]
    source = index[:batch]
    valid = taken & (source >= 0) & (source < len(predict))
    rows, cols = np.nonzero(valid)
    target = rows * nodes + cols
    keep = target < len(out)
    out[target[keep]] = predict[source[rows[keep], cols[keep]]]
    return out


def _commit_path(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EagleVerifyInput.sample``: ``predict`` holds each request's accepted path first."""

    def sample(self: Any, model_worker_batch: Any, logits_output: Any, rng: Any, mesh: Any) -> Any:
        predict, verified_id, accept_length, accept_index = original(
            self, model_worker_batch, logits_output, rng, mesh
        )
        predict = commit_accepted(
            predict, accept_index, accept_length, self.draft_token_num, self.spec_steps + 1
        )
        return predict, verified_id, accept_length, accept_index

    return sample


# -- the non-speculative batch mask ------------------------------------------------------------
def _row_defaults(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ModelWorkerSamplingInfo.update_grammar_vocab_mask``: rows of requests without an
    active grammar all-allowed, in a mask of the batch's own."""

    def update_grammar_vocab_mask(self: Any) -> Any:
        result = original(self)
        mask = getattr(self, "vocab_mask", None)
        if mask is not None and self.grammars:
            # a private copy: sglang-jax refills one buffer per grammar object for every batch,
            # and on JAX's CPU backend the previous batch's device mask may alias it
            mask = np.array(mask, copy=True)
            free = np.ones(len(mask), dtype=bool)
            for i, grammar in enumerate(self.grammars[: len(mask)]):
                if grammar and not grammar.finished and not grammar.is_terminated():
                    free[i] = False
            mask[free] = -1  # rows sglang-jax leaves zero (or stale): nothing was allowed
            self.vocab_mask = mask
        return result

    return update_grammar_vocab_mask


# -- the overlap loop's order ------------------------------------------------------------------
def _run_in_order(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scheduler.run_batch``: in the overlap loop, a speculative decode batch with a grammar
    request first has the previous batch's result processed, so that its grammars have
    accepted that batch's tokens before this batch's mask is built; a no-op entry takes the
    processed result's place in the loop's queue."""

    def run_batch(self: Any, batch: Any) -> Any:
        queue = getattr(self, "result_queue", None)
        if (
            getattr(self, "enable_overlap", False)
            and queue
            and self.spec_algorithm is not None
            and not self.spec_algorithm.is_none()
            and batch.forward_mode.is_decode()
            and _has_grammar(batch)
        ):
            done_batch, done_result = queue.popleft()
            done_batch.next_batch_sampling_info = None
            self.process_batch_result(done_batch, done_result, None)
            done_batch.forward_mode = internals.dummy_first_mode()  # the loop's pop: a no-op entry
            queue.appendleft((done_batch, None))
        return original(self, batch)

    return run_batch


def _has_grammar(batch: Any) -> bool:
    """Whether a request of an sglang-jax ``ScheduleBatch`` has an active grammar."""
    return any(
        active_matcher(getattr(req, "grammar", None)) is not None
        for info in batch.reqs_info
        for req in info.reqs or []
    )


# -- grammar objects of their own --------------------------------------------------------------
def _own_grammars(original: Callable[..., Any]) -> Callable[..., Any]:
    """``BaseGrammarBackend.get_cached_or_future_value``: every request a grammar object of its
    own (a copy of a cache hit, a copy of a compile's result for a request that waited)."""
    return own_grammar_objects(original, internals.invalid_grammar_object())


LIST_ACCEPT = Patch(internals.ACCEPT, _accept_list, fixes=ACCEPT_LIST_BUG)
LIST_END = Patch(internals.RESOLVE, _end_at_grammar_end, fixes=ACCEPT_LIST_BUG)
TREE_PATH = Patch(internals.SAMPLE, _commit_path, fixes=TREE_BUG)
ROW_DEFAULTS = Patch(internals.BATCH_MASK, _row_defaults, fixes=ROWS_BUG)
RUN_ORDER = Patch(internals.RUN_BATCH, _run_in_order, fixes=ORDER_BUG)
OWN_GRAMMARS = Patch(internals.GRAMMAR_CACHE, _own_grammars, fixes=SHARED_BUG)

#: Every fix, in the order of docs/sglang-jax-upstream.md (installed before the mask patches:
#: on a function both patch, the mask work wraps sglang-jax's function as fixed).
FIXES: tuple[Patch, ...] = (LIST_ACCEPT, LIST_END, TREE_PATH, ROW_DEFAULTS, RUN_ORDER, OWN_GRAMMARS)
