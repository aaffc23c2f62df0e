"""The iterative depth-first walk shared by every engine walked from Python.

One loop serves protocol matchers, llguidance trees and outlines-core guides; each engine
supplies a :class:`Steps` object that knows how to fill a row, take a token and step back. The
loop owns the row contract of :func:`portable_spec.build_host_bitmask` (node 0 is accepted; a
node is accepted when its parent is live, its token lies in ``[0, vocab)`` and the parent's row
allows it), the rollback bookkeeping and the node counts; it has no recursion, so chains of any
depth work, and it leaves the matcher where it started, also when a step raises.

:class:`ReplayStates` is the same idea for a draft tree that grows level by level: the draft
states of engines that cannot fork move their one matcher along root paths.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from portable_spec.engines.base import NodeStates

__all__ = [
    "ENDED_FREE",
    "ENDED_HELD",
    "LIVE",
    "REFUSED",
    "ReplayStates",
    "Steps",
    "walk_chain",
    "walk_tree",
]

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


def walk_chain(
    steps: Steps, draft: list[int], rows: np.ndarray, vocab_limit: int
) -> tuple[list[bool], int, int]:
    """:func:`walk_tree` for one chain (node ``i``'s only child is ``i + 1``): the same rows,
    counts and guarantees in a plain loop, without the tree walk's stack."""
    nodes = len(draft)
    filled = [False] * nodes
    if not steps.start():
        return filled, 0, 0
    steps.fill(0)
    filled[0] = True
    checked = rejected = held = 0
    advance, fill = steps.advance, steps.fill
    try:
        for node in range(1, nodes):
            checked += 1
            token = draft[node]
            if not 0 <= token < vocab_limit or not (
                (int(rows[node - 1, token >> 5]) >> (token & 31)) & 1
            ):
                rejected += 1
                break
            outcome = advance(token, node - 1, node)
            if outcome == REFUSED:  # the matcher disagrees with its own mask
                rejected += 1
                break
            if outcome != ENDED_FREE:
                held += 1
            if outcome != LIVE:
                break  # terminated: its row stays all-allowed
            fill(node)
            filled[node] = True
    finally:
        if held:
            steps.rollback(held)
    return filled, checked, rejected


# -- draft states that replay root paths --------------------------------------------------------
def root_path(node: int, parents: np.ndarray) -> list[int]:
    """Nodes from the root's first child down to ``node`` (empty for the root)."""
    path = []
    while node > 0:
        path.append(node)
        node = int(parents[node])
    path.reverse()
    return path


class ReplayStates(NodeStates):
    """Draft states of an engine that cannot fork: one matcher moved along root paths.

    It visits each parent of a level in depth-first order (replaying only what differs from
    the previous parent's path), tries each child with one step forward and back, and is back
    at its start before :meth:`grow` returns, also when it raises. A level costs
    ``sum(depth of its parents)`` accepts and rollbacks on top of one accept per new node."""

    def _advance(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def _back(self, count: int) -> None:
        self.matcher.rollback(count)

    @abstractmethod
    def _try(self, token: int, rows: np.ndarray, node: int) -> int:
        """Try one child from the current position (an outcome); leave the matcher where it
        was."""

    @abstractmethod
    def _forced_here(self, row: np.ndarray, most: int) -> list[int]:
        """At most ``most`` forced tokens from the current position (``row``: its mask)."""

    def _visit(
        self, groups: dict[int, list[tuple[int, Any]]], parents: np.ndarray, tokens: np.ndarray
    ) -> None:
        """Move to each parent of ``groups`` in depth-first order and call its children's
        callbacks there; the matcher is back at its start afterwards."""
        paths = {p: root_path(p, parents) for p in groups}
        cursor: list[int] = []
        try:
            for parent in sorted(groups, key=lambda p: paths[p]):
                target = paths[parent]
                common = 0
                while (
                    common < len(cursor)
                    and common < len(target)
                    and cursor[common] == target[common]
                ):
                    common += 1
                if len(cursor) > common:
                    self._back(len(cursor) - common)
                    del cursor[common:]
                for v in target[common:]:
                    if not self._advance(int(tokens[v])):
                        raise RuntimeError(
                            f"the matcher refused token {int(tokens[v])} of node {v} on a "
                            "path it accepted before"
                        )
                    cursor.append(v)
                for _, callback in groups[parent]:
                    callback()
        finally:
            if cursor:
                self._back(len(cursor))

    def grow(
        self,
        items: Sequence[tuple[int, int, int]],
        rows: np.ndarray,
        parents: np.ndarray,
        tokens: np.ndarray,
    ) -> list[int]:
        outcomes = [REFUSED] * len(items)
        groups: dict[int, list[tuple[int, Any]]] = {}
        for i, (node, parent, token) in enumerate(items):

            def decide(i: int = i, node: int = node, token: int = token) -> None:
                outcomes[i] = self._try(token, rows, node)

            groups.setdefault(parent, []).append((i, decide))
        self._visit(groups, parents, tokens)
        return outcomes

    def forced(
        self, node: int, parents: np.ndarray, tokens: np.ndarray, rows: np.ndarray, most: int
    ) -> list[int]:
        found: list[int] = []
        if self.max_depth is not None:
            most = min(most, self.max_depth - len(root_path(node, parents)))

        def here() -> None:
            found.extend(self._forced_here(rows[node], most))

        self._visit({node: [(0, here)]}, parents, tokens)
        return found
