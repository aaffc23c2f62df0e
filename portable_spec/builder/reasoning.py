"""Reasoning models: the grammar starts where the reasoning ends, per path of the tree.

A reasoning request thinks freely, then emits an end token (``</think>``) after which its
answer follows the grammar. In a verify tree the end token may lie on some branches and not on
others, so the rule is applied per root path (see :class:`Reasoning`). The mask is built in
three steps, all through :func:`portable_spec.build_host_bitmask` (passed in by it as a
callable: this module never imports the builder's front):

1. the requests that are not reasoning, as usual (reasoning ones are passed as ``None``);
2. each reasoning request's free-text row: everything allowed except the content end tokens
   the grammar refuses as first content (read off its first mask by a one-node build, once
   per matcher: a reasoning matcher stands at its start state);
3. every node where the reasoning ends starts a sub-tree walked by the grammar from its
   starting state (for a content end token, the token itself is the grammar's first), in
   rounds with at most one sub-tree per matcher; the rows are copied into place.

Chains (linear or packed) take one build instead: the free-text rows are written while a
chain reasons, and the rest of each chain below the node that ends the reasoning is built
together with the other requests' chains, in place.

Every check runs before any matcher moves; matchers end where they started.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec.builder import jobs
from portable_spec.engines.base import IdentityCache
from portable_spec.errors import MatcherError
from portable_spec.grammars import known_xgrammar_facts
from portable_spec.masks import ALL_ALLOWED
from portable_spec.stats import record_build
from portable_spec.tree import GrammarTree

__all__ = ["Reasoning", "build_with_reasoning", "check_reasoning"]


@dataclass(frozen=True)
class Reasoning:
    """Which requests are still reasoning at the root, and the tokens that end the reasoning.

    Attributes:
        active: ``[batch]`` booleans (any sequence or array): request ``b`` is still reasoning
            at node 0, its matcher has consumed nothing of the answer yet.
        end_token_ids: tokens that end the reasoning (``</think>``): the grammar starts *after*
            such a node; its row is the grammar's first mask. One int, or any collection of
            ints (set, frozenset, tuple, list, range, 1-D integer array); so is the next one.
            Bools, floats, strings and ids outside ``[0, vocab_size)`` are refused by the
            build (``TypeError``/``ValueError``) before any matcher moves.
        content_end_token_ids: tokens that end the reasoning *and* are the answer's first
            token (a tool-call start such as ``<tool_call>``): the grammar consumes the token
            itself; its row is the grammar's mask after it. While a path is still reasoning,
            its rows ban those of these tokens the grammar refuses as first content.

    Along each root path of an active request: while no end token has appeared, a node's row
    allows every token except the banned content end tokens (a node whose token is outside
    ``[0, vocab_size)`` or banned is rejected, as anywhere); the first node whose token ends
    the reasoning starts the grammar; below it, the row contract of
    :func:`portable_spec.build_host_bitmask` holds. Requests not active are built as usual.
    """

    active: Any
    end_token_ids: Collection[int] | int
    content_end_token_ids: Collection[int] | int = field(default=())


@dataclass
class _Checked:
    active: np.ndarray
    ends: frozenset[int]
    content_ends: frozenset[int]


def _token_id(token: Any, name: str) -> int:
    if isinstance(token, (bool, np.bool_)):
        raise TypeError(f"Reasoning.{name} must hold int token ids, got the bool {token!r}")
    try:
        return operator.index(token)  # int, numpy integers, 0-d integer tensors
    except TypeError:
        raise TypeError(
            f"Reasoning.{name} must hold int token ids, got {token!r} ({type(token).__name__})"
        ) from None


def _token_ids(value: Any, name: str, vocab_size: int) -> frozenset[int]:
    """``value`` (one int, or a collection of ints: set, frozenset, tuple, list, range, 1-D
    integer array) as a frozenset; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    wanted = "one token id or a collection of token ids (set, tuple, list, range, array)"
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu" or value.ndim > 1:
            raise TypeError(
                f"Reasoning.{name} must be {wanted}; got an array of dtype {value.dtype} "
                f"and shape {value.shape}"
            )
        tokens: list[Any] = value.reshape(-1).tolist()
    elif isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(
        value, (Integral, Collection)
    ):
        raise TypeError(f"Reasoning.{name} must be {wanted}, got {value!r}")
    elif isinstance(value, Integral) and not isinstance(value, bool):
        tokens = [value]
    elif isinstance(value, bool):
        raise TypeError(f"Reasoning.{name} must be {wanted}, got the bool {value!r}")
    else:
        tokens = list(value)
    ids = []
    for token in tokens:
        token_id = _token_id(token, name)
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"Reasoning.{name} holds {token_id}, outside the vocabulary [0, {vocab_size})"
            )
        ids.append(token_id)
    return frozenset(ids)


