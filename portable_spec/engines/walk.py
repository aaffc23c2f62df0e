"""The iterative depth-first walk shared by every engine walked from Python.

One loop serves protocol matchers, llguidance trees and outlines-core guides; each engine
supplies a :class:`Steps` object that knows how to fill a row, take a token and step back. The
loop owns the row contract of :func:`portable_spec.build_host_bitmask` (node 0 is accepted; a
node is accepted when its parent is live, its token lies in ``[0, vocab)`` and the parent's row
allows it), the rollback bookkeeping and the node counts; it has no recursion, so chains of any
depth work, and it leaves the matcher where it started, also when a step raises.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["ENDED_FREE", "ENDED_HELD", "LIVE", "REFUSED", "Steps", "walk_tree"]

#: outcomes of :meth:`Steps.advance`
REFUSED = 0  # the matcher does not take the token (nothing held)
LIVE = 1  # taken; the node is live (its row is filled next)
ENDED_HELD = 2  # taken, and it ended the grammar; the matcher holds it (rolled back later)
ENDED_FREE = 3  # an end token the matcher takes without holding anything (nothing to undo)


class Steps(Protocol):
    """One matcher's moves, as the walk needs them."""

    def start(self) -> bool:
        """Whether the matcher is live at the root (False: terminated, nothing is written)."""
        ...

    def fill(self, node: int) -> None:
        """Write the current state's row into row ``node``."""
        ...

    def advance(self, token: int, parent: int, node: int) -> int:
        """Take ``token`` (the parent's row allows it) at ``node``: one of the outcomes."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` tokens held."""
        ...


def walk_tree(
    steps: Steps,
    next_token: list[int],
    next_sibling: list[int],
    draft: list[int],
    rows: np.ndarray,
    vocab_limit: int,
) -> tuple[list[bool], int, int]:
    """Fill ``rows`` for one request by an iterative depth-first walk.

    Args:
        steps: the matcher's moves (:class:`Steps`).
        next_token, next_sibling, draft: this request's links and tokens (validated).
        rows: C-contiguous int32 ``[nodes, words]`` the steps fill.
        vocab_limit: tokens at or above this are rejected without asking the matcher.

    Returns:
        ``(filled, checked, rejected)``: ``filled[j]`` says whether row ``j`` was written
        (node accepted and not terminated; other rows are left untouched); ``checked`` counts
        the draft nodes whose token was tested against the grammar (children of filled
        nodes) and ``rejected`` those the grammar refused. The matcher is rolled back to
        where it started, also when a step raises (the exception propagates).
    """
    nodes = len(next_token)
    filled = [False] * nodes
    if not steps.start():
        return filled, 0, 0
    steps.fill(0)
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
    checked, rejected = len(stack), 0
    held = 0  # tokens the matcher holds beyond its starting state
    advance, fill = steps.advance, steps.fill
    try:
        while stack:
            node, parent, depth = stack.pop()
            token = draft[node]
            if not 0 <= token < vocab_limit or not (
                (int(rows[parent, token >> 5]) >> (token & 31)) & 1
            ):
                rejected += 1
                continue
            if held >= depth:  # leave the previous sibling's subtree
                steps.rollback(held - depth + 1)
                held = depth - 1
            outcome = advance(token, parent, node)
            if outcome == REFUSED:  # the matcher disagrees with its own mask
                rejected += 1
                continue
            if outcome != ENDED_FREE:
                held = depth
            if outcome != LIVE:
                continue  # terminated: its row stays all-allowed, nothing below is walked
            fill(node)
            filled[node] = True
            kids = children(node)
            checked += len(kids)
            stack.extend((c, node, depth + 1) for c in reversed(kids))
    finally:
        if held:
            steps.rollback(held)
    return filled, checked, rejected
