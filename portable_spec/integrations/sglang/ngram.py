"""Grammar-aware NGRAM trees: sglang's n-gram drafts with the grammar's forced continuation.

sglang's ``NGRAMWorker._prepare_draft_tokens`` returns each request's draft tree from its
n-gram corpus, on the host: ``req_drafts`` (``[batch * n]`` token ids, node 0 the last
committed token) and ``mask`` (``[batch * n * n]``, row ``i`` marking node ``i`` and its
ancestors; nodes after their parents; unused slots are token 0 under the root). The worker
derives the verify tree's links and the grammar mask's tree from these two arrays, so a tree
returned here in the same format is the tree sglang verifies. With drafting on, for a batch
with grammar requests:

1. the corpus tree joins a :class:`portable_spec.DraftSession` of the batch's grammars (a
   level per depth), which says which nodes the grammar accepts;
2. per request, the nodes the grammar refuses, and sglang's unused slots, are free slots: a
   verify slot that can only be rejected. The grammar's forced continuation fills them
   (:func:`portable_spec.forced_drafts`, in the model tokenizer's own tokens), after the
   tree's main path (from the root, the first child the grammar accepts, as deep as it goes),
   at most as many tokens as there are free slots; nodes the tree already has along it are
   reused;
3. the new tree: the accepted nodes in their order, then the forced tokens, then unused slots
   (token 0 under the root, as sglang pads); its rows come from the same session, and the
   step is staged for the verify build (:mod:`.drafting`), which gathers them.

In shadow mode (``PORTABLE_SPEC_SGLANG_DRAFTING=shadow``, or the plugin's shadow mode) the tree
stays sglang's: the session follows it (its rows are what shadow mode compares with sglang's
build) and the slots that would carry forced tokens are counted.

Batches the session cannot hold (a reasoning request, a grammar object sglang's own walk
builds, a step sglang builds as a whole) and any failure keep sglang's tree (one warning line
per kind). ``integration_stats()`` counts ``ngram_nodes_replaced`` (free slots given a forced
token) and ``forced_tokens_accepted`` (of those, the tokens verify accepted, counted at the
worker's next step, when its result is on the host anyway).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec.integrations.sglang import drafting, internals
from portable_spec.integrations.sglang.grammars import plan_step
from portable_spec.integrations.sglang.state import LOG, STATS

__all__ = ["forget", "wrap_prepare", "wrap_step"]

_local = threading.local()  # .last: the _Forced record of this thread's last NGRAM step


@dataclass
class _Forced:
    """Which nodes of a step's verify trees carry forced tokens, to count the accepted ones
    from the step's result."""

    worker: Any  # the NGRAMWorker whose step it is
    children: list[dict[int, dict[int, int]]]  # per request: parent -> {token: node}
    forced: list[set[int]]  # per request: the nodes carrying forced tokens
    result: Any = None  # the step's GenerationBatchResult, read at the next step


def wrap_prepare(original: Any) -> Any:
    """``NGRAMWorker._prepare_draft_tokens``: the corpus trees with the grammar's forced
    continuation in the slots the grammar refuses."""

    def _prepare_draft_tokens(self: Any, batch: Any) -> tuple[np.ndarray, np.ndarray]:
        req_drafts, mask = original(self, batch)
        _count_accepted(self)
        mode = drafting.mode()
        drafting.clear()
        if mode == "off" or not getattr(batch, "has_grammar", False):
            return req_drafts, mask
        try:
            return _rewrite(self, batch, req_drafts, mask, mode)
        except Exception as exc:  # never the step's failure: sglang's tree
            LOG.warning(f"ngram:{type(exc).__name__}",
                      "portable_spec: NGRAM drafts left as sglang's: %s", exc)  # fmt: skip
            drafting.clear()
            return req_drafts, mask

    return _prepare_draft_tokens


def wrap_step(original: Any) -> Any:
    """``NGRAMWorker.forward_batch_generation``: its result kept for the count of accepted
    forced tokens (read at the next step: no extra device synchronization)."""

    def forward_batch_generation(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, batch, *args, **kwargs)
        last = getattr(_local, "last", None)
        if last is not None and last.worker is self and last.result is None:
            last.result = result
        return result

    return forward_batch_generation


def forget() -> None:
    """Drop this thread's record of the last NGRAM step (the plugin is uninstalled)."""
    _local.last = None


def _count_accepted(worker: Any) -> None:
    """Count the forced tokens ``worker``'s previous step's verify accepted."""
    last = getattr(_local, "last", None)
    _local.last = None
    if last is None or last.worker is not worker or last.result is None:
        return
    accept_lens = [int(n) for n in last.result.accept_lens.tolist()]
    batch = len(accept_lens)
    ids = last.result.next_token_ids.reshape(batch, -1).tolist()
    accepted = 0
    for b, n in enumerate(accept_lens):
        node, children = 0, last.children[b]
        for token in ids[b][: max(n - 1, 0)]:  # the accepted drafts; the bonus token last
            node = children.get(node, {}).get(int(token), -1)
            if node < 0:
                break
            accepted += node in last.forced[b]
    if accepted:
        STATS.add("forced_tokens_accepted", accepted)


