"""``llguidance.LLMatcher``: trees by an iterative walk, chains by llguidance's Rust executor.

Facts of llguidance (1.x) this module relies on, each checked by the tests:

* ``is_stopped()`` is already true when the grammar is complete (its row: the end token
  only), before the end token is consumed; in that state the end token is "consumed" without
  a trace (``try_consume_tokens`` counts 0, ``rollback`` does not see it). In a state that may
  end *or* go on, the end token is consumed for real and ``stop_reason()`` becomes
  ``"EndOfSentence"``. So a node is terminated when its token is allowed and either its
  parent was stopped or consuming it reports ``"EndOfSentence"``; a walk needs no list of
  end tokens (an ``LLMatcher`` does not expose its tokenizer). A matcher whose stop reason is
  ``"EndOfSentence"`` at the root is terminated (all its rows all-allowed); one that was
  complete before an end token consumed in the stopped state cannot be told apart from one
  still waiting for it, and gets the end-token-only row.
* ``consume_token`` of a refused token puts the matcher in an error state it never leaves;
  ``try_consume_tokens`` does not. The walk only consumes tokens the parent's row allows, and
  through ``try_consume_tokens``. A matcher already in the error state is reported as a
  ``MatcherError`` naming its request. In the error state its row allows exactly its
  tokenizer's end tokens (all of them, however many): the probe reads them off a fork put
  there.
* A token id at or past the tokenizer's vocabulary (but inside its mask's last word, or a
  padding id of wider logits) is an error for ``try_consume_tokens``, ``validate_tokens`` and
  the executor alike, one the matcher never leaves either. An ``LLMatcher`` does not expose
  its tokenizer: the probe finds the vocabulary size on forks (``deep_copy``, ``reset``,
  ``validate_tokens``), and every walk and chain fill bounds its drafts by it (such a draft is
  a refused node).
* Masks and consumption hold the GIL (threads do not speed a per-node loop up), but the
  executor (``LLExecutor.unsafe_compute_mask_ptr_with_draft_token``) fills whole chains for
  many matchers in parallel in Rust, without moving them: it writes the start state's row and
  one row per draft it accepts, stops at the first draft it refuses (or an end token in a
  stopped state), and leaves later rows untouched. It takes an end token where the text may
  end like any other and goes on (the next row: the end tokens), so the chain fill finds
  the drafts that are end tokens by the probe's list and decides each on a fork. Chains use
  it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.engines.base import IdentityCache, MatcherInfo, NodeStates
from portable_spec.engines.cursor import Cursor, whole_characters
from portable_spec.engines.walk import (
    ENDED_FREE,
    ENDED_HELD,
    LIVE,
    REFUSED,
    walk_chain,
    walk_tree,
)

__all__ = [
    "LLGuidanceCursor",
    "LLGuidanceStates",
    "check_llmatcher",
    "ended",
    "fill_llguidance_chains",
    "held_facts",
    "is_llmatcher",
    "llguidance_info",
    "probe_llguidance",
    "take_token",
    "walk_llguidance",
    "walk_llguidance_chain",
]

_cache: IdentityCache[MatcherInfo] = IdentityCache()
_ENDED = "EndOfSentence"


def is_llmatcher(cls: type) -> bool:
    """Whether ``cls`` is ``llguidance.LLMatcher`` (or a subclass); imports nothing."""
    module = sys.modules.get("llguidance")
    matcher = getattr(module, "LLMatcher", None) if module is not None else None
    return matcher is not None and isinstance(matcher, type) and issubclass(cls, matcher)


def check_llmatcher(matcher: Any) -> None:
    """Raise ``RuntimeError`` with llguidance's message if ``matcher`` is in the error state
    (a state it never leaves: its masks and walks would be meaningless)."""
    if matcher.is_error():
        raise RuntimeError(f"the llguidance matcher is in its error state: {matcher.get_error()}")


def probe_llguidance(matcher: Any, model_words: int) -> MatcherInfo:
    """The bitmask width of an ``LLMatcher`` and its tokenizer's vocabulary size, without
    moving it; cached per matcher object.

    llguidance accepts exactly its own width. The model's width is tried first (the common
    case); otherwise the width is read off ``compute_bitmask()``, which returns one bit per
    token (rounded up to whole words, with up to one word of slack), and confirmed by a fill.
    The vocabulary size (in the width's last word) is found by :func:`_vocabulary`.
    """
    info = _cache.get(matcher)
    if info is not None:
        return info
    words = None
    for candidate in _width_candidates(matcher, model_words):
        buffer = np.empty(candidate, dtype=np.int32)
        try:
            matcher.unsafe_compute_mask_ptr(buffer.ctypes.data, buffer.nbytes)
        except ValueError:
            continue
        words = candidate
        break
    if words is None:
        raise TypeError("could not determine the bitmask width of an llguidance.LLMatcher")
    info = MatcherInfo(
        words=words,
        vocab_size=_vocabulary(matcher, words),
        end_ids=_end_tokens(matcher, words),
    )
    _cache.put(matcher, info)
    return info


def _end_tokens(matcher: Any, words: int) -> np.ndarray | None:
    """The end tokens of ``matcher``'s tokenizer (sorted int64), read without moving it.

    A matcher in its error state fills the row of its tokenizer's end tokens only (what
    llguidance lets a broken request do: stop). A fork is put there by consuming an id past
    any vocabulary of ``words`` words; its row lists the end tokens. None when the fork did
    not enter the error state or its row allows nothing (then every allowed draft of a chain
    is decided on a fork, see :func:`fill_llguidance_chains`)."""
    fork = matcher.deep_copy()
    fork.consume_token(32 * words)
    if not fork.is_error():
        return None
    row = np.zeros(words, dtype=np.int32)
    fork.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    used = np.flatnonzero(row)  # the few words holding end tokens
    bits = (row[used, None].view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    ends = (used[:, None] * 32 + np.arange(32))[bits == 1].astype(np.int64)
    if not ends.size:
        return None
    with _end_lock:  # one array per set of end tokens: chain fills group by it
        known = _end_sets.get(ends.tobytes())
        if known is not None:
            return known
        ends.flags.writeable = False
        # its lookup table: True at each end token; the last entry (False) answers every id
        # outside [0, max]
        table = np.zeros(int(ends[-1]) + 2, dtype=bool)
        table[ends] = True
        _end_tables[id(ends)] = table
        _end_sets[ends.tobytes()] = ends
    return ends


def _vocabulary(matcher: Any, words: int) -> int:
    """The size of ``matcher``'s tokenizer vocabulary, whose mask is ``words`` words wide:
    between ``32 * (words - 1)`` (exclusive) and ``32 * words``.

    llguidance takes an id at or past its vocabulary for an error (and ids below it never),
    so the first such id is found by bisection over the last word, each guess asked of a
    fork of the matcher reset to its grammar's start (``validate_tokens`` on a fork: the
    matcher itself is never moved); one fork when the vocabulary fills the last word, at most
    six otherwise, about a microsecond each. A grammar complete at its start validates
    nothing: then ``32 * words`` (its masks allow the end token only, so no draft past the
    vocabulary can be taken either)."""
    top = 32 * words

    def past(token: int) -> bool:  # whether ``token`` lies at or past the vocabulary
        fork = matcher.deep_copy()
        fork.reset()
        fork.validate_tokens([token])
        return bool(fork.is_error())

    start = matcher.deep_copy()
    start.reset()
    if start.is_error() or start.is_stopped() or not past(top - 1):
        return top
    low, high = top - 32, top - 1  # low lies inside the vocabulary, high past it
    while high - low > 1:
        middle = (low + high) // 2
        if past(middle):
            high = middle
        else:
            low = middle
    return high


def held_facts() -> dict[int, tuple[Any, MatcherInfo]]:
    """The probe cache's table of the matchers it holds (``id(matcher) -> (matcher,
    facts)``: ``LLMatcher`` takes no weak reference), which the compiled small build reads
    (:func:`portable_spec.native.llguidance_masks`). Do not modify it."""
    return _cache._held


def llguidance_info(matcher: Any) -> MatcherInfo | None:
    """What :func:`probe_llguidance` found about ``matcher``, or None when it has not probed
    it (moves nothing, calls nothing of llguidance)."""
    return _cache.get(matcher)


def _width_candidates(matcher: Any, model_words: int) -> list[int]:
    candidates = [model_words]
    reported = len(matcher.compute_bitmask()) // 4
    for words in (reported, reported - 1):
        if words > 0 and words not in candidates:
            candidates.append(words)
    return candidates


def ended(matcher: Any) -> bool:
    """Whether an end token was consumed: the matcher is terminated (all rows all-allowed)."""
    return matcher.stop_reason() == _ENDED


def take_token(matcher: Any, token: int, parent_stopped: bool) -> int:
    """Take ``token``, which the parent's row allows, on ``matcher`` (at the parent's state);
    llguidance's facts in one place. Returns a :mod:`portable_spec.engines.walk` outcome:
    ``ENDED_FREE`` for the end token after a complete grammar (``parent_stopped``: nothing is
    consumed), ``REFUSED`` (nothing consumed: ``try_consume_tokens`` never enters the error
    state), ``ENDED_HELD`` for an end token consumed where the text could go on, else
    ``LIVE``."""
    if parent_stopped:
        return ENDED_FREE
    if matcher.try_consume_tokens([token]) != 1:
        return REFUSED
    try:
        stopped = ended(matcher)
    except BaseException:  # nothing may stay held that the caller has not counted
        matcher.rollback(1)
        raise
    return ENDED_HELD if stopped else LIVE


class _LLSteps:
    """An ``LLMatcher``'s moves for the shared walk: only tokens the parent's row allows are
    consumed, through ``try_consume_tokens`` (never the error state)."""

    def __init__(self, matcher: Any, rows: np.ndarray) -> None:
        self.matcher = matcher
        self.base, self.row_bytes = rows.ctypes.data, rows.strides[0]
        self.nbytes = rows.shape[1] * 4
        # complete grammar at a node: only the end token may follow, consumed without a trace
        self.stopped = [False] * rows.shape[0]

    def start(self) -> bool:
        self.stopped[0] = self.matcher.is_stopped()
        return not ended(self.matcher)

    def fill(self, node: int) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.base + node * self.row_bytes, self.nbytes)

    def advance(self, token: int, parent: int, node: int) -> int:
        outcome = take_token(self.matcher, token, self.stopped[parent])
        if outcome == LIVE:
            self.stopped[node] = self.matcher.is_stopped()
        return outcome

    def rollback(self, count: int) -> None:
        self.matcher.rollback(count)


def walk_llguidance(
    matcher: Any,
    next_token: list[int],
    next_sibling: list[int],
    draft: list[int],
    rows: np.ndarray,
    vocab_limit: int,
) -> tuple[list[bool], int, int]:
    """Fill ``rows`` for one request of an ``LLMatcher`` by the shared iterative walk
    (:func:`portable_spec.engines.walk.walk_tree`: same arguments after ``matcher``, same
    result). The matcher is rolled back to where it started, also when it raises. The
    compiled helper runs the same walk with the matcher's methods called from C."""
    done = compiled.llguidance_walk(matcher, next_token, next_sibling, draft, rows, vocab_limit, 0)
    if done is not None:
        return done
    steps = _LLSteps(matcher, rows)
    return walk_tree(steps, next_token, next_sibling, draft, rows, vocab_limit)


