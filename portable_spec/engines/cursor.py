"""The contract of an engine's cursor for forced drafting (:func:`portable_spec.forced_drafts`):
one request's grammar state walked forward token by token, and what the grammar forces next.

Each engine module has its own. Engines that fork walk a fork and never move the caller's
matcher (llguidance ``deep_copy()``, protocol matchers with a faithful ``fork()``); the others
move the matcher itself (xgrammar, whose rollback is unlimited and cheaper than a fork;
outlines-core guides; protocol matchers without ``fork()``) and :meth:`Cursor.close` takes it
back to where it started, also after an error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from portable_spec.engines.base import MatcherInfo
from portable_spec.engines.walk import REFUSED

__all__ = ["Cursor", "single_token", "whole_characters"]


class Cursor(ABC):
    """One request's grammar state, walked forward by :meth:`take`.

    Args:
        matcher: the request's matcher, in the state after its committed tokens.
        info: the builder's facts about it (width, vocabulary, stop tokens, rollback depth).
    """

    #: whether :meth:`take` tests the state's mask before the engine's own acceptance (engines
    #: whose acceptance can differ from their mask: llguidance, outlines-core, protocol
    #: matchers); xgrammar's acceptance is its mask
    checks_mask = True

    def __init__(self, matcher: Any, info: MatcherInfo) -> None:
        self.matcher = matcher
        self.info = info
        #: tokens taken so far
        self.taken = 0
        #: tokens the cursor may take and still return (outlines-core's rollback window)
        self.max_steps: int | None = info.max_depth
        self._row: np.ndarray | None = None  # the current state's mask, once filled
        self._scratch: np.ndarray | None = None

    @abstractmethod
    def alive(self) -> bool:
        """Whether the grammar may take a token at all (False: it was terminated)."""

    @abstractmethod
    def _take(self, token: int) -> int:
        """Take ``token`` (inside the vocabulary, allowed by the mask where
        :attr:`checks_mask`): a :mod:`portable_spec.engines.walk` outcome."""

    @abstractmethod
    def _fill(self, out: np.ndarray) -> None:
        """Write the current state's mask into ``out`` (int32 ``[1, info.words]``)."""

    def forced_text(self) -> bytes | None:
        """The bytes every continuation of the current state starts with (possibly none), or
        None when the engine cannot say it as text."""
        return None

    def forced_tokens(self, most: int) -> list[int] | None:
        """The engine's own forced continuation, at most ``most`` token ids (not taken), or
        None when the engine has none of its own."""
        return None

    def may_end(self) -> bool:
        """Whether the grammar may end in the current state (where its end token may be the
        only token allowed); True where the engine cannot tell without a mask."""
        return True

    def take(self, token: int) -> int:
        """Take ``token`` if the state's mask allows it and the grammar accepts it: a
        :mod:`portable_spec.engines.walk` outcome (``REFUSED``: nothing moved)."""
        if not 0 <= token < self.info.vocab_size:
            return REFUSED
        if self.max_steps is not None and self.taken >= self.max_steps:
            return REFUSED
        if self.checks_mask and not self.allows(token):
            return REFUSED
        outcome = self._take(token)
        if outcome != REFUSED:
            self._row = None
            self.taken += 1
        return outcome

    def row(self) -> np.ndarray:
        """The current state's mask: int32 ``[info.words]``, filled once per state."""
        if self._row is None:
            if self._scratch is None:
                self._scratch = np.zeros((1, self.info.words), dtype=np.int32)
            self._fill(self._scratch)
            self._row = self._scratch[0]
        return self._row

    def allows(self, token: int) -> bool:
        """Whether the current state's mask allows ``token`` (inside the vocabulary)."""
        return bool((int(self.row()[token >> 5]) >> (token & 31)) & 1)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Take the matcher back to where it started (engines that move it)."""


def single_token(row: np.ndarray) -> int | None:
    """The token of a mask row that allows exactly one, else None."""
    words = np.flatnonzero(row)
    if len(words) != 1:
        return None
    word = int(row[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(words[0]) * 32 + word.bit_length() - 1


def whole_characters(data: bytes) -> str:
    """The longest prefix of ``data`` that is whole UTF-8 characters, as text (forced bytes
    may stop inside a character, or hold bytes no text has)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return data[: exc.start].decode("utf-8")
