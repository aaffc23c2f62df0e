"""Requests of the other grammar engines for the oracle and the hypothesis cases.

Each engine's matcher is wrapped for the oracle in xgrammar's interface (fill, accept, fork,
is_terminated), written from the engines' documented behaviour with the end token known (the
oracle is told the vocabulary's end token; the library never is). The library itself is
given the engine's own object (``native()``) in the same starting state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from _oracle import Request

# deep enough for any tree the tests draw plus its prefix
OUTLINES_ROLLBACK = 64


class LLOracle:
    """An ``llguidance.LLMatcher`` seen through xgrammar's interface. An end token (``eos``:
    one id, or all of its tokenizer's) is never consumed: accepting it (where the mask allows
    it) marks the oracle terminated."""

    def __init__(self, inner: Any, eos: int | frozenset[int], ended: bool = False) -> None:
        self.inner = inner
        self.eos = eos
        self.ends = eos if isinstance(eos, frozenset) else frozenset([eos])
        self.ended = ended

    @property
    def records_end(self) -> bool:
        # a grammar already complete (stopped) consumes the end token without a trace
        return not self.inner.is_stopped()

    def fill_next_token_bitmask(self, buf: np.ndarray, index: int) -> None:
        row = buf[index]
        self.inner.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept_token(self, token: int) -> bool:
        if self.ended:
            return False  # a terminated matcher accepts nothing (as xgrammar's)
        if token in self.ends:
            self.ended = self._allows(token)
            return self.ended
        return self.inner.try_consume_tokens([token]) == 1

    def _allows(self, token: int) -> bool:
        row = np.zeros((1, self.inner_words()), dtype=np.int32)
        self.fill_next_token_bitmask(row, 0)
        return bool((int(row[0, token >> 5]) >> (token & 31)) & 1)

    def inner_words(self) -> int:
        """The mask's width: ``compute_bitmask()`` holds a bit per token and one more, in whole
        words (so one word more than the mask when the vocabulary fills its last word)."""
        reported = len(self.inner.compute_bitmask()) // 4
        row = np.zeros(reported, dtype=np.int32)
        try:
            self.inner.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        except ValueError:
            return reported - 1
        return reported

    def is_terminated(self) -> bool:
        return self.ended

    def fork(self) -> LLOracle:
        return LLOracle(self.inner.deep_copy(), self.eos, self.ended)


class OutlinesOracle:
    """An ``outlines_core.Guide`` seen through xgrammar's interface: forks replay the tokens
    on a new guide of the same index; the end token is accepted (never advanced) where the
    mask allows it."""

    def __init__(self, index: Any, eos: int, tokens: list[int] | None = None) -> None:
        import outlines_core

        self.index = index
        self.eos = eos
        self.tokens: list[int] = []
        self.ended = False
        self.inner = outlines_core.Guide(index, max_rollback=OUTLINES_ROLLBACK)
        for t in tokens or []:
            assert self.accept_token(t)

    records_end = False  # a guide never shows that its text ended

    def fill_next_token_bitmask(self, buf: np.ndarray, index: int) -> None:
        row = buf[index]
        self.inner.write_mask_into(row.ctypes.data, row.size, 4)

    def accept_token(self, token: int) -> bool:
        if self.ended:
            return False  # a terminated matcher accepts nothing (as xgrammar's)
        if token == self.eos:
            self.ended = self.inner.is_finished()  # the end token is allowed in final states
            return self.ended
        try:
            self.inner.advance(token, return_tokens=False)
        except ValueError:
            return False
        self.tokens.append(token)
        return True

    def is_terminated(self) -> bool:
        return self.ended

    def fork(self) -> OutlinesOracle:
        fork = OutlinesOracle(self.index, self.eos, self.tokens)
        fork.ended = self.ended
        return fork


@dataclass
class LLRequest(Request):
    """``compiled``: a serialized llguidance grammar; ``tokenizer``/``eos``: its vocabulary."""

    tokenizer: Any = None
    eos: int = -1

    def native(self) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self.compiled, log_level=0)
        end = len(self.prefix)
        if self.prefix and self.prefix[-1] == self.eos:
            end -= 1  # consumed as the engines do: the matcher records it (EndOfSentence)
        assert matcher.try_consume_tokens(self.prefix) >= end, "prefix refused"
        return matcher

    def fresh(self) -> LLOracle:
        import llguidance

        ends = frozenset([self.eos, *getattr(self.tokenizer, "eos_tokens", ())])
        oracle = LLOracle(llguidance.LLMatcher(self.tokenizer, self.compiled, log_level=0), ends)
        for t in self.prefix:
            assert oracle.accept_token(t), f"prefix token {t} refused"
        return oracle


@dataclass
class OutlinesRequest(Request):
    """``compiled``: an ``outlines_core.Index``; ``eos``: its vocabulary's end token."""

    eos: int = -1
    max_rollback: int = OUTLINES_ROLLBACK

    def native(self) -> Any:
        import outlines_core

        guide = outlines_core.Guide(self.compiled, max_rollback=self.max_rollback)
        for t in self.prefix:
            guide.advance(t, return_tokens=False)
        return guide

    def fresh(self) -> OutlinesOracle:
        return OutlinesOracle(self.compiled, self.eos, self.prefix)


