"""Matchers following :class:`portable_spec.GrammarMatcherLike`: an iterative Python walk.

The walk follows the row contract of :func:`portable_spec.build_host_bitmask`: node 0 is
accepted; a node is accepted when its parent is accepted and not terminated, its token lies in
``[0, vocab)`` and the token's bit is set in the parent's row; an accepted, non-terminated
node's row is the matcher's mask after the root path. It leaves the matcher in the state it
started in, and has no recursion (chains of any depth work).
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

import numpy as np

from portable_spec.engines.base import MatcherInfo

__all__ = ["generic_info", "walk_generic"]


def walk_generic(
    matcher: Any,
    next_token: list[int],
    next_sibling: list[int],
    draft: list[int],
    rows: np.ndarray,
    vocab_limit: int,
) -> tuple[list[bool], int, int]:
    """Fill ``rows`` for one request by an iterative depth-first walk.

    Args:
        matcher: an object following :class:`portable_spec.grammars.GrammarMatcherLike`.
        next_token, next_sibling, draft: this request's links and tokens (validated).
        rows: C-contiguous int32 ``[nodes, words]`` passed to ``fill_next_token_bitmask``.
        vocab_limit: tokens at or above this are rejected without asking the matcher.

    Returns:
        ``(filled, checked, rejected)``: ``filled[j]`` says whether row ``j`` was written
        (node accepted and not terminated; other rows are left untouched); ``checked`` counts
        the draft nodes whose token was tested against the grammar (children of filled
        nodes) and ``rejected`` those the grammar refused. The matcher is rolled back to
        where it started, also when one of its methods raises (the exception propagates).
    """
    nodes = len(next_token)
    filled = [False] * nodes
    if matcher.is_terminated():
        return filled, 0, 0
    matcher.fill_next_token_bitmask(rows, 0)
    filled[0] = True

    def children(v: int) -> list[int]:
        kids = []
        c = next_token[v]
        while c != -1:
            kids.append(c)
            c = next_sibling[c]
        return kids

    # (node, parent, depth); the first child ends up on top, so siblings run in order
    stack = [(c, 0, 1) for c in reversed(children(0))]
    accepted = 0  # tokens the matcher holds beyond its starting state
    checked, rejected = len(stack), 0
    try:
        while stack:
            node, parent, depth = stack.pop()
            token = draft[node]
            if not 0 <= token < vocab_limit:
                rejected += 1
                continue
            if not (int(rows[parent, token >> 5]) >> (token & 31)) & 1:
                rejected += 1
                continue
            if accepted >= depth:  # leave the previous sibling's subtree
                matcher.rollback(accepted - depth + 1)
                accepted = depth - 1
            if not matcher.accept_token(token):
                rejected += 1
                continue  # the matcher disagrees with its own mask: treat as rejected
            accepted = depth
            if matcher.is_terminated():
                continue
            matcher.fill_next_token_bitmask(rows, node)
            filled[node] = True
            kids = children(node)
            checked += len(kids)
            stack.extend((c, node, depth + 1) for c in reversed(kids))
    finally:
        if accepted:
            matcher.rollback(accepted)
    return filled, checked, rejected


def generic_info(matcher: Any, index: int, vocab_size: int) -> MatcherInfo:
    """The width of a protocol matcher: its optional ``vocab_size`` attribute, else the
    model's. Raises ``TypeError``/``ValueError`` naming ``grammars[index]``."""
    own = getattr(matcher, "vocab_size", None)
    if own is None:
        return MatcherInfo((vocab_size + 31) // 32, vocab_size)
    if isinstance(own, bool) or not isinstance(own, Integral) or own <= 0:
        raise TypeError(f"grammars[{index}].vocab_size must be a positive int, got {own!r}")
    own = int(own)
    if own > vocab_size:
        raise ValueError(
            f"vocab_size = {vocab_size} is smaller than the vocabulary of grammars[{index}] "
            f"({own} tokens)"
        )
    return MatcherInfo((own + 31) // 32, own)
