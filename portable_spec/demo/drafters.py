"""Two tree drafters for the demo engine.

A draft is a verify tree of exactly ``nodes`` nodes in the first-child / next-sibling layout
(node 0 = the last committed token), plus what the verify forward needs: absolute positions
and the ``[nodes, nodes]`` ancestor-or-self attention mask.

* :class:`NgramDrafter` looks the context's last n-gram up in the prompt and the output so far
  and merges the continuations of its earlier occurrences into a trie, on the host
  (``GrammarTree.from_host``).
* :class:`SelfDrafter` asks the model itself: its first layers plus the head expand a top-k
  tree on the device (``GrammarTree.from_device``: the copy to the host starts at once and is
  waited for only when the mask build needs it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from portable_spec import GrammarTree

__all__ = ["Draft", "Drafter", "NgramDrafter", "SelfDrafter", "host_tree_arrays"]


@dataclass
class Draft:
    """One step's verify tree.

    Attributes:
        tree: the library's view of the links and tokens (for the mask build and acceptance).
        tokens: int ``[nodes]`` token ids (numpy or a framework array), node 0 = root.
        positions: int ``[nodes]`` absolute positions (root at the cache length).
        tree_mask: bool ``[nodes, nodes]``, ``[i, j]`` = node ``j`` is ``i`` or an ancestor.
    """

    tree: GrammarTree
    tokens: Any
    positions: Any
    tree_mask: Any


class Drafter(Protocol):
    """What the engine needs from a drafter."""

    name: str
    nodes: int

    def draft(self, model: Any, context: Sequence[int], start: int) -> Draft:
        """Propose a tree rooted at ``context[-1]`` (not yet in the cache, at ``start``)."""
        ...


def host_tree_arrays(
    parent: Sequence[int], tokens: Sequence[int], nodes: int, start: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Layout of a tree given by parent links, padded to ``nodes``.

    Args:
        parent: parent of each node (``parent[0] = -1``; every parent before its children).
        tokens: token of each node; nodes: padded size (``>= len(parent)``); start: root
            position.

    Returns:
        ``(next_token, next_sibling, tokens, positions, tree_mask)`` numpy arrays of ``nodes``
        entries (int64, bool mask). Children and siblings keep node order. Padding nodes hang
        nowhere (no link reaches them) and attend only to themselves.
    """
    n = len(parent)
    if not 1 <= n <= nodes:
        raise ValueError(f"a tree of {n} nodes does not fit {nodes}")
    next_token = np.full(nodes, -1, np.int64)
    next_sibling = np.full(nodes, -1, np.int64)
    toks = np.zeros(nodes, np.int64)
    toks[:n] = tokens
    depth = np.zeros(nodes, np.int64)
    mask = np.eye(nodes, dtype=bool)
    last_child: dict[int, int] = {}
    for i in range(1, n):
        p = parent[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must come first")
        if p in last_child:
            next_sibling[last_child[p]] = i
        else:
            next_token[p] = i
        last_child[p] = i
        depth[i] = depth[p] + 1
        mask[i] |= mask[p]
    return next_token, next_sibling, toks, start + depth, mask


class NgramDrafter:
    """Prompt/output n-gram lookup, merged into a trie of at most ``nodes`` nodes.

    For ``n`` from ``max_n`` down to ``min_n``, the earlier occurrences of the context's last
    ``n`` tokens (the ``max_matches`` most recent ones) each vote for the tokens that followed
    them, with weight ``n * n`` (longer matches are more reliable). The votes form a weighted
    trie; the drafted tree is its ``nodes - 1`` heaviest nodes below the root (a node is never
    lighter than its child, so the pick is a subtree), ties going to the shallower node and
    then to the earlier insertion. With no match the tree is the root alone.
    """

    name = "ngram"

    def __init__(self, nodes: int, *, max_n: int = 4, min_n: int = 1, max_matches: int = 8) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.nodes = nodes
        self.max_n = max_n
        self.min_n = min_n
        self.max_matches = max_matches

    def continuations(self, context: Sequence[int]) -> list[tuple[list[int], float]]:
        """``(continuation, weight)`` of every match, longest matches first (each
        continuation at most ``nodes - 1`` tokens)."""
        ctx = np.asarray(context, dtype=np.int64)
        depth = self.nodes - 1
        found: list[tuple[list[int], float]] = []
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))  # window starts
            for s in hits[::-1][: self.max_matches]:
                follow = ctx[s + n : s + n + depth].tolist()
                if follow:
                    found.append((follow, float(n * n)))
        return found

    def draft(self, model: Any, context: Sequence[int], start: int) -> Draft:
        """Build the trie on the host; returns a host draft (numpy arrays)."""
        # weighted trie: node -> (token, parent, weight); children by token
        trie_token, trie_parent, weight = [int(context[-1])], [-1], [0.0]
        children: list[dict[int, int]] = [{}]
        if self.nodes > 1:
            for follow, w in self.continuations(context):
                node = 0
                for token in follow:
                    child = children[node].get(token)
                    if child is None:
                        child = len(trie_token)
                        trie_token.append(token)
                        trie_parent.append(node)
                        weight.append(0.0)
                        children.append({})
                        children[node][token] = child
                    weight[child] += w
                    node = child
        # heaviest-first expansion from the root: parents are always picked before children
        picked = [0]
        frontier = [(-weight[c], 1, c) for c in children[0].values()]
        heapq.heapify(frontier)
        while frontier and len(picked) < self.nodes:
            _, d, node = heapq.heappop(frontier)
            picked.append(node)
            for c in children[node].values():
                heapq.heappush(frontier, (-weight[c], d + 1, c))
        index = {node: i for i, node in enumerate(picked)}
        parent = [-1] + [index[trie_parent[node]] for node in picked[1:]]
        tokens = [trie_token[node] for node in picked]
        next_token, next_sibling, toks, positions, mask = host_tree_arrays(
            parent, tokens, self.nodes, start
        )
        tree = GrammarTree.from_host(next_token, next_sibling, toks)
        return Draft(tree, toks, positions, mask)


class SelfDrafter:
    """Self-speculative drafting: the model's first ``layers`` layers plus its head.

    Each level runs the frontier through the shallow model and keeps the ``branch`` children
    with the best cumulative log-probability (see the backends' ``draft_tree``). Everything
    stays on the device; the tree arrays go to ``GrammarTree.from_device``.
    """

    name = "self"

    def __init__(self, nodes: int, *, layers: int = 24, branch: int = 3) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if branch < 1:
            raise ValueError(f"branch must be >= 1, got {branch}")
        self.nodes = nodes
        self.layers = layers
        self.branch = branch

    def draft(self, model: Any, context: Sequence[int], start: int) -> Draft:
        """Launch the device expansion; returns device arrays without blocking."""
        out = model.draft_tree(
            int(context[-1]), start, nodes=self.nodes, branch=self.branch, layers=self.layers
        )
        tree = GrammarTree.from_device(out["next_token"], out["next_sibling"], out["tokens"])
        return Draft(tree, out["tokens"], out["positions"], out["tree_mask"])
