"""Per-request tree walks: xgrammar's C++ traversal, and an iterative walk for other matchers.

Both follow the same rule (the row contract of :func:`portable_spec.build_host_bitmask`):
node 0 is accepted; a node is accepted when its parent is accepted and not terminated, its
token lies in ``[0, vocab)`` and the token's bit is set in the parent's row; an accepted,
non-terminated node's row is the matcher's mask after the root path. Both leave the matcher
in the state it started in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["walk_generic", "walk_xgrammar"]


def walk_xgrammar(
    matcher: Any,
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    rows: np.ndarray,
) -> bool:
    """Fill ``rows`` for one request with ``GrammarMatcher.traverse_draft_tree``.

    Args:
        next_token, next_sibling, draft: this request's C-contiguous int64 ``[nodes]`` rows.
        rows: C-contiguous int32 ``[nodes, words]`` with exactly the matcher's width.

    Returns:
        False when the matcher was terminated before the walk (nothing written), else True.
        xgrammar writes the rows of accepted, non-terminated nodes; it zeroes rows of rejected
        and terminated nodes and leaves rows it never reaches untouched. The caller rewrites
        every row that is not an accepted, non-terminated node's (see ``builder``).
    """
    if matcher.is_terminated():
        return False
    matcher.traverse_draft_tree(next_token, next_sibling, draft, rows)
    return True


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
