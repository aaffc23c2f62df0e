"""``xgrammar.GrammarMatcher``: facts by probing, rows by its C++ ``traverse_draft_tree``,
draft states by ``fork()``."""

from __future__ import annotations

import re
import weakref
from typing import Any

import numpy as np

from portable_spec import native, pending, stats
from portable_spec.engines.base import IdentityCache, MatcherInfo
from portable_spec.engines.cursor import Cursor, whole_characters
from portable_spec.engines.generic import ForkStates
from portable_spec.engines.walk import ENDED_HELD, LIVE, REFUSED
from portable_spec.native import traverse_xgrammar, xgrammar_handle

__all__ = [
    "XGrammarCursor",
    "chain_facts",
    "has_forced_tokens",
    "probe_xgrammar",
    "walk_xgrammar",
    "xgrammar_info",
    "xgrammar_states",
]

_cache: IdentityCache[MatcherInfo] = IdentityCache()
# id(matcher) -> (weak reference, handle, words, vocab_size, stop_ids) of every probed matcher
# the compiled helper can call (handle != 0): the table the compiled chain build reads itself
# (portable_spec.native's chain_masks), dropped with the matcher. stop_ids is one array per
# distinct stop set (see _shared_stops), so that "same stop tokens" is an identity test.
chain_facts: dict[int, tuple[Any, int, int, int, np.ndarray]] = {}
_stop_arrays: dict[frozenset[int], np.ndarray] = {}
_MAX_STOP_SETS = 256
# what the compiled builds read besides their arguments: the facts above, the matchers builds
# are walking (held, see portable_spec.pending) and the build counters
native.configure(chain_facts, pending.held_table(), stats.tally)
_WIDTH_IN_MESSAGE = re.compile(r"should be \((?:batch_size, )?(\d+)")


def xgrammar_info(matcher: Any) -> MatcherInfo | None:
    """The facts :func:`probe_xgrammar` learnt about ``matcher``, or ``None`` if it was never
    probed (nothing is called on the matcher)."""
    return _cache.get(matcher)


def probe_xgrammar(matcher: Any, model_words: int) -> MatcherInfo:
    """Learn an xgrammar matcher's bitmask width and stop tokens without moving it (cached
    per matcher object).

    xgrammar exposes neither its vocabulary size nor its tokenizer from a matcher. Filling one
    row at the model's width (filling never moves a matcher) succeeds when the widths agree,
    the common case; otherwise xgrammar's error states the width it expects. A terminated
    matcher refuses every fill, so a reset fork is probed instead.
    """
    info = _cache.get(matcher)
    if info is not None:
        return info
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
    stop_set = frozenset(stop_list)
    info = MatcherInfo(
        words=words,
        vocab_size=32 * words,
        stop_ids=_shared_stops(stop_set, stop_list),
        stop_set=stop_set,
        handle=xgrammar_handle(matcher),
    )
    _cache.put(matcher, info)
    if info.handle:
        _share_facts(matcher, info)
    return info


def _shared_stops(stop_set: frozenset[int], stop_list: list[int]) -> np.ndarray:
    """The int64 array of a stop set, the same object for every matcher with that set (a
    bounded table: past it, a fresh array, which only costs those matchers the fast path)."""
    array = _stop_arrays.get(stop_set)
    if array is None:
        array = np.array(stop_list, dtype=np.int64)
        array.setflags(write=False)  # shared by every matcher of the set
        if len(_stop_arrays) < _MAX_STOP_SETS:
            array = _stop_arrays.setdefault(stop_set, array)
    return array


def _share_facts(matcher: Any, info: MatcherInfo) -> None:
    """Enter ``matcher`` in :data:`chain_facts` until it dies."""
    key = id(matcher)

    def forget(ref: weakref.ref[Any], key: int = key) -> None:
        entry = chain_facts.get(key)
        if entry is not None and entry[0] is ref:
            del chain_facts[key]

    try:
        ref = weakref.ref(matcher, forget)
    except TypeError:  # no weak references: the general paths serve it
        return
    chain_facts[key] = (ref, info.handle, info.words, info.vocab_size, info.stop_ids)


def walk_xgrammar(
    matcher: Any,
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    rows: np.ndarray,
) -> bool:
    """Fill ``rows`` for one request with ``GrammarMatcher.traverse_draft_tree`` (GIL released
    where the compiled helper can call it: :func:`portable_spec.native.traverse_xgrammar`).

    Args:
        next_token, next_sibling, draft: this request's C-contiguous int64 ``[nodes]`` rows.
        rows: C-contiguous int32 ``[nodes, words]`` with exactly the matcher's width.

    Returns:
        False when the matcher was terminated before the walk (nothing written), else True.
        xgrammar writes the rows of accepted, non-terminated nodes; it zeroes rows of rejected
        and terminated nodes and leaves rows it never reaches untouched. The caller rewrites
        every row that is not an accepted, non-terminated node's (see ``builder``).
    """
    return traverse_xgrammar(matcher, next_token, next_sibling, draft, rows)


def xgrammar_states(matcher: Any, info: MatcherInfo, words: int) -> ForkStates:
    """Draft states of an xgrammar matcher: one accepted ``fork()`` per live node (the
    session's matcher is never moved). A large level runs its requests on the library's
    pool."""
    states = ForkStates(matcher, info, words, protocol=False)
    states.parallel = True
    return states


class XGrammarCursor(Cursor):
    """Forced drafting on an xgrammar matcher: the matcher itself is walked forward and
    :meth:`close` rolls it back (xgrammar 0.2.8 on rolls back without limit; a fork would cost
    more than the walk). Its acceptance is its mask, so :meth:`take` asks ``accept_token``
    alone. Forced text: ``find_jump_forward_string()`` (the longest string every continuation
    starts with; cut to whole characters, which xgrammar 0.2.8 raises ``UnicodeDecodeError``
    for instead); forced tokens: ``find_jump_forward_tokens()`` (xgrammar 0.2.9 on: a greedy
    longest-token segmentation), else None."""

    checks_mask = False

    def __init__(self, matcher: Any, info: MatcherInfo) -> None:
        super().__init__(matcher, info)
        self.held = 0

    def alive(self) -> bool:
        return not self.matcher.is_terminated()

    def may_end(self) -> bool:
        return bool(self.matcher.is_completed())

    def _take(self, token: int) -> int:
        if not self.matcher.accept_token(token):
            return REFUSED
        self.held += 1
        # xgrammar terminates exactly when it accepts one of its stop tokens
        return ENDED_HELD if token in self.info.stop_set else LIVE

    def _fill(self, out: np.ndarray) -> None:
        self.matcher.fill_next_token_bitmask(out, 0)

    def forced_text(self) -> str | None:
        try:
            return str(self.matcher.find_jump_forward_string())
        except UnicodeDecodeError as exc:  # xgrammar 0.2.8: the bytes stop inside a character
            return whole_characters(bytes(exc.object))

    def forced_tokens(self, most: int) -> list[int] | None:
        find = getattr(self.matcher, "find_jump_forward_tokens", None)
        return None if find is None else [int(t) for t in find()][:most]

    def close(self) -> None:
        if self.held:
            held, self.held = self.held, 0
            self.matcher.rollback(held)


def has_forced_tokens(matcher: Any) -> bool:
    """Whether an xgrammar matcher has ``find_jump_forward_tokens`` (xgrammar 0.2.9 on)."""
    return callable(getattr(matcher, "find_jump_forward_tokens", None))
