"""The grammar-matcher protocol and how each request's matcher is classified.

Each entry of ``grammars`` is one of:

* ``None``: the request is unconstrained; all its rows are all-allowed (-1).
* an ``xgrammar.GrammarMatcher``: traversed by xgrammar's C++ ``traverse_draft_tree``, which
  releases the GIL, so requests run in parallel on the builder's thread pool.
* any object implementing :class:`GrammarMatcherLike`: traversed by the library's iterative
  Python walk (no recursion, so chains of any depth work).

This module never imports xgrammar: a caller holding an ``xgrammar.GrammarMatcher`` has
necessarily imported it already.
"""

from __future__ import annotations

import re
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["GrammarMatcherLike", "MatcherInfo", "classify_grammars", "words_for"]

PROTOCOL_METHODS = ("accept_token", "rollback", "fill_next_token_bitmask", "is_terminated")

NONE, XGRAMMAR, GENERIC = 0, 1, 2


def words_for(vocab_size: int) -> int:
    """Number of int32 words in one bitmask row covering ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


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


@dataclass(frozen=True)
class MatcherInfo:
    """Facts about one matcher that do not change while the request lives.

    Attributes:
        words: int32 words per row of this matcher's own bitmask.
        vocab_size: tokens the matcher knows (``32 * words`` when only the width is known).
        stop_ids: int64 token ids whose acceptance terminates the matcher (xgrammar only).
        stop_set: the same ids as a frozenset.
    """

    words: int
    vocab_size: int
    stop_ids: np.ndarray
    stop_set: frozenset[int]


class _IdentityCache:
    """Per-object facts keyed by identity, dropped when the object dies.

    xgrammar matchers define ``__eq__`` without ``__hash__``, so a ``WeakKeyDictionary``
    cannot hold them.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], MatcherInfo]] = {}

    def get(self, obj: Any) -> MatcherInfo | None:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def put(self, obj: Any, info: MatcherInfo) -> None:
        key = id(obj)
        entries = self._entries

        def forget(ref: weakref.ref[Any], key: int = key) -> None:
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(obj, forget), info)

    def __len__(self) -> int:
        return len(self._entries)


# Facts about xgrammar matchers, probed once per matcher object.
_xgrammar_info = _IdentityCache()
_kind_by_type: dict[type, int] = {}
_WIDTH_IN_MESSAGE = re.compile(r"should be \((?:batch_size, )?(\d+)")


def _kind_of_type(cls: type) -> int:
    kind = _kind_by_type.get(cls)
    if kind is not None:
        return kind
    xgr = sys.modules.get("xgrammar")
    base = getattr(xgr, "GrammarMatcher", None) if xgr is not None else None
    if base is not None and issubclass(cls, base):
        # A subclass that overrides the protocol must be honoured: walk it in Python.
        overridden = any(getattr(cls, m) is not getattr(base, m) for m in PROTOCOL_METHODS)
        kind = GENERIC if overridden else XGRAMMAR
    elif all(callable(getattr(cls, m, None)) for m in PROTOCOL_METHODS):
        kind = GENERIC
    else:
        kind = -1
    _kind_by_type[cls] = kind
    return kind


def _probe_xgrammar(matcher: Any, model_words: int) -> MatcherInfo:
    """Learn an xgrammar matcher's bitmask width and stop tokens without moving it.

    xgrammar exposes neither its vocabulary size nor its tokenizer from a matcher. Filling one
    row at the model's width (filling never moves a matcher) succeeds when the widths agree,
    the common case; otherwise xgrammar's error states the width it expects. A terminated
    matcher refuses every fill, so a reset fork is probed instead.
    """
    target = matcher
    if matcher.is_terminated():
        target = matcher.fork()
        target.reset()
    try:
        target.fill_next_token_bitmask(np.empty((1, model_words), dtype=np.int32), 0)
        words = model_words
    except RuntimeError as exc:
        found = _WIDTH_IN_MESSAGE.search(str(exc))
        if found is None:
            raise TypeError(
                "could not determine the bitmask width of an xgrammar.GrammarMatcher: "
                f"xgrammar said {exc}"
            ) from exc
        words = int(found.group(1))
    stop_list = [int(t) for t in matcher.stop_token_ids]
    return MatcherInfo(
        words=words,
        vocab_size=32 * words,
        stop_ids=np.asarray(stop_list, dtype=np.int64),
        stop_set=frozenset(stop_list),
    )


def classify_grammars(
    grammars: Sequence[Any], batch: int, vocab_size: int
) -> tuple[list[int], list[MatcherInfo | None]]:
    """Check ``grammars`` against the batch and vocabulary; return each entry's kind and facts.

    Raises ``TypeError``/``ValueError`` naming the offending entry before any matcher moves.
    Nothing here changes a matcher's state.
    """
    if isinstance(grammars, (str, bytes)) or not isinstance(grammars, Sequence):
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
                f"neither None, an xgrammar.GrammarMatcher, nor a matcher-like object "
                f"(missing: {', '.join(missing)})"
            )
        first = seen.setdefault(id(g), i)
        if first != i:
            raise ValueError(
                f"grammars[{i}] is the same matcher object as grammars[{first}]; each request "
                "needs its own matcher (they are walked concurrently)"
            )
        if kind == XGRAMMAR:
            info = _xgrammar_info.get(g)
            if info is None:
                info = _probe_xgrammar(g, model_words)
                _xgrammar_info.put(g, info)
            if info.words > model_words:
                raise ValueError(
                    f"vocab_size = {vocab_size} is smaller than the vocabulary of grammars[{i}] "
                    f"(its bitmask rows have {info.words} words, up to {32 * info.words} tokens)"
                )
        else:
            info = _generic_info(g, i, vocab_size)
        kinds.append(kind)
        infos.append(info)
    return kinds, infos


_NO_STOP_IDS = np.empty(0, dtype=np.int64)


def _generic_info(g: Any, index: int, vocab_size: int) -> MatcherInfo:
    own = getattr(g, "vocab_size", None)
    if own is None:
        return MatcherInfo(words_for(vocab_size), vocab_size, _NO_STOP_IDS, frozenset())
    if isinstance(own, bool) or not isinstance(own, Integral) or own <= 0:
        raise TypeError(f"grammars[{index}].vocab_size must be a positive int, got {own!r}")
    own = int(own)
    if own > vocab_size:
        raise ValueError(
            f"vocab_size = {vocab_size} is smaller than the vocabulary of grammars[{index}] "
            f"({own} tokens)"
        )
    return MatcherInfo(words_for(own), own, _NO_STOP_IDS, frozenset())