def check_reasoning(reasoning: Any, batch: int, vocab_size: int) -> _Checked:
    """Validate a :class:`Reasoning` against the batch; ``TypeError``/``ValueError`` naming the
    field otherwise."""
    if not isinstance(reasoning, Reasoning):
        raise TypeError(
            f"reasoning must be a portable_spec.Reasoning, got {type(reasoning).__name__}"
        )
    active = np.asarray(reasoning.active)
    if active.dtype != np.bool_:
        raise TypeError(f"Reasoning.active must hold booleans, got dtype {active.dtype}")
    if active.shape != (batch,):
        raise ValueError(f"Reasoning.active has shape {active.shape}; the tree has batch {batch}")
    ends = _token_ids(reasoning.end_token_ids, "end_token_ids", vocab_size)
    content = _token_ids(reasoning.content_end_token_ids, "content_end_token_ids", vocab_size)
    if not ends and not content:
        raise ValueError("Reasoning needs at least one end token")
    both = ends & content
    if both:
        raise ValueError(
            f"token(s) {sorted(both)} are both end_token_ids and content_end_token_ids"
        )
    return _Checked(active, ends, content)


@dataclass
class _SubTree:
    """A grammar sub-tree of a reasoning request: node ``v`` of its links is request node
    ``nodes[v]`` (-1: the virtual start of a content end token, whose row is not used)."""

    request: int
    nodes: list[int]
    next_token: list[int]
    next_sibling: list[int]
    draft: list[int]


def build_with_reasoning(
    build: Any,
    grammars: Sequence[Any],
    tree: GrammarTree,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
    vocab_size: int,
    words: int,
    checked: _Checked,
    reasoning_requests: list[int],
    out: np.ndarray | None,
    return_valid: bool,
    parts_for: Callable[[int], int],
) -> Any:
    """:func:`portable_spec.build_host_bitmask` with a :class:`Reasoning` rule (``build`` is
    that function without one, over matchers the caller already holds), once every argument
    is checked (``checked``: the rule, from :func:`check_reasoning`; ``reasoning_requests``:
    the constrained requests still reasoning, at least one), the tree resolved (``arrays``)
    and validated, the matchers held. ``parts_for(rows)``: how many parts the compiled
    chain walker cuts that many rows into (the route table's choice). Same result and
    guarantees as that function."""
    next_token, next_sibling, draft = arrays
    if tree.is_chain or tree.is_packed:
        return _chains_with_reasoning(
            build, grammars, tree, draft, vocab_size, words, checked, reasoning_requests, out,
            return_valid, parts_for,
        )  # fmt: skip

    rest = [None if b in reasoning_requests else g for b, g in enumerate(grammars)]
    mask, valid = build(rest, tree, vocab_size, out=out, return_valid=True)
    if mask is None:
        mask = np.empty((tree.rows, words), dtype=np.int32) if out is None else out
        mask[:] = ALL_ALLOWED
    frees = _free_rows(build, grammars, reasoning_requests, checked, vocab_size, words)
    spans = tree.spans()
    flat_valid = valid.reshape(-1)  # a view: [batch, nodes], or [rows] for packed chains
    subtrees: list[list[_SubTree]] = []
    for k, b in enumerate(reasoning_requests):
        free = frees[k]
        start, n = spans[b]
        links = (next_token[b, :n].tolist(), next_sibling[b, :n].tolist(), draft[b, :n].tolist())
        block = mask[start : start + n]
        request_valid = flat_valid[start : start + n]
        request_valid[:] = False
        found = _reasoning_walk(b, *links, block, request_valid, free, checked, vocab_size)
        subtrees.append(found)
    _build_subtrees(build, grammars, subtrees, mask, flat_valid, spans, vocab_size)
    return (mask, valid) if return_valid else mask