def _rewrite(
    worker: Any, batch: Any, req_drafts: np.ndarray, mask: np.ndarray, mode: str
) -> tuple[np.ndarray, np.ndarray]:
    reqs = list(batch.reqs)
    bs = len(reqs)
    vocab = int(batch.sampling_info.vocab_size)
    plan = plan_step(reqs, vocab)
    if not plan.has_grammar or plan.whole_step or plan.own or plan.end_token is not None:
        return req_drafts, mask
    if all(m is None for m in plan.matchers):
        return req_drafts, mask
    n = req_drafts.size // bs
    tokens = np.asarray(req_drafts, dtype=np.int64).reshape(bs, n)
    parents = _parents_from_mask(np.asarray(mask).reshape(bs, n, n))
    device = internals.ngram_device(worker)
    session = drafting.open_session(plan.matchers, vocab, device=device, max_nodes=2 * n + 1)
    try:
        ids = _add_tree(session, parents, tokens)
        valid = session.valid()
        node_valid = valid[np.arange(bs)[:, None], ids]
        paths = [_main_path(parents[b], node_valid[b]) for b in range(bs)]
        free = [int(n - 1 - node_valid[b, 1:].sum()) for b in range(bs)]
        forced = _forced(worker, plan.matchers, tokens, paths, free, vocab)
        trees = [
            _new_tree(parents[b], tokens[b], node_valid[b], paths[b], forced[b], n)
            for b in range(bs)
        ]
        replaced = sum(len(t.forced) for t in trees)
        if mode != "on":  # shadow: sglang's tree, its rows from the session
            _stage(session, plan, ids)
            session = None
            STATS.update({"draft_steps": 1, "ngram_nodes_replaced": replaced})
            return req_drafts, mask
        select = _add_new_nodes(session, ids, trees)
        _stage(session, plan, select)
        session = None
        STATS.update({"ngram_nodes_replaced": replaced, "draft_steps": 1})
        _local.last = _Forced(worker, [t.children for t in trees], [t.forced for t in trees])
        new_drafts = np.stack([t.tokens for t in trees]).astype(req_drafts.dtype, copy=False)
        new_mask = np.stack([_ancestor_mask(t.parents) for t in trees])
        return new_drafts.reshape(req_drafts.shape), new_mask.astype(mask.dtype).reshape(mask.shape)
    finally:
        if session is not None:
            session.close()


def _parents_from_mask(mask: np.ndarray) -> np.ndarray:
    """Each node's parent (the nearest ancestor before it; -1 for the root), int64
    ``[batch, n]``, from sglang's ancestor mask ``[batch, n, n]``."""
    n = mask.shape[-1]
    order = np.arange(n)
    ancestors = mask.astype(bool) & (order[None, :] < order[:, None])
    return np.where(ancestors.any(-1), (ancestors * order).argmax(-1), -1).astype(np.int64)


def _depths(parents: np.ndarray) -> np.ndarray:
    """Each node's depth (root 0), parents before children."""
    bs, n = parents.shape
    depth = np.zeros((bs, n), dtype=np.int64)
    rows = np.arange(bs)
    for i in range(1, n):
        p = parents[:, i]
        depth[:, i] = np.where(p >= 0, depth[rows, np.where(p >= 0, p, 0)] + 1, 0)
    return depth