def engine_request(engine: str, kind: str, eos: int) -> Request:
    """A request of ``engine`` ("xgrammar" excluded) on a sample grammar of SmolLM2."""
    from portable_spec import testing as ge

    if engine == "llguidance":
        return LLRequest(ge.llguidance_grammar(kind), tokenizer=ge.llguidance_tokenizer(), eos=eos)
    if engine == "outlines":
        return OutlinesRequest(ge.outlines_index(kind), eos=eos)
    raise ValueError(engine)


def fingerprint(matcher: Any, words: int, probe: list[int]) -> tuple:
    """The observable state of an engine's own object (for "every matcher is restored")."""
    row = np.zeros(words, dtype=np.int32)
    kind = type(matcher).__module__ + "." + type(matcher).__name__
    if "LLMatcher" in kind:
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return (
            matcher.is_stopped(),
            matcher.stop_reason(),
            row.tobytes(),
            tuple(matcher.validate_tokens([t]) for t in probe),
        )
    if "Guide" in kind:
        matcher.write_mask_into(row.ctypes.data, words, 4)
        return (matcher.get_state(), matcher.get_allowed_rollback(), row.tobytes())
    raise TypeError(kind)


XGRAMMAR_KINDS = ("json_schema", "regex", "builtin_json")


def engine_factory(vocab: Any, engines: tuple[str, ...], xgrammar_kinds=XGRAMMAR_KINDS):
    """``(make_request, kinds)`` for ``_cases.draw_case``: kinds are ``"engine:grammar"``
    strings for each of ``engines``, ``make_request`` builds the request of one."""
    from portable_spec import testing as ge

    def make(kind: str) -> Request:
        engine, kind = kind.split(":")
        if engine == "xgrammar":
            return Request(vocab.grammars[kind])
        return engine_request(engine, kind, vocab.eos)

    kinds = []
    for engine in engines:
        own = xgrammar_kinds if engine == "xgrammar" else ge.ENGINE_KINDS[engine]
        kinds.extend(f"{engine}:{k}" for k in own)
    return make, tuple(kinds)


def matcher_prints(matchers: list[Any], words: int, probe: list[int]) -> list[Any]:
    """Every matcher's observable state, whatever its engine (``None`` entries kept): for
    the "every matcher ends where it started" checks."""
    from _oracle import ProtocolMatcher, matcher_state

    prints: list[Any] = []
    for m in matchers:
        if m is None:
            prints.append(None)
        elif isinstance(m, ProtocolMatcher):
            prints.append(("protocol", m.depth, matcher_state(m.inner, probe, words)))
        elif hasattr(m, "traverse_draft_tree"):
            prints.append(matcher_state(m, probe, words))
        else:
            prints.append(fingerprint(m, words, probe))
    return prints