def _chains_with_reasoning(
    build: Any,
    grammars: Sequence[Any],
    tree: GrammarTree,
    draft: np.ndarray,
    vocab_size: int,
    words: int,
    checked: _Checked,
    thinking: list[int],
    out: np.ndarray | None,
    return_valid: bool,
    parts_for: Callable[[int], int],
) -> Any:
    """The reasoning rule on chains (linear or packed) in one build: each reasoning request's
    free-text rows are written while its chain reasons; where an end token ends the reasoning,
    the rest of the chain becomes a grammar chain of its matcher (from the end token's node,
    or, for a content end token, from the node before it, whose free-text row is put back
    afterwards). Those chains and the other requests' chains are built together, in place."""
    _, _, draft = tree.resolve()
    rows = tree.rows
    mask = np.empty((rows, words), dtype=np.int32) if out is None else out
    valid = np.zeros(rows, dtype=bool)
    firsts = _free_rows(build, grammars, thinking, checked, vocab_size, words)
    frees = dict(zip(thinking, firsts, strict=True))
    flat: list[int] = []
    lengths: list[int] = []
    starts: list[int] = []
    owners: list[int] = []
    restore: list[tuple[int, np.ndarray]] = []  # free-text rows a grammar chain's root covers
    for b, (start, n) in enumerate(tree.spans()):
        if grammars[b] is None:
            mask[start : start + n] = ALL_ALLOWED
            valid[start : start + n] = True
            continue
        tokens = draft[b, :n].tolist()
        free = frees.get(b)
        if free is None:  # answering: its whole chain
            head = 0
        else:
            head = _reason_along(tokens, free, checked, vocab_size, mask, valid, start)
            if head < 0:
                continue
            if head < n and tokens[head] in checked.content_ends:
                head -= 1  # the node before: a start the grammar's first token hangs below
                restore.append((start + head, free))
        flat.extend(tokens[head:])
        lengths.append(n - head)
        starts.append(start + head)
        owners.append(b)
    if owners and not _walk_directly(
        grammars, owners, flat, lengths, starts, mask, valid, vocab_size, words, parts_for
    ):
        placed = GrammarTree._placed_chains(np.array(flat, dtype=np.int64), lengths, starts, rows)
        try:
            _, accepted = build(
                [grammars[b] for b in owners], placed, vocab_size, out=mask, return_valid=True
            )
        except MatcherError as exc:
            raise MatcherError(owners[exc.request_index], exc.error) from exc.error
        for start, length in zip(starts, lengths, strict=True):
            valid[start : start + length] = accepted[start : start + length]
    for row, free in restore:
        mask[row] = free
        valid[row] = True
    if not return_valid:
        return mask
    return mask, valid if tree.is_packed else valid.reshape(tree.batch, tree.nodes)


def _walk_directly(
    grammars: Sequence[Any],
    owners: list[int],
    flat: list[int],
    lengths: list[int],
    starts: list[int],
    mask: np.ndarray,
    valid: np.ndarray,
    vocab_size: int,
    words: int,
    parts_for: Callable[[int], int],
) -> bool:
    """The grammar chains of :func:`_chains_with_reasoning` (chain ``i`` of request
    ``owners[i]``: ``lengths[i]`` tokens of ``flat``, rows from ``starts[i]``) walked and
    repaired by the compiled helper's chain walker (in ``parts_for(rows)`` parts), valid flags
    written, when every matcher is an xgrammar matcher it can call, of the mask's width, with
    the same stop tokens (already probed by the front, held by the caller). False (nothing
    moved) otherwise: the caller builds them."""
    infos = known_xgrammar_facts([grammars[b] for b in owners], words)
    first = None if infos is None else jobs.walkable(infos, words)
    if first is None:
        return False
    table = []
    position = 0
    for start, length in zip(starts, lengths, strict=True):
        table.append((start, position, length))
        position += length
    began = perf_counter()
    try:
        checked, rejected, walks = jobs.walk_chain_table(
            mask,
            np.array(flat, dtype=np.int64),
            np.array(table, dtype=np.int64),
            [grammars[b] for b in owners],
            min(vocab_size, first.vocab_size),
            first.stop_ids,
            valid,
            parts_for(position),
        )
    except MatcherError as exc:
        raise MatcherError(owners[exc.request_index], exc.error) from exc.error
    record_build(
        [(owners[i], seconds) for i, seconds in walks],
        position,
        walk_seconds=perf_counter() - began,
        checked_nodes=checked,
        rejected_nodes=rejected,
    )
    return True