def _add_tree(session: Any, parents: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Add the corpus trees to the session a level per depth; the session node of each tree
    node, int64 ``[batch, n]`` (the root: 0)."""
    bs, n = parents.shape
    depth = _depths(parents)
    ids = np.zeros((bs, n), dtype=np.int64)
    for d in range(1, int(depth.max(initial=0)) + 1):
        here = (depth == d) & (parents >= 0)
        width = int(here.sum(axis=1).max())
        if width == 0:
            continue
        level_parents = np.full((bs, width), -1, dtype=np.int64)
        level_tokens = np.zeros((bs, width), dtype=np.int64)
        first = session.nodes
        for b in range(bs):
            cols = np.flatnonzero(here[b])
            level_parents[b, : cols.size] = ids[b, parents[b, cols]]
            level_tokens[b, : cols.size] = tokens[b, cols]
            ids[b, cols] = first + np.arange(cols.size)
        session.extend(level_parents, level_tokens, masks=False)  # rows computed on demand
    return ids


def _main_path(parents: np.ndarray, valid: np.ndarray) -> list[int]:
    """From the root, the first child the grammar accepts, as deep as it goes: the nodes."""
    path: list[int] = []
    node = 0
    while True:
        children = np.flatnonzero((parents == node) & valid)
        if children.size == 0:
            return path
        node = int(children[0])
        path.append(node)


def _forced(
    worker: Any, matchers: list, tokens: np.ndarray, paths: list, free: list, vocab: int
) -> list[list[int]]:
    """Per request, the forced tokens after its main path (at most its free slots)."""
    drafts = [[int(tokens[b, j]) for j in path] for b, path in enumerate(paths)]
    limits = [len(d) + f if m is not None and f > 0 else 0 for d, f, m in
              zip(drafts, free, matchers, strict=True)]  # fmt: skip
    out = ps.forced_drafts(
        matchers, drafts, limits, tokenizer=internals.ngram_tokenizer(worker), vocab_size=vocab
    )
    forced = []
    for d, got in zip(drafts, out, strict=True):
        same = 0
        while same < min(len(d), len(got)) and got[same] == d[same]:
            same += 1
        forced.append(got[same:] if same == len(d) else [])
    return forced


@dataclass
class _Tree:
    """A request's new tree: per node its parent, token and session node (-1: to add)."""

    parents: list[int]
    tokens: np.ndarray
    source: list[int]  # the corpus node it is (-1: a forced token, -2: an unused slot)
    forced: set[int]
    children: dict[int, dict[int, int]]


def _new_tree(
    parents: np.ndarray, tokens: np.ndarray, valid: np.ndarray, path: list, forced: list, n: int
) -> _Tree:
    """The accepted nodes in their order, the forced tokens after the main path (nodes the
    tree has along them reused), then unused slots (token 0 under the root)."""
    keep = [0] + [i for i in range(1, n) if valid[i]]
    new_of = {old: new for new, old in enumerate(keep)}
    new_parents = [-1] + [new_of[int(parents[i])] for i in keep[1:]]
    new_tokens = [int(tokens[0])] + [int(tokens[i]) for i in keep[1:]]
    source = list(keep)
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(keep)):
        children.setdefault(new_parents[node], {}).setdefault(new_tokens[node], node)
    at = new_of[path[-1]] if path else 0
    added: set[int] = set()
    for token in forced:
        if len(new_parents) >= n:
            break
        child = children.get(at, {}).get(token)
        if child is None:
            child = len(new_parents)
            new_parents.append(at)
            new_tokens.append(token)
            source.append(-1)
            children.setdefault(at, {})[token] = child
            added.add(child)
        at = child
    while len(new_parents) < n:
        new_parents.append(0)
        new_tokens.append(0)
        source.append(-2)
    return _Tree(new_parents, np.asarray(new_tokens, dtype=np.int64), source, added, children)


def _add_new_nodes(session: Any, ids: np.ndarray, trees: list[_Tree]) -> np.ndarray:
    """Session nodes for the new trees' forced tokens (a level per chain position) and unused
    slots (one level); the select of every new tree's nodes, int64 ``[batch, n]``."""
    bs, n = ids.shape
    select = np.full((bs, n), -1, dtype=np.int64)
    for b, tree in enumerate(trees):
        for j, src in enumerate(tree.source):
            if src >= 0:
                select[b, j] = ids[b, src]
    while True:  # forced tokens, in order: each one's parent has its session node by now
        ready = [
            [j for j, src in enumerate(t.source) if src == -1 and select[b, j] < 0
             and select[b, t.parents[j]] >= 0]
            for b, t in enumerate(trees)
        ]  # fmt: skip
        width = max(len(r) for r in ready)
        if width == 0:
            break
        _extend(session, select, trees, ready, width)
    slots = [[j for j, src in enumerate(t.source) if src == -2] for t in trees]
    width = max(len(s) for s in slots)
    if width:
        _extend(session, select, trees, slots, width)
    return select


def _extend(session: Any, select: np.ndarray, trees: list[_Tree], nodes: list, width: int) -> None:
    bs = len(trees)
    level_parents = np.full((bs, width), -1, dtype=np.int64)
    level_tokens = np.zeros((bs, width), dtype=np.int64)
    first = session.nodes
    for b, (tree, js) in enumerate(zip(trees, nodes, strict=True)):
        for c, j in enumerate(js):
            level_parents[b, c] = select[b, tree.parents[j]]
            level_tokens[b, c] = tree.tokens[j]
            select[b, j] = first + c
    session.extend(level_parents, level_tokens, masks=False)


def _ancestor_mask(parents: list[int]) -> np.ndarray:
    """sglang's tree mask of a tree given by parent ids (parents first): ``[n, n]`` bool, row
    ``i`` marking ``i`` and its ancestors."""
    n = len(parents)
    out = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            out[i] = out[p]
        out[i, i] = True
    return out


def _stage(session: Any, plan: Any, select: np.ndarray) -> None:
    drafting.stage(
        drafting.Drafted(session, tuple(plan.grammars), tuple(plan.matchers), select, "ngram")
    )
