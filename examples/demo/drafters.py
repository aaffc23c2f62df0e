"""Two tree drafters for the demo engine, blind or grammar-aware.

A draft is a verify tree of exactly ``nodes`` nodes in the first-child / next-sibling layout
(node 0 = the last committed token), plus what the verify forward needs: absolute positions
and the ``[nodes, nodes]`` ancestor-or-self attention mask.

* :class:`NgramDrafter` looks the context's last n-gram up in the prompt and the output so far
  and merges the continuations of its earlier occurrences into a trie, on the host
  (``GrammarTree.from_host``). Grammar-aware, it also grafts the grammar's forced continuation
  (heaviest of all) and looks the n-grams up after it, checks the trie's candidates with a
  :class:`portable_spec.DraftSession` and keeps the heaviest grammar-valid ones.
* :class:`SelfDrafter` asks the model itself: its first layers plus the head expand a top-k
  tree. Blind, the whole tree is built on the device (``GrammarTree.from_device``: the copy to
  the host starts at once and is waited for only when the mask build needs it).
  Grammar-aware, it runs one level per call: the level's logits are masked with the rows a
  :class:`portable_spec.DraftSession` returns for its nodes (so every candidate is
  grammar-valid and the log-probabilities are renormalised over what the grammar allows), the
  host picks the best candidates, and the session's rows give the verify mask.

Grammar-aware drafts carry their session: the engine takes the verify mask from it
(:meth:`portable_spec.DraftSession.verify_mask`, no second walk) and closes it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from portable_spec import DraftSession, GrammarTree, forced_drafts

__all__ = [
    "Draft",
    "Drafter",
    "GrammarContext",
    "NgramDrafter",
    "SelfDrafter",
    "host_tree_arrays",
]


@dataclass
class GrammarContext:
    """What a grammar-aware drafter needs: the request's matcher (in the committed state,
    the root's token accepted; not moved by drafting), the target's vocabulary size and where
    masks go (``device=`` of :class:`portable_spec.DraftSession`; None: host arrays)."""

    matcher: Any
    vocab_size: int
    device: Any = None


@dataclass
class Draft:
    """One step's verify tree.

    Attributes:
        tree: the library's view of the links and tokens (for the mask build and acceptance).
        tokens: int ``[nodes]`` token ids (numpy or a framework array), node 0 = root.
        positions: int ``[nodes]`` absolute positions (root at the cache length).
        tree_mask: bool ``[nodes, nodes]``, ``[i, j]`` = node ``j`` is ``i`` or an ancestor.
        session: the grammar-aware drafter's session (the verify mask comes from it; the
            engine closes it), or None for a blind draft.
        select: the verify tree's nodes among the session's (``[1, nodes]``; None: all).
        grammar_ms: host time the session spent while drafting (grammar rows, uploads).
    """

    tree: GrammarTree
    tokens: Any
    positions: Any
    tree_mask: Any
    session: DraftSession | None = None
    select: Any = None
    grammar_ms: float = 0.0


class Drafter(Protocol):
    """What the engine needs from a drafter."""

    name: str
    nodes: int
    masked: bool

    def draft(
        self, model: Any, context: Sequence[int], start: int, grammar: GrammarContext | None = None
    ) -> Draft:
        """Propose a tree rooted at ``context[-1]`` (not yet in the cache, at ``start``);
        grammar-aware when ``masked`` and ``grammar`` is given."""
        ...


def _session_ms(session: DraftSession) -> float:
    t = session.timings
    return (t["grammar_s"] + t["wait_s"] + t["upload_s"]) * 1e3


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


class _Trie:
    """A weighted token trie below a root: node -> token, parent, weight, children by token."""

    def __init__(self, root: int) -> None:
        self.token, self.parent, self.weight = [root], [-1], [0.0]
        self.depth = [0]
        self.children: list[dict[int, int]] = [{}]

    def insert(self, below: int, follow: Sequence[int], weight: float) -> list[int]:
        """Add ``follow`` below node ``below`` (sharing existing nodes), each node on the way
        gaining ``weight``; returns the nodes of ``follow``."""
        node, path = below, []
        for token in follow:
            token = int(token)
            child = self.children[node].get(token)
            if child is None:
                child = len(self.token)
                self.token.append(token)
                self.parent.append(node)
                self.weight.append(0.0)
                self.depth.append(self.depth[node] + 1)
                self.children.append({})
                self.children[node][token] = child
            self.weight[child] += weight
            path.append(child)
            node = child
        return path

    def heaviest(self, count: int, keep: Any = None) -> list[int]:
        """Up to ``count`` nodes, the root first, heaviest-first from the root (parents always
        before their children; ties: shallower, then earlier). ``keep(node)`` filters."""
        picked = [0]
        frontier = [(-self.weight[c], 1, c) for c in self.children[0].values()]
        heapq.heapify(frontier)
        while frontier and len(picked) < count:
            _, d, node = heapq.heappop(frontier)
            if keep is not None and not keep(node):
                continue
            picked.append(node)
            for c in self.children[node].values():
                heapq.heappush(frontier, (-self.weight[c], d + 1, c))
        return picked


class NgramDrafter:
    """Prompt/output n-gram lookup, merged into a trie of at most ``nodes`` nodes.

    For ``n`` from ``max_n`` down to ``min_n``, the earlier occurrences of the context's last
    ``n`` tokens (the ``max_matches`` most recent ones) each vote for the tokens that followed
    them, with weight ``n * n`` (longer matches are more reliable). The votes form a weighted
    trie; the drafted tree is its ``nodes - 1`` heaviest nodes below the root (a node is never
    lighter than its child, so the pick is a subtree), ties going to the shallower node and
    then to the earlier insertion. With no match the tree is the root alone.

    Grammar-aware (``masked`` and a grammar given): the grammar's forced continuation
    (:func:`portable_spec.forced_drafts`, in the tokenizer's ``encode`` segmentation; off with
    ``forced=False``) is grafted below the root with a weight above every vote, the n-grams of
    the context followed by it vote below its end, and of the trie's heaviest
    ``candidates * nodes`` nodes only those the grammar accepts are kept (a
    :class:`portable_spec.DraftSession` checks them level by level, each node's grammar state
    forked from its parent's).
    """

    name = "ngram"

    def __init__(
        self,
        nodes: int,
        *,
        max_n: int = 4,
        min_n: int = 1,
        max_matches: int = 8,
        masked: bool = True,
        candidates: int = 4,
        forced: bool = True,
        encode: Any = None,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.forced = forced
        self.encode = encode
        self.nodes = nodes
        self.max_n = max_n
        self.min_n = min_n
        self.max_matches = max_matches
        self.masked = masked
        self.candidates = candidates

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

    def draft(
        self, model: Any, context: Sequence[int], start: int, grammar: GrammarContext | None = None
    ) -> Draft:
        """Build the trie on the host; returns a host draft (numpy arrays)."""
        if grammar is not None and self.masked and self.nodes > 1:
            return self._grammar_draft(context, start, grammar)
        trie = _Trie(int(context[-1]))
        if self.nodes > 1:
            for follow, w in self.continuations(context):
                trie.insert(0, follow, w)
        return self._layout(trie, trie.heaviest(self.nodes), start)

    def _layout(self, trie: _Trie, picked: list[int], start: int) -> Draft:
        index = {node: i for i, node in enumerate(picked)}
        parent = [-1] + [index[trie.parent[node]] for node in picked[1:]]
        tokens = [trie.token[node] for node in picked]
        next_token, next_sibling, toks, positions, mask = host_tree_arrays(
            parent, tokens, self.nodes, start
        )
        tree = GrammarTree.from_host(next_token, next_sibling, toks)
        return Draft(tree, toks, positions, mask)

    def _grammar_draft(self, context: Sequence[int], start: int, grammar: GrammarContext) -> Draft:
        session = DraftSession(
            [grammar.matcher], grammar.vocab_size, device=grammar.device, max_nodes=self.nodes
        )
        try:
            trie = _Trie(int(context[-1]))
            forced: list[int] = []
            if self.forced and self.encode is not None:
                forced = forced_drafts(
                    [grammar.matcher], [[]], self.nodes - 1, tokenizer=self.encode
                )[0]
            elif self.forced:
                forced = session.forced(max_tokens=self.nodes - 1)[0]
            end = 0
            if forced:
                end = trie.insert(0, forced, float("inf"))[-1]
                for follow, w in self.continuations([*context, *forced]):
                    trie.insert(end, follow[: self.nodes - 1 - len(forced)], w)
            for follow, w in self.continuations(context):
                trie.insert(0, follow, w)
            # the heaviest candidates, checked by the grammar level by level
            candidates = trie.heaviest(self.candidates * self.nodes)
            ids = {0: 0}
            by_depth: dict[int, list[int]] = {}
            for node in candidates[1:]:
                by_depth.setdefault(trie.depth[node], []).append(node)
            for depth in sorted(by_depth):
                level = by_depth[depth]
                first = session.nodes
                parents = [[ids[trie.parent[node]] for node in level]]
                session.extend(parents, [[trie.token[node] for node in level]], masks=False)
                ids.update({node: first + j for j, node in enumerate(level)})
            valid = session.valid()[0]
            picked = trie.heaviest(self.nodes, keep=lambda node: node in ids and valid[ids[node]])
            draft = self._layout(trie, picked, start)
            select = np.full((1, self.nodes), -1, np.int64)
            select[0, : len(picked)] = [ids[node] for node in picked]
            draft.session, draft.select = session, select
            draft.grammar_ms = _session_ms(session)
            return draft
        except BaseException:
            session.close()
            raise


class SelfDrafter:
    """Self-speculative drafting: the model's first ``layers`` layers plus its head.

    Each level runs the frontier through the shallow model and keeps the ``branch`` children
    with the best cumulative log-probability (see the models' ``draft_tree``).

    Blind: everything stays on the device; the tree arrays go to ``GrammarTree.from_device``.
    Grammar-aware (``masked`` and a grammar given): one ``draft_level`` call per level, its
    logits masked by the rows of the frontier's nodes (log-probabilities renormalised over
    the allowed tokens, so a forced token costs nothing and its branch grows deeper); the host
    picks the ``branch`` best finite candidates and hands them to the session, which returns
    the next level's rows. The last level's rows are only needed by the verify mask: that
    level is added with ``masks=False`` and computed while the verify forward runs.

    Root-only (``root_only``): the device expansion of the blind drafter with the root's row
    (known before drafting) applied to the first level's logits: no host round trip, deeper
    levels drafted blind, the verify mask built over the finished tree.
    """

    name = "self"

    def __init__(
        self,
        nodes: int,
        *,
        layers: int = 24,
        branch: int = 3,
        masked: bool = True,
        root_only: bool = False,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if branch < 1:
            raise ValueError(f"branch must be >= 1, got {branch}")
        self.nodes = nodes
        self.layers = layers
        self.branch = branch
        self.masked = masked
        self.root_only = root_only

    def draft(
        self, model: Any, context: Sequence[int], start: int, grammar: GrammarContext | None = None
    ) -> Draft:
        """Blind: launch the device expansion, returns device arrays without blocking.
        Grammar-aware: a host loop over levels (one device round trip each)."""
        root_mask, grammar_ms = None, 0.0
        if grammar is not None and self.masked and self.nodes > 1:
            if not self.root_only:
                return self._grammar_draft(model, context, start, grammar)
            with DraftSession([grammar.matcher], grammar.vocab_size, device=grammar.device) as s:
                root_mask = s.root_mask()
                grammar_ms = _session_ms(s)
        out = model.draft_tree(
            int(context[-1]),
            start,
            nodes=self.nodes,
            branch=self.branch,
            layers=self.layers,
            root_mask=root_mask,
        )
        tree = GrammarTree.from_device(out["next_token"], out["next_sibling"], out["tokens"])
        return Draft(tree, out["tokens"], out["positions"], out["tree_mask"], grammar_ms=grammar_ms)

    def _grammar_draft(
        self, model: Any, context: Sequence[int], start: int, grammar: GrammarContext
    ) -> Draft:
        nodes, branch, layers = self.nodes, self.branch, self.layers
        if not 1 <= layers <= model.config.n_layers:
            raise ValueError(f"draft layers must be in 1..{model.config.n_layers}, got {layers}")
        session = DraftSession(
            [grammar.matcher], grammar.vocab_size, device=grammar.device, max_nodes=nodes
        )
        try:
            state = model.draft_start(slots=nodes + 1, layers=layers)  # slot `nodes`: scratch
            parents, tokens, depth, score = [-1], [int(context[-1])], [0], [0.0]
            anc = np.eye(nodes + 1, dtype=bool)
            # A jitted model compiles once per frontier size: pad the frontier to 1 or
            # `branch` rows (padding rows: scratch slot, all-allowed mask rows).
            static = getattr(model, "static_shapes", False)

            def width(count: int) -> int:
                return count if not static or count == 1 else branch

            frontier = [0]
            rows = session.root_mask(row_capacity=width(1))
            while len(parents) < nodes:
                pad = width(len(frontier)) - len(frontier)
                slots = frontier + [nodes] * pad
                lp, top = model.draft_level(
                    state,
                    np.array([tokens[f] for f in frontier] + [0] * pad),
                    np.array([start + depth[f] for f in frontier] + [start] * pad),
                    start,
                    np.array(slots),
                    anc[slots],
                    rows,
                    branch=branch,
                    layers=layers,
                )
                cand = np.array([score[f] for f in frontier])[:, None] + lp[: len(frontier)]
                cand = cand.reshape(-1)
                order = [i for i in np.argsort(-cand, kind="stable") if np.isfinite(cand[i])]
                order = order[: min(branch, nodes - len(parents))]
                if not order:
                    break
                first = len(parents)
                new_parents, new_tokens = [], []
                for i in order:
                    p, t = frontier[i // branch], int(top.reshape(-1)[i])
                    v = len(parents)
                    parents.append(p)
                    tokens.append(t)
                    depth.append(depth[p] + 1)
                    score.append(float(cand[i]))
                    anc[v] |= anc[p]
                    new_parents.append(p)
                    new_tokens.append(t)
                last = len(parents) >= nodes
                rows = session.extend(
                    [new_parents], [new_tokens], masks=not last, row_capacity=width(len(order))
                )
                frontier = list(range(first, len(parents)))
            next_token, next_sibling, toks, positions, mask = host_tree_arrays(
                parents, tokens, nodes, start
            )
            tree = GrammarTree.from_host(next_token, next_sibling, toks)
            select = np.full((1, nodes), -1, np.int64)
            select[0, : len(parents)] = np.arange(len(parents))
            return Draft(
                tree,
                toks,
                positions,
                mask,
                session=session,
                select=select,
                grammar_ms=_session_ms(session),
            )
        except BaseException:
            session.close()
            raise
