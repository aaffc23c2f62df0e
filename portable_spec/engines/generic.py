"""Matchers following :class:`portable_spec.GrammarMatcherLike`: the shared iterative walk,
and draft states by ``fork()`` (xgrammar's too) or by replaying root paths.

``accept_token``/``rollback``/``fill_next_token_bitmask``/``is_terminated`` are the moves;
:mod:`portable_spec.engines.walk` owns the row contract and the rollback bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import numpy as np

from portable_spec.engines.base import MatcherInfo, NodeStates
from portable_spec.engines.cursor import Cursor, whole_characters
from portable_spec.engines.walk import ENDED_HELD, LIVE, REFUSED, ReplayStates, walk_tree

__all__ = [
    "ForkStates",
    "ProtocolCursor",
    "ProtocolReplayStates",
    "generic_info",
    "generic_states",
    "take_token",
    "walk_generic",
]


def take_token(matcher: Any, token: int) -> int:
    """Take ``token``, which the parent's row allows, on a protocol matcher: a
    :mod:`portable_spec.engines.walk` outcome (``REFUSED`` when the matcher disagrees with its
    own mask, ``ENDED_HELD`` when it terminates, else ``LIVE``).

    Either the token is taken and an outcome returned, or nothing is held: if
    ``is_terminated`` raises after the token was accepted, the token is rolled back before the
    exception propagates (the caller has not counted it yet)."""
    if not matcher.accept_token(token):
        return REFUSED
    try:
        ended = matcher.is_terminated()
    except BaseException:
        matcher.rollback(1)
        raise
    return ENDED_HELD if ended else LIVE


class _ProtocolSteps:
    """A :class:`portable_spec.GrammarMatcherLike` object's moves for the shared walk."""

    def __init__(self, matcher: Any, rows: np.ndarray) -> None:
        self.matcher = matcher
        self.rows = rows

    def start(self) -> bool:
        return not self.matcher.is_terminated()  # a terminated matcher must not be filled

    def fill(self, node: int) -> None:
        self.matcher.fill_next_token_bitmask(self.rows, node)

    def advance(self, token: int, parent: int, node: int) -> int:
        return take_token(self.matcher, token)

    def rollback(self, count: int) -> None:
        self.matcher.rollback(count)


def walk_generic(
    matcher: Any,
    next_token: list[int],
    next_sibling: list[int],
    draft: list[int],
    rows: np.ndarray,
    vocab_limit: int,
) -> tuple[list[bool], int, int]:
    """Fill ``rows`` for one request of a protocol matcher by the shared iterative walk
    (:func:`portable_spec.engines.walk.walk_tree`: same arguments after ``matcher``, same
    result); ``rows`` is passed to ``fill_next_token_bitmask``."""
    steps = _ProtocolSteps(matcher, rows)
    return walk_tree(steps, next_token, next_sibling, draft, rows, vocab_limit)


