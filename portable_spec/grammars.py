"""The grammar-matcher protocol and how each request's matcher is classified.

Each entry of ``grammars`` is one of (mixed freely in one batch):

* ``None``: the request is unconstrained; all its rows are all-allowed (-1).
* an ``xgrammar.GrammarMatcher``: traversed by xgrammar's C++ ``traverse_draft_tree``, called
  by the compiled helper without the GIL (see :mod:`portable_spec.native`), so requests run
  in parallel on the builder's thread pool.
* an ``llguidance.LLMatcher``: its tree cut into chains that llguidance's Rust executor fills
  in one parallel call for the whole batch.
* an ``outlines_core.Guide``: walked with ``advance``/``rollback_state``.
* any object implementing :class:`GrammarMatcherLike`: traversed by the library's iterative
  Python walk (no recursion, so chains of any depth work).

The engine modules are in :mod:`portable_spec.engines`. Nothing here imports an engine: a
caller holding an engine's matcher has necessarily imported it already, and a type is
recognized by looking the engine up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from portable_spec.engines.base import MatcherInfo
from portable_spec.engines.generic import generic_info
from portable_spec.engines.llguidance import check_llmatcher, is_llmatcher, probe_llguidance
from portable_spec.engines.outlines import is_guide, probe_outlines
from portable_spec.engines.xgrammar import probe_xgrammar, xgrammar_info
from portable_spec.errors import MatcherError
from portable_spec.masks import words_for

__all__ = [
    "GrammarMatcherLike",
    "MatcherInfo",
    "classify_grammars",
    "known_xgrammar_facts",
    "matcher_kind",
]

PROTOCOL_METHODS = ("accept_token", "rollback", "fill_next_token_bitmask", "is_terminated")

NONE, XGRAMMAR, GENERIC, LLGUIDANCE, OUTLINES = 0, 1, 2, 3, 4


@runtime_checkable
class GrammarMatcherLike(Protocol):
    """What a non-xgrammar matcher must provide (structural; no base class needed).

    The builder calls these from one thread at a time per matcher, possibly not the caller's
    thread. Filling must not change the matcher's state.

    Optional attribute ``vocab_size`` (int): the matcher's own vocabulary size when it is
    smaller than the model's; its bitmask rows are then ``ceil(vocab_size / 32)`` words wide.
    """

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; return False (and do not move) if the grammar rejects it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> Any:
        """Write the allowed-next-token bits into row ``index`` of the int32 2-D ``bitmask``
        (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed)."""
        ...

    def is_terminated(self) -> bool:
        """Whether the matcher has finished (accepted an end-of-sequence token)."""
        ...


_kind_by_type: dict[type, int] = {}


def matcher_kind(matcher: Any) -> int:
    """The engine kind of one entry of ``grammars`` (``NONE`` for ``None``; -1 for an object
    no engine recognizes): the one look-up every route uses, cached by type."""
    if matcher is None:
        return NONE
    kind = _kind_by_type.get(type(matcher))
    return _kind_of_type(type(matcher)) if kind is None else kind


def known_xgrammar_facts(grammars: Sequence[Any], words: int) -> list[MatcherInfo] | None:
    """The facts of every entry of ``grammars`` when each is a plain xgrammar matcher the
    library has already probed at ``words`` words per row (its first build did), in order;
    ``None`` otherwise (then :func:`classify_grammars` checks and probes). Moves nothing,
    raises nothing: what the small routes read instead of classifying."""
    infos = []
    for g in grammars:
        if _kind_by_type.get(type(g)) != XGRAMMAR:
            return None
        info = xgrammar_info(g)
        if info is None or info.words != words:
            return None
        infos.append(info)
    return infos


def _kind_of_type(cls: type) -> int:
    kind = _kind_by_type.get(cls)
    if kind is not None:
        return kind
    xgr = sys.modules.get("xgrammar")
    base = getattr(xgr, "GrammarMatcher", None) if xgr is not None else None
    if is_llmatcher(cls):
        kind = LLGUIDANCE
    elif is_guide(cls):
        kind = OUTLINES
    elif base is not None and issubclass(cls, base):
        # A subclass that overrides the protocol must be honoured: walk it in Python.
        overridden = any(getattr(cls, m) is not getattr(base, m) for m in PROTOCOL_METHODS)
        kind = GENERIC if overridden else XGRAMMAR
    elif all(callable(getattr(cls, m, None)) for m in PROTOCOL_METHODS):
        kind = GENERIC
    else:
        kind = -1
    _kind_by_type[cls] = kind
    return kind


def classify_grammars(
    grammars: Sequence[Any], batch: int, vocab_size: int
) -> tuple[list[int], list[MatcherInfo | None]]:
    """Check ``grammars`` against the batch and vocabulary; return each entry's kind and facts.

    Raises ``TypeError``/``ValueError`` naming the offending entry before any matcher moves.
    Nothing here changes a matcher's state.
    """
    if type(grammars) not in (list, tuple) and (
        isinstance(grammars, (str, bytes)) or not isinstance(grammars, Sequence)
    ):
        raise TypeError(
            f"grammars must be a sequence with one entry per request, got {type(grammars).__name__}"
        )
    if len(grammars) != batch:
        raise ValueError(f"len(grammars) = {len(grammars)} but the tree has batch {batch}")
    model_words = words_for(vocab_size)
    kinds: list[int] = []
    infos: list[MatcherInfo | None] = []
    seen: dict[int, int] = {}
    for i, g in enumerate(grammars):
        if g is None:
            kinds.append(NONE)
            infos.append(None)
            continue
        kind = _kind_of_type(type(g))
        if kind < 0:
            missing = [m for m in PROTOCOL_METHODS if not callable(getattr(g, m, None))]
            raise TypeError(
                f"grammars[{i}] is a {type(g).__module__}.{type(g).__qualname__}, which is "
                "neither None, an xgrammar.GrammarMatcher, an llguidance.LLMatcher, an "
                f"outlines_core.Guide, nor a matcher-like object (missing: {', '.join(missing)})"
            )
        first = seen.setdefault(id(g), i)
        if first != i:
            raise ValueError(
                f"grammars[{i}] is the same matcher object as grammars[{first}]; each request "
                "needs its own matcher (they are walked concurrently)"
            )
        info = _probe(kind, g, i, vocab_size, model_words)
        if info.words > model_words:
            raise ValueError(
                f"vocab_size = {vocab_size} is smaller than the vocabulary of grammars[{i}] "
                f"(its bitmask rows have {info.words} words, up to {32 * info.words} tokens)"
            )
        kinds.append(kind)
        infos.append(info)
    return kinds, infos


def _probe(kind: int, g: Any, index: int, vocab_size: int, model_words: int) -> MatcherInfo:
    """The engine's facts about matcher ``g`` (``grammars[index]``), moving nothing."""
    if kind == XGRAMMAR:
        return probe_xgrammar(g, model_words)
    if kind == LLGUIDANCE:
        try:
            check_llmatcher(g)
        except RuntimeError as exc:
            raise MatcherError(index, exc) from exc
        return probe_llguidance(g, model_words)
    if kind == OUTLINES:
        try:
            return probe_outlines(g, model_words)
        except ValueError as exc:  # the guide's vocabulary is wider than the model's
            raise ValueError(
                f"vocab_size = {vocab_size} is smaller than the vocabulary of grammars[{index}] "
                f"(outlines-core: {exc})"
            ) from exc
    return generic_info(g, index, vocab_size)