def walk_llguidance_chain(
    matcher: Any,
    next_token: list[int],
    next_sibling: list[int],
    draft: list[int],
    rows: np.ndarray,
    vocab_limit: int,
) -> tuple[list[bool], int, int]:
    """:func:`walk_llguidance` for one chain (node ``i``'s only child is ``i + 1``; the links
    are not read), by :func:`portable_spec.engines.walk.walk_chain`: the same rows, counts
    and guarantees in a plain per-token loop, as an engine's own loop runs (in C with the
    compiled helper)."""
    done = compiled.llguidance_walk(matcher, None, None, draft, rows, vocab_limit, 1)
    if done is not None:
        return done
    return walk_chain(_LLSteps(matcher, rows), draft, rows, vocab_limit)


# -- chains: llguidance's parallel executor ----------------------------------------------------
_executors: dict[int, Any] = {}
_executors_lock = threading.Lock()
# The end-token sets of the tokenizers probed (as bytes -> the one array of each), and each
# array's lookup table (by its id: the arrays live as long as the module).
_end_sets: dict[bytes, np.ndarray] = {}
_end_tables: dict[int, np.ndarray] = {}
_end_lock = threading.Lock()
# Written into two words of every chain row before the executor runs: a row that still holds
# both afterwards was (almost surely) not written; the rare real row equal to it is told apart
# exactly on a fork.
_SENTINEL = (0x2C5A0F1E, 0x71E3A5C9)


