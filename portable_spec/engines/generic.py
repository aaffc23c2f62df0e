"""Matchers following :class:`portable_spec.GrammarMatcherLike`: the shared iterative walk.

``accept_token``/``rollback``/``fill_next_token_bitmask``/``is_terminated`` are the moves;
:mod:`portable_spec.engines.walk` owns the row contract and the rollback bookkeeping.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

import numpy as np

from portable_spec.engines.base import MatcherInfo
from portable_spec.engines.walk import ENDED_HELD, LIVE, REFUSED, walk_tree

__all__ = ["generic_info", "take_token", "walk_generic"]


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
    model's. Raises ``TypeError``/``ValueError`` naming ``grammars[index]``."""
    own = getattr(matcher, "vocab_size", None)
    if own is None:
        return MatcherInfo((vocab_size + 31) // 32, vocab_size)
    if isinstance(own, bool) or not isinstance(own, Integral) or own <= 0:
        raise TypeError(f"grammars[{index}].vocab_size must be a positive int, got {own!r}")
    own = int(own)
    if own > vocab_size:
        raise ValueError(
            f"vocab_size = {vocab_size} is smaller than the vocabulary of grammars[{index}] "
            f"({own} tokens)"
        )
    return MatcherInfo((own + 31) // 32, own)
