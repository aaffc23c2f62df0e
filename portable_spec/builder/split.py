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
    nt: list[int],
    ns: list[int],
    dt: list[int],
    parts: int,
    min_part: int,
    order: list[int] | None = None,
    parent: list[int] | None = None,
) -> Split | None:
    """Cut a (validated) tree into up to ``parts`` pieces of about equal node count.

    Greedy: repeatedly cut, out of what remains, the subtree whose size is closest to an equal
    share of the remaining nodes; never the root, never a piece under ``min_part`` nodes.
    ``order`` (parents before children) and ``parent`` may be passed when already known.
    Returns None when no cut is worth making.
    """
    nodes = len(nt)
    if order is None or parent is None:
        order, parent = _walk_order(nt, ns)
    size = [1] * nodes
    for v in reversed(order):
        p = parent[v]
        if p >= 0:
            size[p] += size[v]
    removed = [False] * nodes
    main_nt, main_ns = list(nt), list(ns)
    subtrees = []
    for piece in range(parts - 1):
        remaining = size[0]
        goal = remaining / (parts - piece)
        best, best_gap = -1, float(nodes)
        upper = remaining - min_part
        for v in order:
            s = size[v]
            if min_part <= s <= upper and not removed[v] and v:
                gap = abs(s - goal)
                if gap < best_gap:
                    best, best_gap = v, gap
        if best < 0:
            break
        subtrees.append(_cut(main_nt, main_ns, dt, parent, best, removed))
        a = parent[best]
        while a != -1:
            size[a] -= size[best]
            a = parent[a]
    if not subtrees:
        return None
    main_rows = [v for v in range(nodes) if not removed[v]]
    return Split(
        np.array(main_nt, dtype=np.int64), np.array(main_ns, dtype=np.int64), main_rows, subtrees
    )


def _walk_order(nt: list[int], ns: list[int]) -> tuple[list[int], list[int]]:
    parent = [-1] * len(nt)
    order = [0]
    for v in order:  # grows while iterating: breadth first
        c = nt[v]
        while c != -1:
            parent[c] = v
            order.append(c)
            c = ns[c]
    return order, parent


def _cut(
    nt: list[int], ns: list[int], dt: list[int], parent: list[int], s: int, removed: list[bool]
) -> Subtree:
    """Take the subtree at ``s`` out of the links ``nt``/``ns`` (in place) and renumber it.

    Subtrees cut before are no longer linked, so they are not part of this one.
    """
    nodes = [s]
    for v in nodes:  # breadth first over the current links
        removed[v] = True
        c = nt[v]
        while c != -1:
            nodes.append(c)
            c = ns[c]
    local = {v: j for j, v in enumerate(nodes)}
    sub_nt = [local[nt[v]] if nt[v] != -1 else -1 for v in nodes]
    sub_ns = [-1] + [local[ns[v]] if ns[v] != -1 else -1 for v in nodes[1:]]
    # unlink s from its parent's child chain
    p = parent[s]
    if nt[p] == s:
        nt[p] = ns[s]
    else:
        c = nt[p]
        while ns[c] != s:
            c = ns[c]
        ns[c] = ns[s]
    ns[s] = -1
    path = []
    v = s
    while v != 0:
        path.append(dt[v])
        v = parent[v]
    path.reverse()
    return Subtree(
        path,
        nodes,
        np.array(sub_nt, dtype=np.int64),
        np.array(sub_ns, dtype=np.int64),
        np.array([dt[v] for v in nodes], dtype=np.int64),
    )


def walk_subtree(fork: Any, sub: Subtree, scratch: np.ndarray, vocab_limit: int) -> bool:
    """Advance ``fork`` along ``sub.path`` and traverse the subtree into ``scratch``.

    Returns False (nothing written) when the path leaves the grammar or the fork terminates
    before the subtree's root: the whole-tree walk would not reach the subtree either, and
    the builder's repair turns its rows into all-allowed rows.

    Each path token is tested as the whole-tree walk tests it (in range and allowed by the
    row before it) before the fork is asked to accept it: xgrammar logs a warning on stderr
    for every token it cannot accept at all (ids past its tokenizer's vocabulary in a padded
    model vocabulary, special tokens), and such drafts must not fill an engine's log.
    """
    row = scratch[:1]  # written by the traversal afterwards
    for token in sub.path:
        if fork.is_terminated() or not 0 <= token < vocab_limit:
            return False
        fork.fill_next_token_bitmask(row, 0)
        if not (int(row[0, token >> 5]) >> (token & 31)) & 1 or not fork.accept_token(token):
            return False
    fork.traverse_draft_tree(sub.next_token, sub.next_sibling, sub.draft, scratch)
    return True