def generic_info(matcher: Any, index: int, vocab_size: int) -> MatcherInfo:
    """The width of a protocol matcher: its optional ``vocab_size`` attribute, else the
    model's. Raises ``TypeError``/``ValueError`` naming ``matchers[index]``."""
    own = getattr(matcher, "vocab_size", None)
    if own is None:
        return MatcherInfo((vocab_size + 31) // 32, vocab_size)
    if isinstance(own, bool) or not isinstance(own, Integral) or own <= 0:
        raise TypeError(f"matchers[{index}].vocab_size must be a positive int, got {own!r}")
    own = int(own)
    if own > vocab_size:
        raise ValueError(
            f"vocab_size = {vocab_size} is smaller than the vocabulary of matchers[{index}] "
            f"({own} tokens)"
        )
    return MatcherInfo((own + 31) // 32, own)


# -- draft states ------------------------------------------------------------------------------
def _tail_word(info: MatcherInfo) -> np.int32 | None:
    """The bits of a protocol matcher's last word that lie inside its vocabulary (its rows may
    carry bits past it: the row contract says 0), or None when the vocabulary fills it."""
    if info.vocab_size % 32:
        return np.int32((1 << (info.vocab_size % 32)) - 1)
    return None


def _fill_row(
    states: NodeStates, matcher: Any, rows: np.ndarray, node: int, tail: np.int32 | None
) -> None:
    """Fill ``rows[node]`` from ``matcher`` (a scratch row for a narrower matcher), its last
    word cut to the matcher's vocabulary when ``tail`` says so."""
    target, index = states._row_target(rows, node)
    matcher.fill_next_token_bitmask(target, index)
    states._finish_row(rows, node, target)
    if tail is not None:
        rows[node, states.info.words - 1] &= tail


class ForkStates(NodeStates):
    """xgrammar matchers, and protocol matchers whose ``fork()`` gives an independent matcher
    of the same type: one accepted fork per live node (a level costs fork + accept + fill per
    new node); the session's matcher is never moved."""

    def __init__(self, matcher: Any, info: MatcherInfo, words: int, *, protocol: bool) -> None:
        super().__init__(matcher, info, words)
        self.states: dict[int, Any] = {}
        self._tail = _tail_word(info) if protocol else None

    def _fill(self, state: Any, rows: np.ndarray, node: int) -> None:
        _fill_row(self, state, rows, node, self._tail)

    def start(self, rows: np.ndarray) -> bool:
        if self.matcher.is_terminated():
            return False
        self._fill(self.matcher, rows, 0)
        self.states[0] = self.matcher
        return True

    def started(self) -> None:
        """The root's row was filled by a compiled walk (the matcher live): the matcher is
        the root's state, as after :meth:`start`."""
        self.states[0] = self.matcher

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
            outcome = take_token(state, token)
            if outcome == LIVE:
                self._fill(state, rows, node)
                states[node] = state
            outcomes.append(outcome)
        return outcomes

    def forced(
        self, node: int, parents: np.ndarray, tokens: np.ndarray, rows: np.ndarray, most: int
    ) -> list[int]:
        state = self._state_at(node, parents, tokens)
        find = getattr(state, "find_jump_forward_tokens", None)
        return [int(t) for t in find()][:most] if callable(find) else []

    def _state_at(self, node: int, parents: np.ndarray, tokens: np.ndarray) -> Any:
        """The fork at live ``node``: kept, or (a node whose rows a compiled walk computed)
        forked from its nearest kept ancestor and moved down its path, then kept."""
        state = self.states.get(node)
        if state is not None:
            return state
        path = []
        at = node
        while at not in self.states:
            path.append(at)
            at = int(parents[at])
        state = self.states[at].fork()
        for step in reversed(path):
            state.accept_token(int(tokens[step]))
        self.states[node] = state
        return state

    def discard(self, first: int) -> None:
        for node in [n for n in self.states if n >= first]:
            del self.states[node]

    def close(self) -> None:
        self.states.clear()


class ProtocolReplayStates(ReplayStates):
    """Protocol matchers without a usable ``fork()``: the one matcher is moved to each parent
    (see :class:`portable_spec.engines.walk.ReplayStates`)."""

    def __init__(self, matcher: Any, info: MatcherInfo, words: int) -> None:
        super().__init__(matcher, info, words)
        self._tail = _tail_word(info)

    def _fill(self, rows: np.ndarray, node: int) -> None:
        _fill_row(self, self.matcher, rows, node, self._tail)

    def start(self, rows: np.ndarray) -> bool:
        if self.matcher.is_terminated():
            return False
        self._fill(rows, 0)
        return True

    def _try(self, token: int, rows: np.ndarray, node: int) -> int:
        outcome = take_token(self.matcher, token)
        if outcome == REFUSED:
            return REFUSED
        try:
            if outcome == LIVE:
                self._fill(rows, node)
            return outcome
        finally:
            self.matcher.rollback(1)

    def _forced_here(self, row: np.ndarray, most: int) -> list[int]:
        find = getattr(self.matcher, "find_jump_forward_tokens", None)
        return [int(t) for t in find()][:most] if callable(find) else []


def generic_states(matcher: Any, info: MatcherInfo, words: int) -> NodeStates:
    """Draft states of a protocol matcher: by ``fork()`` when it forks faithfully, else by
    replaying root paths."""
    fork = getattr(matcher, "fork", None)
    if callable(fork) and _forks_faithfully(matcher):
        return ForkStates(matcher, info, words, protocol=True)
    return ProtocolReplayStates(matcher, info, words)


def _forks_faithfully(matcher: Any) -> bool:
    """Whether ``matcher.fork()`` returns an object of the matcher's own type (an xgrammar
    subclass overriding the protocol gets a plain ``GrammarMatcher`` back: its overrides would
    be lost on forks, so it is replayed instead)."""
    try:
        fork = matcher.fork()
    except Exception:
        return False
    return type(fork) is type(matcher)


class ProtocolCursor(Cursor):
    """Forced drafting on a :class:`portable_spec.GrammarMatcherLike`: a faithful ``fork()``
    walked forward, else the matcher itself, rolled back by :meth:`close`. Each token is
    tested against the state's mask first. Forced text: the optional
    ``find_jump_forward_string()`` (str or bytes); forced tokens: the optional
    ``find_jump_forward_tokens()``."""

    def __init__(self, matcher: Any, info: MatcherInfo) -> None:
        super().__init__(matcher, info)
        fork = getattr(matcher, "fork", None)
        self.forked = callable(fork) and _forks_faithfully(matcher)
        self.state = matcher.fork() if self.forked else matcher
        self.held = 0
        self._tail = _tail_word(info)

    def alive(self) -> bool:
        return not self.state.is_terminated()

    def _take(self, token: int) -> int:
        outcome = take_token(self.state, token)
        if outcome != REFUSED and not self.forked:
            self.held += 1
        return outcome

    def _fill(self, out: np.ndarray) -> None:
        self.state.fill_next_token_bitmask(out, 0)
        if self._tail is not None:
            out[0, self.info.words - 1] &= self._tail

    def forced_text(self) -> str | None:
        find = getattr(self.state, "find_jump_forward_string", None)
        if not callable(find):
            return None
        text = find()
        return whole_characters(bytes(text)) if isinstance(text, (bytes, bytearray)) else str(text)

    def forced_tokens(self, most: int) -> list[int] | None:
        find = getattr(self.state, "find_jump_forward_tokens", None)
        return [int(t) for t in find()][:most] if callable(find) else None

    def close(self) -> None:
        if self.held:
            held, self.held = self.held, 0
            self.matcher.rollback(held)
