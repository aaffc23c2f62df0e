"""An independent reference for the row contract, and matcher helpers for the tests.

The oracle shares no code with the library: it derives each node's parent with a plain loop
over the links, and for every node replays the root path on a *fresh* matcher (built from the
compiled grammar and the request's prefix): no depth-first walk, no rollback, no C++ tree
traversal. It is slow on purpose and only used on small trees.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xgrammar as xgr


def words(vocab: int) -> int:
    return -(-vocab // 32)


def parents_of(next_token: Sequence[int], next_sibling: Sequence[int]) -> list[int]:
    """Parent of every node (-1: root or unreachable), by a plain loop over first-child
    links and their sibling chains (trees are assumed valid)."""
    n = len(next_token)
    parent = [-1] * n
    for u in range(n):
        c = next_token[u]
        steps = 0
        while c != -1 and steps <= n:
            parent[c] = u
            c = next_sibling[c]
            steps += 1
    # nodes not reachable from the root have no parent
    reach = [False] * n
    reach[0] = True
    changed = True
    while changed:
        changed = False
        for v in range(n):
            if not reach[v] and parent[v] != -1 and reach[parent[v]]:
                reach[v] = True
                changed = True
    return [p if reach[v] else -1 for v, p in enumerate(parent)]


def allowed_bit(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


@dataclass
class Request:
    """A request's grammar: how to build a fresh matcher in its starting state."""

    compiled: Any
    prefix: list[int] = field(default_factory=list)

    def fresh(self) -> xgr.GrammarMatcher:
        """A matcher in the request's starting state, as the oracle uses it (xgrammar's
        interface: ``fill_next_token_bitmask``, ``accept_token``, ``is_terminated``, ``fork``)."""
        m = xgr.GrammarMatcher(self.compiled)
        for t in self.prefix:
            if not m.accept_token(t):
                raise AssertionError(f"prefix token {t} rejected")
        return m

    def native(self) -> Any:
        """The engine's own object in the starting state: what the library is given."""
        return self.fresh()


def fill_row(matcher: Any, grammar_words: int, vocab: int) -> np.ndarray:
    """The matcher's mask, widened/narrowed to the model's ``vocab`` (bits past the
    grammar's words are 0)."""
    buf = np.zeros((1, grammar_words), dtype=np.int32)
    matcher.fill_next_token_bitmask(buf, 0)
    row = np.zeros(words(vocab), dtype=np.int32)
    row[:grammar_words] = buf[0]
    return row


def root_path(parent: Sequence[int], j: int) -> list[int]:
    """The nodes from the root's child down to ``j`` (empty for the root)."""
    path = []
    while j != 0:
        path.append(j)
        j = parent[j]
    path.reverse()
    return path


def replay(
    fresh: Callable[[], Any],
    path: Sequence[int],
    draft: Sequence[int],
    vocab: int,
    grammar_words: int,
) -> tuple[bool, Any]:
    """Replay ``path`` on a fresh matcher: ``(accepted, matcher)``; ``accepted`` is True when
    every token of the path is in range, allowed by the row before it and accepted by the
    matcher, with no terminated node above the last one. The matcher is left after the path
    (or where it stopped)."""
    m = fresh()
    limit = min(vocab, 32 * grammar_words)
    for v in path:
        if m.is_terminated():
            return False, m
        t = int(draft[v])
        if not (0 <= t < limit and allowed_bit(fill_row(m, grammar_words, vocab), t)):
            return False, m
        if not m.accept_token(t):  # allowed by the mask, refused by the matcher
            return False, m
    return True, m


def expected_rows(
    fresh: Callable[[], Any] | None,
    next_token: Sequence[int],
    next_sibling: Sequence[int],
    draft: Sequence[int],
    vocab: int,
    grammar_words: int,
) -> np.ndarray:
    """Expected ``[nodes, words(vocab)]`` rows of one request by per-node path replay: the
    grammar's row for an accepted, non-terminated node, all-allowed (-1) otherwise."""
    return expected_rows_and_live(fresh, next_token, next_sibling, draft, vocab, grammar_words)[0]