def _reason_along(
    tokens: list[int],
    free: np.ndarray,
    checked: _Checked,
    vocab_size: int,
    mask: np.ndarray,
    valid: np.ndarray,
    start: int,
) -> int:
    """Walk a reasoning chain (``tokens``, its rows from ``start``): free-text rows and valid
    flags while it reasons. Returns the node whose token ends the reasoning (the grammar's
    part starts there), or -1 when the chain ends or a token is refused first (the rows left
    are all-allowed, their nodes not valid)."""
    n = len(tokens)
    mask[start] = free
    valid[start] = True
    for j in range(1, n):
        token = tokens[j]
        if not (0 <= token < vocab_size and (int(free[token >> 5]) >> (token & 31)) & 1):
            mask[start + j : start + n] = ALL_ALLOWED
            return -1
        valid[start + j] = True
        if token in checked.ends or token in checked.content_ends:
            return j
        mask[start + j] = free
    return -1


# A reasoning matcher stands at its start state (it has consumed nothing of the answer), so
# its free-text row never changes while it reasons: kept per matcher object.
_free_row_cache: IdentityCache[tuple[frozenset[int], np.ndarray]] = IdentityCache()


def _free_rows(
    build: Any,
    grammars: Sequence[Any],
    requests: list[int],
    checked: _Checked,
    vocab_size: int,
    words: int,
) -> list[np.ndarray]:
    """The free-text row of each reasoning request (``requests``: batch indices into
    ``grammars``): all allowed but the content end tokens its grammar refuses first (read off
    its first mask, one one-node build for those not cached; none without content end
    tokens). A failing matcher is named by its batch index."""
    matchers = [grammars[b] for b in requests]
    everything = np.full(words, ALL_ALLOWED, dtype=np.int32)
    if not checked.content_ends:
        return [everything] * len(matchers)
    rows: list[np.ndarray | None] = []
    missing = []
    for k, matcher in enumerate(matchers):
        cached = _free_row_cache.get(matcher)
        hit = cached is not None and cached[0] == checked.content_ends and len(cached[1]) == words
        rows.append(cached[1] if hit else None)  # type: ignore[index]
        if not hit:
            missing.append(k)
    if missing:
        zeros = np.zeros((len(missing), 1), dtype=np.int64)
        single = GrammarTree.from_host(zeros - 1, zeros - 1, zeros)
        try:
            firsts = build([matchers[k] for k in missing], single, vocab_size)
        except MatcherError as exc:
            request = requests[missing[exc.request_index]]
            raise MatcherError(request, exc.error) from exc.error
        for k, first in zip(missing, firsts.reshape(len(missing), words), strict=True):
            rows[k] = _free_row(first, checked.content_ends, words)
            _free_row_cache.put(matchers[k], (checked.content_ends, rows[k]))
    return rows  # type: ignore[return-value]


def _free_row(first: np.ndarray, content_ends: frozenset[int], words: int) -> np.ndarray:
    """The reasoning row: all allowed but the content end tokens the grammar refuses first."""
    row = np.full(words, ALL_ALLOWED, dtype=np.int32)
    bits = row.view(np.uint32)
    for token in content_ends:
        if not (int(first[token >> 5]) >> (token & 31)) & 1:
            bits[token >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (token & 31)))
    return row