def _executor(threads: int) -> Any:
    executor = _executors.get(threads)
    if executor is None:
        import llguidance

        with _executors_lock:
            executor = _executors.get(threads)
            if executor is None:
                executor = _executors[threads] = llguidance.LLExecutor(num_threads=threads)
    return executor


def fill_llguidance_chains(
    matchers: dict[int, Any],
    width: int,
    draft: np.ndarray,
    mask: np.ndarray,
    vocab_size: int,
    counts: np.ndarray,
    threads: int,
    live: np.ndarray | None = None,
) -> np.ndarray:
    """Write the rows of chain requests (node ``i``'s only child is ``i + 1``) whose matchers
    have bitmask width ``width``, in one call of llguidance's executor.

    Args:
        matchers: request index -> its ``LLMatcher``.
        width: their bitmask width in words.
        draft: the batch's int64 ``[batch, nodes]`` draft tokens.
        mask: int32 ``[batch * nodes, words]``; the requests' row blocks are written whole.
        vocab_size: the model's vocabulary size. A draft at or past it, or past its matcher's
            tokenizer vocabulary (:func:`probe_llguidance`), ends its chain as a refused node:
            the executor is never handed one.
        counts: int64 ``[batch, 2]``: ``(checked, refused)`` draft nodes, set per request.
        threads: the executor's thread count.
        live: optional bool ``[batch * nodes]``; the live nodes' rows are set True.

    Returns:
        int64 ``[len(matchers)]``, in the order of ``matchers``: how many leading nodes of
        each chain are live (accepted and not terminated; 0 for a terminated matcher). Their
        rows hold the grammar's masks; the others were set to -1.

    Blocks until done; the GIL is released while the executor runs. The matchers do not move.
    Which rows the executor wrote is read off the rows themselves (vectorized over the batch);
    only the rare ambiguous row (an end token, or a row equal to the sentinel) costs a fork.
    """
    nodes = draft.shape[1]
    words = mask.shape[1]
    requests = list(matchers)
    infos = [_facts(matchers[b], width) for b in requests]
    # per request: its tokens bounded by its tokenizer's vocabulary (llguidance takes an id
    # past it for an error it never leaves), int64 [count, 1]
    limit = np.array([[min(vocab_size, info.vocab_size)] for info in infos], np.int64)
    count = len(requests)
    direct = width == words  # the executor writes into the mask's own rows
    target = mask if direct else np.empty((count * nodes, width), dtype=np.int32)
    block = np.asarray(requests) if direct else np.arange(count)
    rows = block[:, None] * nodes + np.arange(nodes)  # [count, nodes] target rows
    ended = np.array([matchers[b].stop_reason() == _ENDED for b in requests], dtype=bool)
    tokens = draft[requests, 1:]
    outside = (tokens < 0) | (tokens >= limit)
    usable = np.full(count, nodes - 1, dtype=np.int64)
    if nodes > 1:
        usable = np.where(outside.any(axis=1), outside.argmax(axis=1), usable)
    # sentinels in the rows the executor may write: the start row and one per usable draft
    chain_rows = rows[(np.arange(nodes) <= usable[:, None]) & ~ended[:, None]]
    target[chain_rows, 0] = _SENTINEL[0]
    target[chain_rows, -1] = _SENTINEL[1]
    items, lone = [], []
    for k, b in enumerate(requests):
        if ended[k]:
            continue
        first = int(rows[k, 0])
        if usable[k]:
            items.append((matchers[b], first, tokens[k, : usable[k]].tolist()))
        else:
            lone.append((matchers[b], first))
    if items:
        _executor(threads).unsafe_compute_mask_ptr_with_draft_token(
            items, target.ctypes.data, width * 4, target.shape[0]
        )
    for matcher, first in lone:  # the executor wants drafts: a lone start row directly
        matcher.unsafe_compute_mask_ptr(target[first].ctypes.data, width * 4)
    ends = _end_flags(infos, tokens)
    live_drafts = _live_drafts(matchers, requests, target, rows, tokens, usable, ended, ends)
    # live nodes per request: the root and its live drafts (none when terminated)
    alive = np.where(ended, 0, live_drafts + 1)
    kept = np.arange(nodes)[None, :] < alive[:, None]
    out_rows = np.asarray(requests)[:, None] * nodes + np.arange(nodes)
    if not direct:
        mask[out_rows[kept], :width] = target[rows[kept]]
        mask[out_rows[kept], width:] = 0
    mask[out_rows[~kept]] = -1
    if live is not None:
        live[out_rows[kept]] = True
    counts[requests] = _chain_counts(mask, out_rows, tokens, alive, limit)
    return alive


