"""What every engine shares: the facts about a matcher (and a per-object cache of them), and
the contract of an engine's draft states (:class:`NodeStates`)."""

from __future__ import annotations

import sys
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["NO_STOP_IDS", "IdentityCache", "MatcherInfo", "NodeStates"]

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
        handle: xgrammar only: :func:`portable_spec.native.xgrammar_handle` of the matcher
            when it was probed (0: the compiled helper cannot call its methods).
        max_depth: how deep a tree the matcher can walk and still roll back to where it
            started (outlines-core's ``max_rollback``); None when unbounded.
        end_ids: llguidance only: its tokenizer's end tokens, sorted int64 (each of them may
            end the text); None when they could not be read.
    """

    words: int
    vocab_size: int
    stop_ids: np.ndarray = field(default_factory=lambda: NO_STOP_IDS)
    stop_set: frozenset[int] = frozenset()
    handle: int = 0
    max_depth: int | None = None
    end_ids: np.ndarray | None = None


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


class NodeStates(ABC):
    """One request's grammar state at the live nodes of a draft tree that grows level by level
    (what :class:`portable_spec.DraftSession` keeps per request; each engine module has its
    own, made by its ``*_states`` function).

    For every new node whose parent is live and whose token the parent's row allows, the
    engine says what the grammar makes of it, as a :mod:`portable_spec.engines.walk` outcome:
    ``REFUSED`` (rejected), ``ENDED_HELD``/``ENDED_FREE`` (accepted and terminated: the end
    token) or ``LIVE`` (accepted; its row is written). Engines that fork keep one matcher
    state per live node and never move the session's matcher; engines that cannot fork move
    the one matcher along root paths inside :meth:`grow` and :meth:`forced` and restore it
    before they return (see :class:`portable_spec.engines.walk.ReplayStates`).

    Rows follow the row contract of :func:`portable_spec.build_host_bitmask`: every engine
    writes the same bits the builder writes for the same root path.

    Args:
        matcher: the request's matcher, in the state after its committed tokens.
        info: the builder's facts about the matcher (width, vocabulary, stop tokens).
        words: the model's row width (int32 words); rows narrower matchers write are zero
            past their own width.
    """

    #: deepest node (draft tokens below the root) the engine can reach; None: unbounded
    max_depth: int | None = None
    #: whether :meth:`grow` releases the GIL for its work (worth running requests on threads)
    parallel: bool = False

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
        of each node found ``LIVE`` into ``rows[node]``. ``parents``/``tokens`` are the
        request's int64 ``[capacity]`` tree so far (replaying engines walk root paths with
        them). Returns one :mod:`portable_spec.engines.walk` outcome per item.
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
