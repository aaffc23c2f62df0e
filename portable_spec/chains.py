"""Chain engines' masks straight from their per-request draft lists.

A chain engine (vLLM, MTP, EAGLE's chain mode) holds each request's drafts as a Python list.
:func:`build_chain_bitmask` takes those lists as they are: no padded array, no tree object.
It is the first row of the builder's route table (:mod:`portable_spec.builder.routes`): when
every grammar is an xgrammar matcher the compiled helper can call (the common case), the lists
are read by one compiled call that also writes the rows no grammar walks (unconstrained
requests, padding, the free rows of a request still reasoning), and the chains are walked and
repaired (xgrammar's C++ traversal, GIL released; big batches in parts on the library's pool).
Anything else goes on down the table over the equivalent :class:`~portable_spec.GrammarTree`
(:func:`chain_tree`), with the same rows, the same checks and the same errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portable_spec.builder import routes
from portable_spec.builder.lists import chain_tree
from portable_spec.builder.reasoning import Reasoning

__all__ = ["build_chain_bitmask", "chain_tree"]


def build_chain_bitmask(
    matchers: Sequence[Any],
    drafts: Sequence[Sequence[int]],
    vocab_size: int,
    *,
    rows_per_request: int | None = None,
    out: Any = None,
    reasoning: Reasoning | None = None,
    return_valid: bool = False,
) -> Any:
    """The grammar bitmask of a batch of draft chains, from the engine's per-request lists.

    Request ``b``'s chain is its root (the state after its committed tokens) followed by
    ``drafts[b]``: ``1 + len(drafts[b])`` nodes, one mask row each. The rows are exactly those
    of :func:`portable_spec.build_host_bitmask` over :func:`chain_tree` of the same drafts
    (same row contract, same ``reasoning`` rule, same valid flags, same errors).

    Args:
        matchers: one entry per request, as for :func:`portable_spec.build_host_bitmask`
            (``None``, an ``xgrammar.GrammarMatcher`` or a
            :class:`portable_spec.GrammarMatcherLike`), each in the state after the request's
            committed tokens.
        drafts: ``[batch]`` sequences of int token ids (lists, tuples or 1-D integer arrays;
            or one 2-D integer array ``[batch, K]``). A draft outside ``[0, vocab_size)`` is
            refused like any draft the grammar refuses.
        vocab_size: the model's vocabulary size (the logits' width), at most
            :data:`portable_spec.MAX_VOCAB_SIZE`.
        rows_per_request: ``None`` (packed: request ``b``'s rows follow request ``b - 1``'s,
            ``1 + len(drafts[b])`` each, no padding) or ``R``: request ``b``'s rows are
            ``b * R`` to ``b * R + R - 1``, its chain first, then all-allowed rows that no
            draft reaches (as ``-1`` padding in :meth:`GrammarTree.from_linear_chain`); every
            request needs ``len(drafts[b]) < R``.
        out: optional C-contiguous writable int32 ``[rows, ceil(vocab_size / 32)]`` numpy
            buffer to write into (``rows``: ``batch * R``, or the sum of the chains' lengths).
        reasoning: an optional :class:`portable_spec.Reasoning` (requests still reasoning get
            their grammar only after the end token).
        return_valid: also return which nodes are accepted.

    Returns:
        The int32 ``[rows, ceil(vocab_size / 32)]`` mask (``out`` itself when given); with
        ``return_valid``, ``(mask, valid)``: ``valid`` bool ``[batch, R]`` (strided) or
        ``[rows]`` (packed). ``None`` (or ``(None, valid)``) when no request has a grammar.

    Raises:
        TypeError, ValueError: malformed drafts (naming the request), matchers,
            ``vocab_size``, ``out`` or ``reasoning``; raised before any matcher moves.
        MatcherError: a matcher failed during its walk (``request_index`` names it); every
            matcher is back in its state.

    Blocks until the mask is written; every matcher ends in the state it started in.
    """
    return routes.build_chains(
        matchers, drafts, vocab_size, rows_per_request, out, reasoning, return_valid
    )
