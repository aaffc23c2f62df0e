"""``outlines_core.Guide``: an iterative walk with ``advance`` and ``rollback_state``.

Facts of outlines-core (0.2) this module relies on, each checked by the tests:

* ``is_finished()`` means "the text may end here" (a final state, from which more tokens may
  still follow), not "the end token was accepted"; the end token appears in the mask of final
  states, but ``advance(eos)`` raises ``ValueError``. A node whose token the parent's row
  allows but ``advance`` refuses, below a final state, is therefore *terminated* (the end
  token); anywhere else it is rejected. A guide itself is never terminated: engines track
  that themselves (pass ``None`` for finished requests).
* ``advance`` of a refused token raises ``ValueError`` and leaves the state unchanged.
* ``rollback_state(n)`` can undo only the states the guide stored, at most the
  ``max_rollback`` it was built with; a walk that went deeper could not return. The depth
  bound is read once per guide and trees deeper than it are refused before anything moves.
  Like any advance/rollback cycle (vLLM's own included), a walk may push the oldest stored
  states of a guide whose history is full out of its window.
* ``write_mask_into(ptr, numel, 4)`` writes the current state's mask and zeroes the words past
  the guide's vocabulary when ``numel`` is larger (it refuses smaller buffers). It costs tens
  of microseconds in states that allow many tokens (inside a string: most of the vocabulary)
  and holds the GIL. A mask depends only on the guide's index and its state
  (``get_state()``), so rows are kept by ``(guide, state)`` in a bounded cache: sibling nodes
  inside a string, and the same states step after step, are copied instead of recomputed.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from portable_spec.engines.base import IdentityCache, MatcherInfo
from portable_spec.engines.cursor import Cursor, single_token
from portable_spec.engines.walk import ENDED_FREE, LIVE, REFUSED, ReplayStates, walk_tree

__all__ = [
    "STATE_ROWS_BUDGET",
    "OutlinesCursor",
    "OutlinesStates",
    "StateRows",
    "is_guide",
    "probe_outlines",
    "walk_outlines",
]

_cache: IdentityCache[MatcherInfo] = IdentityCache()
_MAX_ROLLBACK_IN_MESSAGE = re.compile(r"max_rollback\s*=\s*(\d+)")


def is_guide(cls: type) -> bool:
    """Whether ``cls`` is ``outlines_core.Guide`` (or a subclass); imports nothing."""
    import sys

    module = sys.modules.get("outlines_core")
    guide = getattr(module, "Guide", None) if module is not None else None
    return guide is not None and isinstance(guide, type) and issubclass(cls, guide)


def probe_outlines(guide: Any, model_words: int) -> MatcherInfo:
    """Width and rollback depth of a guide, without moving it (cached per guide object).

    The width is the model's: the guide accepts any buffer at least as wide as its vocabulary
    and zeroes the words past it (a narrower model vocabulary raises ``ValueError`` naming
    the guide's width). What is cached is the narrowest width the guide accepted and its
    depth, never the model's width of the first call: a guide first used with a padded
    vocabulary serves the real one later. The depth bound is the ``max_rollback`` the guide
    was built with, which outlines-core states in the error of a rollback past the stored
    states (that call moves nothing); if the message changes, the states stored now are
    used, a lower bound.
    """
    known = _cache.get(guide)
    if known is not None and known.words == model_words:
        return known
    if known is None or model_words < known.words:
        probe = np.empty(model_words, dtype=np.int32)
        # raises if narrower than the guide's vocabulary
        guide.write_mask_into(probe.ctypes.data, model_words, 4)
    depth = known.max_depth if known is not None else _rollback_depth(guide)
    info = MatcherInfo(words=model_words, vocab_size=32 * model_words, max_depth=depth)
    if known is None or model_words < known.words:
        _cache.put(guide, info)  # the narrowest width it accepted
    return info


def _rollback_depth(guide: Any) -> int:
    """The ``max_rollback`` a guide was built with (see :func:`probe_outlines`)."""
    stored = int(guide.get_allowed_rollback())
    depth = stored
    try:
        guide.rollback_state(stored + 1)
    except ValueError as exc:
        found = _MAX_ROLLBACK_IN_MESSAGE.search(str(exc))
        if found is not None:
            depth = int(found.group(1))
    else:  # outlines-core changed: a rollback past the stored states moved the guide
        raise TypeError("outlines_core.Guide.rollback_state no longer refuses to overrun")
    return depth


#: bytes of mask rows kept by (guide, state) across builds
STATE_ROWS_BUDGET = 32 << 20


class StateRows:
    """Mask rows by ``(guide, state, width)``, least recently used dropped past a byte budget.

    Guides support neither weak references nor attributes: an entry holds its guide, so an
    ``id`` cannot be reused while cached; a guide the engine dropped leaves with its entries.
    Thread-safe.
    """

    def __init__(self, budget: int = STATE_ROWS_BUDGET) -> None:
        self.budget = budget
        self._rows: OrderedDict[tuple[int, int, int], tuple[Any, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, guide: Any, state: int, words: int) -> np.ndarray | None:
        key = (id(guide), state, words)
        with self._lock:
            entry = self._rows.get(key)
            if entry is None or entry[0] is not guide:
                return None
            self._rows.move_to_end(key)
            return entry[1]

    def put(self, guide: Any, state: int, row: np.ndarray) -> None:
        key = (id(guide), state, row.shape[0])
        copy = row.copy()
        with self._lock:
            old = self._rows.pop(key, None)
            if old is not None:
                self._bytes -= old[1].nbytes
            self._rows[key] = (guide, copy)
            self._bytes += copy.nbytes
            while self._bytes > self.budget and self._rows:
                _, (_, dropped) = self._rows.popitem(last=False)
                self._bytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._bytes = 0


state_rows = StateRows()


class _GuideSteps:
    """An ``outlines_core.Guide``'s moves for the shared walk, rows kept by DFA state."""

    def __init__(self, guide: Any, rows: np.ndarray) -> None:
        self.guide = guide
        self.rows = rows
        self.base, self.row_bytes, self.words = rows.ctypes.data, rows.strides[0], rows.shape[1]

    def start(self) -> bool:
        return True  # a guide never shows that its text ended

    def fill(self, node: int) -> None:
        state = self.guide.get_state()
        row = state_rows.get(self.guide, state, self.words)
        if row is None:
            self.guide.write_mask_into(self.base + node * self.row_bytes, self.words, 4)
            state_rows.put(self.guide, state, self.rows[node])
        else:
            self.rows[node] = row

    def advance(self, token: int, parent: int, node: int) -> int:
        try:
            self.guide.advance(token, return_tokens=False)
        except ValueError:
            # allowed by the mask but no transition: the end token below a final state
            # (terminated), else a token into a dead state (rejected)
            return ENDED_FREE if self.guide.is_finished() else REFUSED
        return LIVE

    def rollback(self, count: int) -> None:
        self.guide.rollback_state(count)


def walk_outlines(
    guide: Any,
    next_token: list[int],
    next_sibling: list[int],
    draft: list[int],
    rows: np.ndarray,
    vocab_limit: int,
) -> tuple[list[bool], int, int]:
    """Fill ``rows`` for one request with the shared iterative walk of ``guide``
    (:func:`portable_spec.engines.walk.walk_tree`: same arguments after ``guide``, same
    result). Its ``max_rollback`` must cover the tree's depth (checked by the builder
    beforehand); the guide is back in its starting state, also when it raises."""
    steps = _GuideSteps(guide, rows)
    return walk_tree(steps, next_token, next_sibling, draft, rows, vocab_limit)


# -- draft states ------------------------------------------------------------------------------
class OutlinesStates(ReplayStates):
    """Draft states of an ``outlines_core.Guide``: the guide is moved along root paths with
    ``advance`` / ``rollback_state`` (see :class:`portable_spec.engines.walk.ReplayStates`);
    an allowed token that does not advance below a final state is the end token
    (terminated), anywhere else it is rejected. Rows are kept by guide state across calls,
    as the builder's walk keeps them."""

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
            return ENDED_FREE if self.matcher.is_finished() else REFUSED
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
                token = single_token(current)
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


class OutlinesCursor(Cursor):
    """Forced drafting on an ``outlines_core.Guide``: the guide itself is advanced and
    :meth:`close` rolls it back (never past its rollback window: :attr:`max_steps`).
    outlines-core has no forced text of its own: the tokens forced are those of states that
    allow a single token (the driver's rule). At a final state the end token is allowed and
    ``advance`` refuses it: taking it ends the grammar without moving the guide."""

    def __init__(self, matcher: Any, info: MatcherInfo) -> None:
        super().__init__(matcher, info)
        self.held = 0

    def alive(self) -> bool:
        return True

    def _take(self, token: int) -> int:
        try:
            self.matcher.advance(token, return_tokens=False)
        except ValueError:
            return ENDED_FREE if self.matcher.is_finished() else REFUSED
        self.held += 1
        return LIVE

    def _fill(self, out: np.ndarray) -> None:
        guide = self.matcher
        state = guide.get_state()
        cached = state_rows.get(guide, state, self.info.words)
        if cached is None:
            guide.write_mask_into(out.ctypes.data, self.info.words, 4)
            state_rows.put(guide, state, out[0])
        else:
            out[0] = cached

    def close(self) -> None:
        if self.held:
            held, self.held = self.held, 0
            self.matcher.rollback_state(held)