def _facts(matcher: Any, width: int) -> MatcherInfo:
    """What :func:`probe_llguidance` knows of ``matcher``, a matcher ``width`` words wide."""
    info = _cache.get(matcher)
    if info is None or info.words != width:
        info = probe_llguidance(matcher, width)
    return info


def _end_flags(infos: list[MatcherInfo], tokens: np.ndarray) -> np.ndarray:
    """bool ``[count, drafts]``: whether each draft of ``tokens`` (int64 ``[count, drafts]``)
    is one of its request's end tokens; True for every draft of a request whose end tokens
    are not known (each is then decided on a fork)."""
    first = infos[0].end_ids if infos else None
    if first is not None and all(info.end_ids is first for info in infos):  # one tokenizer
        table = _end_tables[id(first)]
        return table[np.clip(tokens, -1, table.size - 1)]
    groups: dict[int, list[int]] = {}
    for k, info in enumerate(infos):
        key = -1 if info.end_ids is None else id(info.end_ids)
        groups.setdefault(key, []).append(k)
    flags = np.ones(tokens.shape, dtype=bool)
    for key, members in groups.items():
        if key != -1:
            table = _end_tables[key]
            flags[members] = table[np.clip(tokens[members], -1, table.size - 1)]
    return flags


def _chain_counts(
    mask: np.ndarray,
    out_rows: np.ndarray,
    tokens: np.ndarray,
    alive: np.ndarray,
    limit: np.ndarray,
) -> np.ndarray:
    """``[requests, 2]`` (checked, refused): children of live nodes, and the first non-live
    draft if its parent's row refuses it (an end token is accepted, not refused). ``limit``:
    int64 ``[requests, 1]``, each request's token bound."""
    count, nodes = out_rows.shape
    if nodes == 1:
        return np.zeros((count, 2), dtype=np.int64)
    limit = limit[:, 0]
    checked = np.minimum(alive, nodes - 1)
    first_out = np.maximum(np.minimum(alive, nodes - 1) - 1, 0)  # draft index of the first
    stop = tokens[np.arange(count), first_out]  # non-live node (its parent: node first_out)
    safe = np.clip(stop, 0, limit - 1)
    word = mask[out_rows[np.arange(count), first_out], safe >> 5]
    allowed = (word >> (safe & 31)) & 1
    refused = (alive > 0) & (alive < nodes) & ((stop < 0) | (stop >= limit) | (allowed == 0))
    return np.stack([checked, refused.astype(np.int64)], axis=1)


