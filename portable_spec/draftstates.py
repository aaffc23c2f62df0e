"""One request's grammar state at the nodes of a draft tree that grows level by level.

:class:`portable_spec.DraftSession` asks, for every new node whose parent is live and whose
token the parent's row allows, what the grammar makes of it: rejected, accepted and
terminated (the end token), or accepted and live (then the node's row is written). How the
state of a node is kept depends on what the matcher can do:

======================  =====================================================  =============
matcher                 state kept per live node                               cost per node
======================  =====================================================  =============
xgrammar                a ``fork()`` that accepted the node's token            fork + accept
                                                                               + fill
protocol + ``fork()``   the same, through the protocol's methods               same
llguidance              a ``deep_copy()`` that consumed the node's token       same
protocol, no fork       nothing: the one matcher is moved to each parent       accept + fill
                        (rollback to the common prefix, accept the rest),      + rollback,
                        tries each child, and is rolled back to its start at   plus path
                        the end of every level                                 moves
outlines-core Guide     the same, with ``advance`` / ``rollback_state`` (rows  same
                        kept by guide state, as the builder keeps them)
======================  =====================================================  =============

Forks make a level cost proportional to its new nodes. Without forks, a level costs
``sum(depth of its parents)`` accepts and rollbacks on top of one accept per new node
(moves between parents visited in depth-first order only replay the part of the path that
differs), and the matcher is moved while the level is processed (restored before the call
returns, also when it raises). The matchers given to the session are never moved by the
forking engines.

Rows follow the row contract of :func:`portable_spec.build_host_bitmask`: every engine
writes the same bits the builder writes for the same root path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec.engines import walk
from portable_spec.engines.base import MatcherInfo
from portable_spec.engines.generic import take_token as take_protocol_token
from portable_spec.engines.llguidance import ended as llguidance_ended
from portable_spec.engines.llguidance import take_token as take_llguidance_token
from portable_spec.engines.outlines import state_rows
from portable_spec.grammars import GENERIC, LLGUIDANCE, OUTLINES, XGRAMMAR

__all__ = ["LIVE", "REJECTED", "TERMINATED", "NodeStates", "node_states"]

#: outcomes of a candidate node (its parent live, its token allowed by the parent's row)
REJECTED, TERMINATED, LIVE = 0, 1, 2
# the engines' walk outcomes as node outcomes
_OUTCOMES = {
    walk.REFUSED: REJECTED,
    walk.ENDED_FREE: TERMINATED,
    walk.ENDED_HELD: TERMINATED,
    walk.LIVE: LIVE,
}


class NodeStates(ABC):
    """The grammar state of one request at the live nodes of its growing tree.

    Args:
        matcher: the request's matcher, in the state after its committed tokens. Forking
            engines never move it; replaying engines move it only inside :meth:`grow` and
            :meth:`forced` and restore it before they return.
        info: the builder's facts about the matcher (width, vocabulary, stop tokens).
        words: the model's row width (int32 words); rows narrower matchers write are zero
            past their own width.
    """

    #: deepest node (draft tokens below the root) the engine can reach; None: unbounded
    max_depth: int | None = None

    def __init__(self, matcher: Any, info: MatcherInfo, words: int) -> None:
        self.matcher = matcher
        self.info = info
        self.words = words
        self._scratch: np.ndarray | None = None

    @abstractmethod
    def start(self, rows: np.ndarray) -> bool:
        """Write the root's row into ``rows[0]`` (``rows``: this request's C-contiguous int32
        ``[capacity, words]`` block). Returns False when the matcher is terminated (nothing
        written: the caller makes every row all-allowed)."""

    @abstractmethod
    def grow(
        self,
        items: Sequence[tuple[int, int, int]],
        rows: np.ndarray,
        parents: np.ndarray,
        tokens: np.ndarray,
    ) -> list[int]:
        """Decide the candidate nodes ``items`` = ``(node, parent, token)`` of one level.

        Every parent is live and every token is allowed by its parent's row. Writes the row
        of each node found LIVE into ``rows[node]``. ``parents``/``tokens`` are the request's
        int64 ``[capacity]`` tree so far (replaying engines walk root paths with them).
        Returns one outcome (:data:`REJECTED`, :data:`TERMINATED`, :data:`LIVE`) per item.
        """

    @abstractmethod
    def forced(
        self, node: int, parents: np.ndarray, tokens: np.ndarray, rows: np.ndarray, most: int
    ) -> list[int]:
        """The grammar's forced continuation after live node ``node``: at most ``most``
        tokens every output must continue with (possibly none)."""

    def discard(self, first: int) -> None:  # noqa: B027 (optional hook)
        """Forget what is kept for nodes ``>= first`` (a level that failed)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what is kept (forks)."""

    # -- rows -----------------------------------------------------------------------------------
    def _row_target(self, rows: np.ndarray, node: int) -> tuple[np.ndarray, int]:
        """Where to fill ``node``'s row: ``(array, index)`` (a scratch row for a matcher
        narrower than the model)."""
        if self.info.words == self.words:
            return rows, node
        if self._scratch is None:
            self._scratch = np.zeros((1, self.info.words), dtype=np.int32)
        return self._scratch, 0

    def _finish_row(self, rows: np.ndarray, node: int, target: np.ndarray) -> None:
        """Copy a scratch row in place (zeros past the matcher's width)."""
        if target is not rows:
            rows[node, : self.info.words] = target[0]
            rows[node, self.info.words :] = 0


def _path(node: int, parents: np.ndarray) -> list[int]:
    """Nodes from the root's first child down to ``node`` (empty for the root)."""
    path = []
    while node > 0:
        path.append(node)
        node = int(parents[node])
    path.reverse()
    return path


# -- engines that fork ------------------------------------------------------------------------
class _ForkStates(NodeStates):
    """xgrammar matchers, and protocol matchers whose ``fork()`` gives an independent matcher
    of the same type: one accepted fork per live node."""

    def __init__(self, matcher: Any, info: MatcherInfo, words: int, *, protocol: bool) -> None:
        super().__init__(matcher, info, words)
        self.states: dict[int, Any] = {}
        # a protocol matcher's rows may carry bits past its vocabulary: the contract says 0
        self._tail = None
        if protocol and info.vocab_size % 32:
            self._tail = np.int32((1 << (info.vocab_size % 32)) - 1)

    def _fill(self, state: Any, rows: np.ndarray, node: int) -> None:
        target, index = self._row_target(rows, node)
        state.fill_next_token_bitmask(target, index)
        self._finish_row(rows, node, target)
        if self._tail is not None:
            rows[node, self.info.words - 1] &= self._tail

    def start(self, rows: np.ndarray) -> bool:
        if self.matcher.is_terminated():
            return False
        self._fill(self.matcher, rows, 0)
        self.states[0] = self.matcher
        return True

    def grow(
        self,
        items: Sequence[tuple[int, int, int]],
        rows: np.ndarray,
        parents: np.ndarray,
        tokens: np.ndarray,
    ) -> list[int]:
        states = self.states
        outcomes = []
        for node, parent, token in items:
            state = states[parent].fork()
            outcome = _OUTCOMES[take_protocol_token(state, token)]
            if outcome == LIVE:
                self._fill(state, rows, node)
                states[node] = state
            outcomes.append(outcome)
        return outcomes

    def forced(
        self, node: int, parents: np.ndarray, tokens: np.ndarray, rows: np.ndarray, most: int
    ) -> list[int]:
        find = getattr(self.states[node], "find_jump_forward_tokens", None)
        return [int(t) for t in find()][:most] if callable(find) else []

    def discard(self, first: int) -> None:
        for node in [n for n in self.states if n >= first]:
            del self.states[node]

    def close(self) -> None:
        self.states.clear()


class _LLGuidanceStates(NodeStates):
    """``llguidance.LLMatcher``: one ``deep_copy()`` per live node that consumed its token.

    As in the builder's walk: a node whose parent is *stopped* (the grammar is complete, only
    the end token may follow) is terminated without consuming anything, and a node whose
    token makes the stop reason ``EndOfSentence`` is terminated."""

    def __init__(self, matcher: Any, info: MatcherInfo, words: int) -> None:
        super().__init__(matcher, info, words)
        self.states: dict[int, Any] = {}
        self.stopped: dict[int, bool] = {}

    def _fill(self, state: Any, rows: np.ndarray, node: int) -> None:
        target, index = self._row_target(rows, node)
        row = target[index]
        state.unsafe_compute_mask_ptr(row.ctypes.data, self.info.words * 4)
        self._finish_row(rows, node, target)

    def start(self, rows: np.ndarray) -> bool:
        if llguidance_ended(self.matcher):
            return False
        self._fill(self.matcher, rows, 0)
        self.states[0] = self.matcher
        self.stopped[0] = bool(self.matcher.is_stopped())
        return True

    def grow(
        self,
        items: Sequence[tuple[int, int, int]],
        rows: np.ndarray,
        parents: np.ndarray,
        tokens: np.ndarray,
    ) -> list[int]:
        outcomes = []
        for node, parent, token in items:
            stopped = self.stopped[parent]
            state = self.states[parent] if stopped else self.states[parent].deep_copy()
            outcome = _OUTCOMES[take_llguidance_token(state, token, stopped)]
            if outcome == LIVE:
                self._fill(state, rows, node)
                self.states[node] = state
                self.stopped[node] = bool(state.is_stopped())
            outcomes.append(outcome)
        return outcomes

    def forced(
        self, node: int, parents: np.ndarray, tokens: np.ndarray, rows: np.ndarray, most: int
    ) -> list[int]:
        return [int(t) for t in self.states[node].compute_ff_tokens()][:most]

    def discard(self, first: int) -> None:
        for node in [n for n in self.states if n >= first]:
            del self.states[node]
            del self.stopped[node]

    def close(self) -> None:
        self.states.clear()
        self.stopped.clear()


# -- engines that replay paths -----------------------------------------------------------------
class _ReplayStates(NodeStates):
    """One matcher moved along root paths: to each parent of a level (depth-first order,
    replaying only what differs from the previous parent's path), each child tried with one
    step forward and back, and the matcher back at its start before :meth:`grow` returns."""

    def _advance(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def _back(self, count: int) -> None:
        self.matcher.rollback(count)

    @abstractmethod
    def _try(self, token: int, rows: np.ndarray, node: int) -> int:
        """Try one child from the current position; leave the matcher where it was."""

    def _visit(
        self, groups: dict[int, list[tuple[int, Any]]], parents: np.ndarray, tokens: np.ndarray
    ) -> None:
        """Move to each parent of ``groups`` in depth-first order and call its children's
        callbacks there; the matcher is back at its start afterwards."""
        paths = {p: _path(p, parents) for p in groups}
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
        outcomes = [REJECTED] * len(items)
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
            most = min(most, self.max_depth - len(_path(node, parents)))

        def here() -> None:
            found.extend(self._forced_here(rows[node], most))

        self._visit({node: [(0, here)]}, parents, tokens)
        return found

    @abstractmethod
    def _forced_here(self, row: np.ndarray, most: int) -> list[int]:
        """At most ``most`` forced tokens from the current position (``row``: its mask)."""


class _ProtocolReplayStates(_ReplayStates):
    """Protocol matchers without a usable ``fork()``."""

    def __init__(self, matcher: Any, info: MatcherInfo, words: int) -> None:
        super().__init__(matcher, info, words)
        self._tail = np.int32((1 << (info.vocab_size % 32)) - 1) if info.vocab_size % 32 else None

    def _fill(self, rows: np.ndarray, node: int) -> None:
        target, index = self._row_target(rows, node)
        self.matcher.fill_next_token_bitmask(target, index)
        self._finish_row(rows, node, target)
        if self._tail is not None:
            rows[node, self.info.words - 1] &= self._tail

    def start(self, rows: np.ndarray) -> bool:
        if self.matcher.is_terminated():
            return False
        self._fill(rows, 0)
        return True

    def _try(self, token: int, rows: np.ndarray, node: int) -> int:
        outcome = _OUTCOMES[take_protocol_token(self.matcher, token)]
        if outcome == REJECTED:
            return REJECTED
        try:
            if outcome == LIVE:
                self._fill(rows, node)
            return outcome
        finally:
            self.matcher.rollback(1)

    def _forced_here(self, row: np.ndarray, most: int) -> list[int]:
        find = getattr(self.matcher, "find_jump_forward_tokens", None)
        return [int(t) for t in find()][:most] if callable(find) else []


class _OutlinesStates(_ReplayStates):
    """``outlines_core.Guide``: ``advance`` / ``rollback_state``; an allowed token that does
    not advance below a final state is the end token (terminated), anywhere else it is
    rejected. Rows are kept by guide state across calls, as the builder's walk keeps them."""

    def __init__(self, matcher: Any, info: MatcherInfo, words: int) -> None:
        super().__init__(matcher, info, words)
        self.max_depth = info.max_depth

    def _advance(self, token: int) -> bool:
        try:
            self.matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def _back(self, count: int) -> None:
        self.matcher.rollback_state(count)

    def _fill(self, rows: np.ndarray, node: int) -> None:
        guide = self.matcher
        state = guide.get_state()
        cached = state_rows.get(guide, state, self.words)
        if cached is None:
            guide.write_mask_into(rows[node].ctypes.data, self.words, 4)
            state_rows.put(guide, state, rows[node])
        else:
            rows[node] = cached

    def start(self, rows: np.ndarray) -> bool:
        self._fill(rows, 0)
        return True

    def _try(self, token: int, rows: np.ndarray, node: int) -> int:
        if not self._advance(token):
            return TERMINATED if self.matcher.is_finished() else REJECTED
        try:
            self._fill(rows, node)
            return LIVE
        finally:
            self.matcher.rollback_state(1)

    def _forced_here(self, row: np.ndarray, most: int) -> list[int]:
        """Tokens that are the only one their state allows (outlines-core has no forced
        continuation of its own); stops at final states, where the text may end."""
        found: list[int] = []
        guide = self.matcher
        scratch = np.empty(self.words, dtype=np.int32)
        current = row
        moved = 0
        try:
            while moved < most and not guide.is_finished():
                token = _single_token(current)
                if token is None or not self._advance(token):
                    break
                moved += 1
                found.append(token)
                state = guide.get_state()
                cached = state_rows.get(guide, state, self.words)
                if cached is None:
                    guide.write_mask_into(scratch.ctypes.data, self.words, 4)
                    cached = scratch
                current = cached
        finally:
            if moved:
                guide.rollback_state(moved)
        return found


def _single_token(row: np.ndarray) -> int | None:
    """The token of a row that allows exactly one, else None."""
    words = np.flatnonzero(row)
    if len(words) != 1:
        return None
    word = int(row[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(words[0]) * 32 + word.bit_length() - 1


def node_states(kind: int, matcher: Any, info: MatcherInfo, words: int) -> NodeStates:
    """The state keeper for a matcher of ``kind`` (as classified by
    :func:`portable_spec.grammars.classify_grammars`)."""
    if kind == XGRAMMAR:
        return _ForkStates(matcher, info, words, protocol=False)
    if kind == LLGUIDANCE:
        return _LLGuidanceStates(matcher, info, words)
    if kind == OUTLINES:
        return _OutlinesStates(matcher, info, words)
    if kind == GENERIC:
        fork = getattr(matcher, "fork", None)
        if callable(fork) and _forks_faithfully(matcher):
            return _ForkStates(matcher, info, words, protocol=True)
        return _ProtocolReplayStates(matcher, info, words)
    raise ValueError(f"no draft states for matcher kind {kind}")


def _forks_faithfully(matcher: Any) -> bool:
    """Whether ``matcher.fork()`` returns an object of the matcher's own type (an xgrammar
    subclass overriding the protocol gets a plain ``GrammarMatcher`` back: its overrides would
    be lost on forks, so it is replayed instead)."""
    try:
        fork = matcher.fork()
    except Exception:
        return False
    return type(fork) is type(matcher)