def expected_rows_and_live(
    fresh: Callable[[], Any] | None,
    next_token: Sequence[int],
    next_sibling: Sequence[int],
    draft: Sequence[int],
    vocab: int,
    grammar_words: int,
) -> tuple[np.ndarray, list[bool]]:
    """:func:`expected_rows` and, per node, whether it is accepted and not terminated (its
    row is the grammar's mask, whatever that mask is)."""
    n = len(next_token)
    rows = np.full((n, words(vocab)), -1, dtype=np.int32)
    live = [False] * n
    if fresh is None:
        return rows, live
    parent = parents_of(next_token, next_sibling)
    for j in range(n):
        if j != 0 and parent[j] == -1:
            continue  # padding: no link reaches it
        accepted, m = replay(fresh, root_path(parent, j), draft, vocab, grammar_words)
        if accepted and not m.is_terminated():
            rows[j] = fill_row(m, grammar_words, vocab)
            live[j] = True
    return rows, live


def expected_accepted(
    fresh: Callable[[], Any] | None,
    next_token: Sequence[int],
    next_sibling: Sequence[int],
    draft: Sequence[int],
    vocab: int,
    grammar_words: int,
) -> list[bool]:
    """Which nodes of one request the grammar accepts, by per-node path replay (terminated
    nodes included). Unconstrained requests accept every node a link reaches; padding no
    link reaches is never accepted."""
    parent = parents_of(next_token, next_sibling)
    accepted = [False] * len(next_token)
    for j in range(len(next_token)):
        if j != 0 and parent[j] == -1:
            continue
        if fresh is None:
            accepted[j] = True
        else:
            accepted[j] = replay(fresh, root_path(parent, j), draft, vocab, grammar_words)[0]
    return accepted


def _per_request(
    expect: Callable[..., Any],
    requests: Sequence[Request | None],
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    vocab: int,
    grammar_words: int,
) -> list[Any]:
    return [
        expect(
            None if r is None else r.fresh,
            next_token[b].tolist(),
            next_sibling[b].tolist(),
            draft[b].tolist(),
            vocab,
            grammar_words,
        )
        for b, r in enumerate(requests)
    ]


def expected_valid(
    requests: Sequence[Request | None],
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    vocab: int,
    grammar_words: int,
) -> np.ndarray:
    """bool ``[batch, nodes]`` of :func:`expected_accepted` per request."""
    arrays = (next_token, next_sibling, draft, vocab, grammar_words)
    return np.array(_per_request(expected_accepted, requests, *arrays), dtype=bool)


def expected_mask(
    requests: Sequence[Request | None],
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    vocab: int,
    grammar_words: int,
) -> np.ndarray:
    """Expected ``[batch * nodes, words(vocab)]`` mask for a batch."""
    arrays = (next_token, next_sibling, draft, vocab, grammar_words)
    return np.concatenate(_per_request(expected_rows, requests, *arrays), axis=0)


def expected_compact(
    requests: Sequence[Request | None],
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    vocab: int,
    grammar_words: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Expected compact entries of a batch: ``(rows, bits)``, the global row ``b * nodes + j``
    of every accepted, non-terminated node of a constrained request, ascending, and its row."""
    nodes = next_token.shape[1]
    listed, bits = [], []
    for b, r in enumerate(requests):
        if r is None:
            continue
        block, live = expected_rows_and_live(
            r.fresh,
            next_token[b].tolist(),
            next_sibling[b].tolist(),
            draft[b].tolist(),
            vocab,
            grammar_words,
        )
        for j in range(nodes):
            if live[j]:
                listed.append(b * nodes + j)
                bits.append(block[j])
    shape = (len(bits), words(vocab))
    return np.array(listed, dtype=np.int32), np.array(bits, dtype=np.int32).reshape(shape)


def assert_compact_matches(case: Any, grammar_words: int, mask: Any) -> None:
    """A host CompactMask for a drawn case equals the oracle's entries (rows ascending, only
    accepted non-terminated nodes listed) and expands to the oracle's dense mask."""
    if all(r is None for r in case.requests):
        assert mask is None
        return
    arrays = (case.next_token, case.next_sibling, case.draft)
    rows, bits = expected_compact(case.requests, *arrays, case.vocab_size, grammar_words)
    count = mask.count
    assert count == len(rows), (count, len(rows))
    np.testing.assert_array_equal(np.asarray(mask.rows)[:count], rows)
    np.testing.assert_array_equal(np.asarray(mask.bits)[:count], bits)
    assert (np.asarray(mask.rows)[count:] == mask.num_rows).all()  # padding applies to nothing
    want = expected_mask(case.requests, *arrays, case.vocab_size, grammar_words)
    np.testing.assert_array_equal(mask.to_dense(), want)


