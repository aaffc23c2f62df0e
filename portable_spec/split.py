"""Splitting one request's tree across threads, for batches smaller than the thread pool.

With fewer requests than threads (batch 1 above all) request-level parallelism leaves cores
idle. A large tree is then cut into disjoint subtrees: the request's own matcher walks the
tree with those subtrees unlinked, and each subtree is walked by a fork of the matcher that
first accepts the tokens on the path from the root to the subtree's root. Each walk writes
exactly the rows the whole-tree walk would write, and the builder's index-based row repair
(which reads the parent's row of every node) is unchanged, so the result is identical.

Plain Python over lists, linear in the node count: it only runs for the few requests of a
small batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Split", "Subtree", "plan_split", "walk_subtree"]


@dataclass
class Subtree:
    """One cut subtree of a request, renumbered for its own traversal.

    Attributes:
        path: tokens to accept on a fork of the matcher, from the root's child down to and
            including the subtree's root.
        nodes: the request-local node index of each local node (local 0 is the subtree root).
        next_token, next_sibling, draft: int64 ``[len(nodes)]`` links and tokens, local.
    """

    path: list[int]
    nodes: list[int]
    next_token: np.ndarray
    next_sibling: np.ndarray
    draft: np.ndarray


@dataclass
class Split:
    """A request cut into the part its own matcher walks and subtrees walked on forks.

    Attributes:
        next_token, next_sibling: int64 ``[nodes]`` links with the subtrees unlinked.
        main_rows: the request-local rows the main walk owns (all but the subtrees').
        subtrees: the cut subtrees.
    """

    next_token: np.ndarray
    next_sibling: np.ndarray
    main_rows: list[int]
    subtrees: list[Subtree]


def plan_split(
    nt: list[int], ns: list[int], dt: list[int], parts: int, min_part: int
) -> Split | None:
    """Cut a (validated) tree into up to ``parts`` pieces of about equal node count.

    Greedy: repeatedly cut, out of what remains, the subtree whose size is closest to an equal
    share of the remaining nodes; never the root, never a piece under ``min_part`` nodes.
    Returns None when no cut is worth making.
    """
    nodes = len(nt)
    children: list[list[int]] = [[] for _ in range(nodes)]
    parent = [-1] * nodes
    order = [0]
    i = 0
    while i < len(order):  # breadth first from the root: parents before children
        v = order[i]
        i += 1
        c = nt[v]
        while c != -1:
            children[v].append(c)
            parent[c] = v
            order.append(c)
            c = ns[c]
    size = [1] * nodes
    for v in reversed(order[1:]):
        size[parent[v]] += size[v]
    removed = [False] * nodes
    cuts: list[int] = []
    for piece in range(parts - 1):
        remaining = size[0]
        goal = remaining / (parts - piece)
        best, best_gap = -1, float(nodes)
        for v in order[1:]:
            if removed[v]:
                continue
            s = size[v]
            if s >= min_part and remaining - s >= min_part and abs(s - goal) < best_gap:
                best, best_gap = v, abs(s - goal)
        if best < 0:
            break
        cuts.append(best)
        stack = [best]
        while stack:
            v = stack.pop()
            removed[v] = True
            stack.extend(children[v])
        a = parent[best]
        while a != -1:
            size[a] -= size[best]
            a = parent[a]
    if not cuts:
        return None

    next_token = np.array(nt, dtype=np.int64)
    next_sibling = np.array(ns, dtype=np.int64)
    subtrees = []
    for s in cuts:
        subtrees.append(_extract(children, parent, dt, s, removed_below=cuts))
        # unlink s from its parent's child list in the main part
        siblings = children[parent[s]]
        at = siblings.index(s)
        after = siblings[at + 1] if at + 1 < len(siblings) else -1
        if at == 0:
            next_token[parent[s]] = after
        else:
            next_sibling[siblings[at - 1]] = after
        siblings.pop(at)
        next_sibling[s] = -1
    main_rows = [v for v in range(nodes) if not removed[v]]
    return Split(next_token, next_sibling, main_rows, subtrees)


def _extract(
    children: list[list[int]], parent: list[int], dt: list[int], s: int, removed_below: list[int]
) -> Subtree:
    """The subtree at ``s``, minus subtrees of other cuts inside it, renumbered from 0."""
    others = set(removed_below) - {s}
    nodes = [s]
    i = 0
    while i < len(nodes):
        nodes.extend(c for c in children[nodes[i]] if c not in others)
        i += 1
    local = {v: j for j, v in enumerate(nodes)}
    k = len(nodes)
    next_token = np.full(k, -1, dtype=np.int64)
    next_sibling = np.full(k, -1, dtype=np.int64)
    for j, v in enumerate(nodes):
        kids = [c for c in children[v] if c not in others]
        if kids:
            next_token[j] = local[kids[0]]
            for a, b in itertools.pairwise(kids):
                next_sibling[local[a]] = local[b]
    path = []
    v = s
    while v != 0:
        path.append(dt[v])
        v = parent[v]
    path.reverse()
    draft = np.array([dt[v] for v in nodes], dtype=np.int64)
    return Subtree(path, nodes, next_token, next_sibling, draft)


def walk_subtree(fork: Any, sub: Subtree, scratch: np.ndarray, vocab_limit: int) -> bool:
    """Advance ``fork`` along ``sub.path`` and traverse the subtree into ``scratch``.

    Returns False (nothing written) when the path leaves the grammar or the fork terminates
    before the subtree's root: the whole-tree walk would not reach the subtree either, and
    the builder's repair turns its rows into all-allowed rows.
    """
    for token in sub.path:
        if fork.is_terminated() or not 0 <= token < vocab_limit or not fork.accept_token(token):
            return False
    fork.traverse_draft_tree(sub.next_token, sub.next_sibling, sub.draft, scratch)
    return True