def _reasoning_walk(
    b: int,
    next_token: list[int],
    next_sibling: list[int],
    draft: list[int],
    block: np.ndarray,
    valid: np.ndarray,
    free: np.ndarray,
    checked: _Checked,
    vocab_size: int,
) -> list[_SubTree]:
    """Write the free-text rows of request ``b`` (its block is all-allowed beforehand), mark
    the nodes accepted while reasoning in ``valid`` (its ``[nodes]`` row) and return the
    grammar sub-trees hanging below the nodes that end the reasoning."""
    found: list[_SubTree] = []
    block[0] = free
    valid[0] = True
    frontier = [0]
    while frontier:
        following = []
        for v in frontier:
            c = next_token[v]
            while c != -1:
                token = draft[c]
                allowed = 0 <= token < vocab_size and (int(free[token >> 5]) >> (token & 31)) & 1
                if allowed:
                    valid[c] = True
                    if token in checked.ends:
                        found.append(_subtree(b, c, next_token, next_sibling, draft, False))
                    elif token in checked.content_ends:
                        found.append(_subtree(b, c, next_token, next_sibling, draft, True))
                    else:
                        block[c] = free
                        following.append(c)
                c = next_sibling[c]
        frontier = following
    return found


def _subtree(
    b: int,
    head: int,
    next_token: list[int],
    next_sibling: list[int],
    draft: list[int],
    consumed: bool,
) -> _SubTree:
    """The sub-tree below ``head``, renumbered: ``head`` is node 0, or node 1 below a virtual
    start (``consumed``: the head's token is the grammar's first)."""
    order = [head]
    i = 0
    while i < len(order):  # breadth first: every node after its parent
        c = next_token[order[i]]
        while c != -1:
            order.append(c)
            c = next_sibling[c]
        i += 1
    offset = 1 if consumed else 0
    local = {v: k + offset for k, v in enumerate(order)}
    size = len(order) + offset
    nt = [-1] * size
    ns = [-1] * size
    dt = [0] * size
    for v in order:
        k = local[v]
        dt[k] = draft[v]
        if next_token[v] != -1:
            nt[k] = local[next_token[v]]
        if v != head and next_sibling[v] != -1:
            ns[k] = local[next_sibling[v]]
    if consumed:
        nt[0] = 1
    return _SubTree(b, ([-1] if consumed else []) + order, nt, ns, dt)


def _build_subtrees(
    build: Any,
    grammars: Sequence[Any],
    subtrees: list[list[_SubTree]],
    mask: np.ndarray,
    valid: np.ndarray,
    spans: list[tuple[int, int]],
    vocab_size: int,
) -> None:
    """Build every sub-tree with its request's matcher, one per matcher per round, and copy
    the rows (and which nodes the grammar accepts, into the flat ``valid``) into place; the
    rows of request ``b`` start at ``spans[b][0]``. A failing matcher is named by its request
    index."""
    rounds = max((len(s) for s in subtrees), default=0)
    for r in range(rounds):
        batch = [s[r] for s in subtrees if len(s) > r]
        width = max(len(sub.nodes) for sub in batch)
        shape = (len(batch), width)
        nt = np.full(shape, -1, dtype=np.int64)
        ns = np.full(shape, -1, dtype=np.int64)
        dt = np.zeros(shape, dtype=np.int64)
        for k, sub in enumerate(batch):
            n = len(sub.nodes)
            nt[k, :n], ns[k, :n], dt[k, :n] = sub.next_token, sub.next_sibling, sub.draft
        matchers = [grammars[sub.request] for sub in batch]
        try:
            rows, accepted = build(
                matchers, GrammarTree.from_host(nt, ns, dt), vocab_size, return_valid=True
            )
        except MatcherError as exc:
            raise MatcherError(batch[exc.request_index].request, exc.error) from exc.error
        for k, sub in enumerate(batch):
            local = np.asarray(sub.nodes)
            keep = local >= 0
            start = spans[sub.request][0]
            mask[start + local[keep]] = rows[k * width + np.flatnonzero(keep)]
            valid[start + local[keep]] = accepted[k, np.flatnonzero(keep)]