def expected_node_counts(
    requests: Sequence[Request | None],
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    vocab: int,
    grammar_words: int,
) -> tuple[int, int]:
    """``(checked, rejected)`` over a batch by per-node replay: a draft node is checked when
    its parent's root path is accepted and leaves the matcher live, rejected when, in
    addition, its token is out of range, not allowed by the parent's row, or refused."""
    checked = rejected = 0
    limit = min(vocab, 32 * grammar_words)
    for b, request in enumerate(requests):
        if request is None:
            continue
        dt = draft[b].tolist()
        parent = parents_of(next_token[b].tolist(), next_sibling[b].tolist())
        for j in range(1, len(parent)):
            p = parent[j]
            if p == -1:
                continue
            accepted, m = replay(request.fresh, root_path(parent, p), dt, vocab, grammar_words)
            if not accepted or m.is_terminated():
                continue
            checked += 1
            t = dt[j]
            if not (
                0 <= t < limit and allowed_bit(fill_row(m, grammar_words, vocab), t)
            ) or not m.accept_token(t):
                rejected += 1
    return checked, rejected


def matcher_state(matcher: Any, probe_tokens: Sequence[int], grammar_words: int) -> tuple:
    """A fingerprint of an xgrammar matcher's state: termination, its mask, and which probe
    tokens it would accept (tested on forks)."""
    terminated = matcher.is_terminated()
    if terminated:
        return (True,)
    buf = np.zeros((1, grammar_words), dtype=np.int32)
    matcher.fill_next_token_bitmask(buf, 0)
    accepts = tuple(matcher.fork().accept_token(int(t)) for t in probe_tokens)
    return (False, buf.tobytes(), accepts)


class ProtocolMatcher:
    """A pure-Python matcher following the library's protocol, delegating to xgrammar
    (exercises the iterative Python walk). Records every call and the net depth."""

    def __init__(self, inner: Any, vocab_size: int | None = None) -> None:
        self.inner = inner
        self.calls: list[tuple] = []
        self.depth = 0
        if vocab_size is not None:
            self.vocab_size = vocab_size

    def accept_token(self, token_id: int) -> bool:
        self.calls.append(("accept", token_id))
        ok = self.inner.accept_token(token_id)
        if ok:
            self.depth += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        self.calls.append(("rollback", num_tokens))
        self.inner.rollback(num_tokens)
        self.depth -= num_tokens

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> bool:
        self.calls.append(("fill", index))
        return self.inner.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


class GatedMatcher(ProtocolMatcher):
    """Blocks in its first fill until ``gate`` is set: keeps a build pending on demand
    (``entered`` is set once the build reached the fill)."""

    def __init__(self, inner: Any, gate: threading.Event) -> None:
        super().__init__(inner)
        self.gate = gate
        self.entered = threading.Event()

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> bool:
        self.entered.set()
        assert self.gate.wait(600), "the test never opened the gate"  # a hang guard only
        return super().fill_next_token_bitmask(bitmask, index)


