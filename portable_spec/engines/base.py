"""What the builder knows about a matcher, and a per-object cache of it."""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["NO_STOP_IDS", "IdentityCache", "MatcherInfo"]

NO_STOP_IDS = np.empty(0, dtype=np.int64)
T = TypeVar("T")


@dataclass(frozen=True)
class MatcherInfo:
    """Facts about one matcher that do not change while the request lives.

    Attributes:
        words: int32 words per row of this matcher's own bitmask.
        vocab_size: tokens the matcher knows (``32 * words`` when only the width is known).
        stop_ids: int64 token ids whose acceptance terminates the matcher (xgrammar only).
        stop_set: the same ids as a frozenset.
        max_depth: how deep a tree the matcher can walk and still roll back to where it
            started (outlines-core's ``max_rollback``); None when unbounded.
    """

    words: int
    vocab_size: int
    stop_ids: np.ndarray = field(default_factory=lambda: NO_STOP_IDS)
    stop_set: frozenset[int] = frozenset()
    max_depth: int | None = None


class IdentityCache(Generic[T]):
    """Per-object facts (of type ``T``) keyed by identity, dropped when the object dies.

    xgrammar matchers define ``__eq__`` without ``__hash__``, so a ``WeakKeyDictionary``
    cannot hold them; they are tracked by weak reference. llguidance's and outlines-core's
    objects support neither weak references nor attributes: the cache holds them strongly and,
    whenever it has doubled since the last sweep, drops the ones nobody else holds any more
    (their reference count shows only the cache's own references).
    """

    _SWEEP_MIN = 64

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], T]] = {}
        self._held: dict[int, tuple[Any, T]] = {}
        self._sweep_at = self._SWEEP_MIN

    def get(self, obj: Any) -> T | None:
        held = self._held.get(id(obj))
        if held is not None:
            return held[1] if held[0] is obj else None
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def put(self, obj: Any, info: T) -> None:
        key = id(obj)
        entries = self._entries

        def forget(ref: weakref.ref[Any], key: int = key) -> None:
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        try:
            entries[key] = (weakref.ref(obj, forget), info)
        except TypeError:  # no weak references: hold it, sweep the dead now and then
            self._held[key] = (obj, info)
            if len(self._held) >= self._sweep_at:
                self._sweep()

    def _sweep(self) -> None:
        for key, entry in list(self._held.items()):
            if sys.getrefcount(entry[0]) <= _CACHE_ONLY_REFS:
                del self._held[key]
        self._sweep_at = max(self._SWEEP_MIN, 2 * len(self._held))

    def __len__(self) -> int:
        return len(self._entries) + len(self._held)


# sys.getrefcount of a held object that only the cache references: the entry tuple's
# reference and getrefcount's own argument.
_CACHE_ONLY_REFS = 2