def _live_drafts(
    matchers: dict[int, Any],
    requests: list[int],
    target: np.ndarray,
    rows: np.ndarray,
    tokens: np.ndarray,
    usable: np.ndarray,
    ended: np.ndarray,
    ends: np.ndarray,
) -> np.ndarray:
    """Per request, how many leading drafts are live: the executor wrote their row, and they
    do not end the text. A draft stops the chain when the parent's row refuses it; an allowed
    draft whose row still holds the sentinel, or which is an end token (``ends``, bool
    ``[count, drafts]``), is decided on a fork: the executor takes an end token where the
    text may end, writes its row (the end tokens) and goes on, as it stops without a row at
    one after a complete grammar; a row equal to the sentinel by coincidence is kept."""
    count, drafts = tokens.shape
    if drafts == 0:
        return np.zeros(count, dtype=np.int64)
    done = compiled.chain_live(  # the same decisions in one compiled pass, when built
        target, np.ascontiguousarray(rows), np.ascontiguousarray(tokens), usable,
        np.ascontiguousarray(ended), np.ascontiguousarray(ends), _SENTINEL,
    )  # fmt: skip
    if done is not None:
        live, checks = np.array(done[0], dtype=np.int64), done[1]
    else:
        live, checks = _live_by_numpy(target, rows, tokens, usable, ended, ends)
    for k, i, intact, end in checks:
        if ended[k] or i >= live[k]:
            continue
        matcher = matchers[requests[k]]
        path = tokens[k, : i + 1].tolist()
        if intact and _stopped_at(matcher, path[:-1]):
            live[k] = i  # an end token after a complete grammar: nothing written
        elif end and _ends(matcher, path):
            live[k] = i  # an end token taken where the text may end
    return live