class FailingMatcher(ProtocolMatcher):
    """Raises inside ``accept_token`` or ``fill_next_token_bitmask`` on the k-th call."""

    def __init__(self, inner: Any, *, fail_in: str, at_call: int) -> None:
        super().__init__(inner)
        self.fail_in = fail_in
        self.at_call = at_call
        self.counts = {"accept": 0, "fill": 0}

    def _maybe_fail(self, kind: str) -> None:
        if kind == self.fail_in:
            self.counts[kind] += 1
            if self.counts[kind] == self.at_call:
                raise RuntimeError(f"injected failure in {kind} #{self.at_call}")

    def accept_token(self, token_id: int) -> bool:
        self._maybe_fail("accept")
        return super().accept_token(token_id)

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> bool:
        self._maybe_fail("fill")
        return super().fill_next_token_bitmask(bitmask, index)


def assert_mask_matches(case: Any, grammar_words: int, mask: np.ndarray | None) -> None:
    """The builder's mask for a drawn case (``_cases.Case``) equals the oracle's, bit for bit
    (``None`` exactly when no request has a grammar)."""
    if all(r is None for r in case.requests):
        assert mask is None
        return
    want = expected_mask(
        case.requests,
        case.next_token,
        case.next_sibling,
        case.draft,
        case.vocab_size,
        grammar_words,
    )
    assert mask is not None and mask.dtype == np.int32
    assert mask.shape == want.shape
    bad = np.flatnonzero((mask != want).any(axis=1))
    assert bad.size == 0, f"rows differing from the oracle: {bad.tolist()}"


def expected_reasoning_mask(
    requests: Sequence[Request | None],
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    vocab: int,
    grammar_words: int,
    active: Sequence[bool],
    ends: set[int],
    content_ends: set[int],
    with_valid: bool = False,
) -> Any:
    """The reasoning rule by per-node path replay: along each path of an active request the
    free-text row (all allowed but the content end tokens a fresh matcher refuses first)
    holds until an end token (grammar after it) or a content end token (the grammar's first
    token); from there on, the grammar on a fresh matcher, as in :func:`expected_rows`."""
    width = words(vocab)
    limit = min(vocab, 32 * grammar_words)
    blocks = []
    valid = []
    for b, request in enumerate(requests):
        nt, ns, dt = next_token[b].tolist(), next_sibling[b].tolist(), draft[b].tolist()
        if request is None or not active[b]:
            fresh = None if request is None else request.fresh
            blocks.append(expected_rows(fresh, nt, ns, dt, vocab, grammar_words))
            valid.append(expected_accepted(fresh, nt, ns, dt, vocab, grammar_words))
            continue
        start = request.fresh()
        free = np.full(width, -1, dtype=np.int32)
        if not start.is_terminated():
            first = fill_row(start, grammar_words, vocab)
            for t in content_ends:
                if not allowed_bit(first, t):
                    free.view(np.uint32)[t // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (t % 32)))
        parent = parents_of(nt, ns)
        rows = np.full((len(nt), width), -1, dtype=np.int32)
        accepted = [False] * len(nt)
        for j in range(len(nt)):
            if j != 0 and parent[j] == -1:
                continue
            path = root_path(parent, j)
            state, m, alive = "reasoning", None, True
            ok = True  # every node of the path so far was accepted
            for v in path:
                t = dt[v]
                if not alive:
                    ok = False
                    break
                if state == "reasoning":
                    if not (0 <= t < vocab and allowed_bit(free, t)):
                        alive = ok = False
                        break
                    if t in ends:
                        state, m = "grammar", request.fresh()
                        alive = not m.is_terminated()
                    elif t in content_ends:
                        state, m = "grammar", request.fresh()
                        if not m.accept_token(t):
                            alive = ok = False
                            break
                        alive = not m.is_terminated()
                    continue
                row = fill_row(m, grammar_words, vocab)
                if not (0 <= t < limit and allowed_bit(row, t)) or not m.accept_token(t):
                    alive = ok = False
                    break
                alive = not m.is_terminated()
            accepted[j] = ok
            if not alive:
                continue
            rows[j] = free if state == "reasoning" else fill_row(m, grammar_words, vocab)
        blocks.append(rows)
        valid.append(accepted)
    mask = np.concatenate(blocks, axis=0)
    return (mask, np.array(valid, dtype=bool)) if with_valid else mask