def _live_by_numpy(
    target: np.ndarray,
    rows: np.ndarray,
    tokens: np.ndarray,
    usable: np.ndarray,
    ended: np.ndarray,
    ends: np.ndarray,
) -> tuple[np.ndarray, list[tuple[int, int, bool, bool]]]:
    """What the compiled ``chain_live`` computes, with numpy: the drafts each request's
    parents' rows allow, and the ``(request, draft, intact, end)`` of each allowed draft to
    decide on a fork: its row still holds the sentinel, or ``ends`` flags it (none for ended
    requests)."""
    drafts = tokens.shape[1]
    limit = 32 * target.shape[1]
    safe = np.clip(tokens, 0, limit - 1)
    word, bit = safe >> 5, safe & 31
    parents, own_rows = rows[:, :-1], rows[:, 1:]
    allowed = (target[parents, word] >> bit) & 1 == 1
    allowed &= np.arange(drafts)[None, :] < usable[:, None]
    intact = (target[own_rows, 0] == _SENTINEL[0]) & (target[own_rows, -1] == _SENTINEL[1])
    live = np.where(allowed.all(axis=1), drafts, (~allowed).argmax(axis=1))
    before_stop = np.arange(drafts)[None, :] < live[:, None]
    pick = (intact | ends) & before_stop & ~ended[:, None]
    checks = [(k, i, bool(intact[k, i]), bool(ends[k, i])) for k, i in np.argwhere(pick).tolist()]
    return live, checks


def _stopped_at(matcher: Any, path: list[int]) -> bool:
    fork = matcher.deep_copy()
    return fork.try_consume_tokens(path) == len(path) and fork.is_stopped()


def _ends(matcher: Any, path: list[int]) -> bool:
    """Whether consuming ``path`` ends the grammar on its last token (an end token)."""
    fork = matcher.deep_copy()
    return fork.try_consume_tokens(path) == len(path) and fork.stop_reason() == _ENDED


# -- draft states ------------------------------------------------------------------------------
class LLGuidanceStates(NodeStates):
    """Draft states of an ``llguidance.LLMatcher``: one ``deep_copy()`` per live node that
    consumed its token (the session's matcher is never moved).

    As in the builder's walk: a node whose parent is *stopped* (the grammar is complete, only
    the end token may follow) is terminated without consuming anything, and a node whose
    token makes the stop reason ``EndOfSentence`` is terminated."""

    def __init__(self, matcher: Any, info: MatcherInfo, words: int) -> None:
        super().__init__(matcher, info, words)
        self.states: dict[int, Any] = {}
        self.stopped: dict[int, bool] = {}

    def _fill(self, state: Any, rows: np.ndarray, node: int) -> None:
        target, index = self._row_target(rows, node)
        row = target[index]
        state.unsafe_compute_mask_ptr(row.ctypes.data, self.info.words * 4)
        self._finish_row(rows, node, target)

    def start(self, rows: np.ndarray) -> bool:
        if ended(self.matcher):
            return False
        self._fill(self.matcher, rows, 0)
        self.states[0] = self.matcher
        self.stopped[0] = bool(self.matcher.is_stopped())
        return True

    def grow(
        self,
        items: Sequence[tuple[int, int, int]],
        rows: np.ndarray,
        parents: np.ndarray,
        tokens: np.ndarray,
    ) -> list[int]:
        outcomes = []
        for node, parent, token in items:
            stopped = self.stopped[parent]
            state = self.states[parent] if stopped else self.states[parent].deep_copy()
            outcome = take_token(state, token, stopped)
            if outcome == LIVE:
                self._fill(state, rows, node)
                self.states[node] = state
                self.stopped[node] = bool(state.is_stopped())
            outcomes.append(outcome)
        return outcomes

    def forced(
        self, node: int, parents: np.ndarray, tokens: np.ndarray, rows: np.ndarray, most: int
    ) -> list[int]:
        return [int(t) for t in self.states[node].compute_ff_tokens()][:most]

    def discard(self, first: int) -> None:
        for node in [n for n in self.states if n >= first]:
            del self.states[node]
            del self.stopped[node]

    def close(self) -> None:
        self.states.clear()
        self.stopped.clear()


class LLGuidanceCursor(Cursor):
    """Forced drafting on an ``llguidance.LLMatcher``: one ``deep_copy()`` walked forward (the
    matcher never moves), each token tested against the state's mask first (llguidance's
    parser takes other tokenizations of allowed text that its mask leaves out). Forced text:
    ``compute_ff_bytes()`` cut to whole characters; forced tokens: ``compute_ff_tokens()``
    (llguidance's own segmentation, by the tokenizer it was built with)."""

    def __init__(self, matcher: Any, info: MatcherInfo) -> None:
        super().__init__(matcher, info)
        self.state = matcher.deep_copy()
        self.stopped = bool(self.state.is_stopped())  # complete: only the end token follows

    def alive(self) -> bool:
        return not ended(self.state)

    def _take(self, token: int) -> int:
        outcome = take_token(self.state, token, self.stopped)
        if outcome == LIVE:
            self.stopped = bool(self.state.is_stopped())
        return outcome

    def _fill(self, out: np.ndarray) -> None:
        self.state.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def may_end(self) -> bool:
        return self.stopped or bool(self.state.is_accepting())

    def forced_text(self) -> str | None:
        return "" if self.stopped else whole_characters(bytes(self.state.compute_ff_bytes()))

    def forced_tokens(self, most: int) -> list[int] | None:
        if self.stopped:
            return []
        return [int(t) for t in self.state.compute_ff_tokens()][:most]

    def close(self) -> None:
        self.state = None
