""":func:`portable_spec.forced_drafts` for a batch of xgrammar matchers in compiled phases
(:func:`portable_spec.native.forced_run` for the common call, checked in C too;
:func:`portable_spec.native.forced_start` otherwise; :func:`portable_spec.native.forced_step`
after an ask).

Each phase walks every request that is not done, the GIL released, until the request needs
what only the tokenizer knows: a forced text's tokens, or how many of them are stable given
the mask after it. Between phases the compiled call looks each text up in the
:class:`~portable_spec.drafting.segment.Segmenter`'s replies table (what the tokenizer
answered for it before, packed) and walks on; only texts the table does not answer (new ones,
or a mask not seen with that text) come back here, and their answers go into the table. So a
batch whose forced texts were seen before costs one compiled call, instead of a Python loop of
xgrammar calls per request; the tokens are those of ``forced._draft_xgrammar``, call for
call. A request that is not done between phases holds its matcher moved; every one is rolled
back before this returns, also when something raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec import native
from portable_spec.drafting.segment import Segment, Segmenter
from portable_spec.engines.cursor import whole_characters
from portable_spec.errors import MatcherError
from portable_spec.grammars import MatcherInfo

__all__ = ["MAX_TOKENS", "draft_xgrammar_batch", "draft_xgrammar_common"]

#: requests allowed more tokens than this take the per-request path (the phases write each
#: request's drafts into one row of ``max_len`` slots)
MAX_TOKENS = 4096
_HELD, _COUNT, _LIMIT = 1, 2, 3  # columns of the phases' state (csrc/forced.c)
_NO_TEXT, _ASK_MASK = -2, -1
# the widest mask row (int32 words) of the matchers the phases walked: the common call's
# scratch width (a wider matcher declines it once, and the checked call widens this)
_width = [1]


class _Declined(Exception):
    """The compiled helper stopped serving between phases (switched off meanwhile)."""


def draft_xgrammar_common(
    matchers: Sequence[Any],
    drafts: Sequence[Any],
    limits: int | list[int],
    words: int,
    segmenter: Segmenter,
) -> list[list[int]] | None:
    """:func:`portable_spec.forced_drafts`' common call in compiled phases, its checks made
    there too (:func:`portable_spec.native.forced_run`): every matcher an xgrammar matcher the
    library probed, at most ``words`` int32 words wide (0: the widest the phases walked so
    far), ``drafts`` exact lists (or tuples) of exact ints, ``limits`` one int or one per
    request (each from 0 to :data:`MAX_TOKENS`, checked by the caller), no reasoning. Returns
    each request's drafts (``forced._draft_xgrammar``'s), or ``None`` when anything else is
    asked for (nothing moved, nothing held: the checked path serves and names what is wrong).
    Raises :class:`MatcherError` when xgrammar or the tokenizer raised; every matcher is back
    then. Holds the matchers (:mod:`portable_spec.pending`) for the call. Blocks for host work
    only."""
    count = len(matchers)
    cap = max(1, limits if type(limits) is int else max(limits))
    width = words or _width[0]
    sizes = (count * 8, count * cap, (count * width + 1) // 2)
    block = np.empty(sum(sizes), dtype=np.int64)  # state, drafts, mask rows (csrc/forced.c)
    token = object()
    arrays: tuple[np.ndarray, ...] = ()  # carved when the phases stop short
    try:
        done = native.forced_run(
            matchers, drafts, limits, token, block, cap, width, segmenter.replies
        )
        if done is None:
            return None
        if done[0] is None and done[1] < 0:
            return done[3]  # type: ignore[no-any-return]  # every request done in the call
        arrays = _carve(block, sizes, count, cap, width)
        return _finish(done, list(matchers), range(count), *arrays, segmenter)
    except _Declined:
        return None
    finally:
        try:
            if arrays:  # (a raising forced_run left nothing moved)
                _roll_back(matchers, arrays[0])
        finally:
            native.forced_release(token, matchers)


def _carve(
    block: np.ndarray, sizes: tuple[int, int, int], count: int, cap: int, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The state, drafts and mask rows :func:`portable_spec.native.forced_run` keeps in
    ``block``, as the arrays :func:`portable_spec.native.forced_step` takes."""
    state = block[: sizes[0]].reshape(count, 8)
    out = block[sizes[0] : sizes[0] + sizes[1]].reshape(count, cap)
    rows = block[sizes[0] + sizes[1] :].view(np.int32)[: count * width].reshape(count, width)
    return state, out, rows


def draft_xgrammar_batch(
    matchers: Sequence[Any],
    infos: Sequence[MatcherInfo],
    indices: Sequence[int],
    rows: list[list[int]],
    limits: Sequence[int],
    starts: Sequence[list[int]],
    content_ends: list[bool],
    segmenter: Segmenter,
) -> list[list[int]] | None:
    """Drafts of xgrammar requests (``forced._draft_xgrammar``'s, per request).

    Args:
        matchers, infos: the requests' xgrammar matchers (probed, callable by the compiled
            helper) and their facts.
        indices: each request's index in the caller's batch (named in errors).
        rows: proposed drafts per request (lists of ints).
        limits: the most tokens per request (each at most :data:`MAX_TOKENS`).
        starts: tokens each request's drafts start with (a reasoning's free tokens).
        content_ends: whether a request's first draft ends its reasoning.
        segmenter: the tokenizer's segmenter.

    Returns:
        Each request's drafts, or ``None`` when the compiled helper cannot walk them (nothing
        moved: the caller's per-request path serves them). Raises :class:`MatcherError` (the
        caller's index) when xgrammar or the tokenizer raised; every matcher is back then.
        Blocks for host work only.
    """
    count = len(matchers)
    cap = max(1, max(limits, default=0))
    words = max((info.words for info in infos), default=1)
    if words > _width[0]:
        _width[0] = words
    state = np.zeros((count, 8), dtype=np.int64)
    out = np.empty((count, cap), dtype=np.int64)  # read up to each request's count only
    masks = np.empty((count, words), dtype=np.int32)  # read after a fill only
    state[:, _LIMIT] = limits
    for c, start in enumerate(starts):
        if start:
            out[c, : len(start)] = start
            state[c, _COUNT] = len(start)
    matchers = list(matchers)
    try:
        done = native.forced_start(
            matchers, rows, content_ends, state, out, masks, segmenter.replies
        )
        if done is None:
            return None
        return _finish(done, matchers, indices, state, out, masks, segmenter)
    except _Declined:
        return None
    finally:
        _roll_back(matchers, state)


def _roll_back(matchers: Sequence[Any], state: np.ndarray) -> None:
    """Every matcher a phase left moved, back where it was."""
    for c in np.flatnonzero(state[:, _HELD]).tolist():
        held = int(state[c, _HELD])
        state[c, _HELD] = 0
        matchers[c].rollback(held)


def _finish(
    done: tuple[Any, ...],
    matchers: list[Any],
    indices: Sequence[int],
    state: np.ndarray,
    out: np.ndarray,
    masks: np.ndarray,
    segmenter: Segmenter,
) -> list[list[int]]:
    """The asks of the phases answered until every request is done; its drafts. Raises
    :class:`_Declined` when the helper stops serving meanwhile."""
    count = len(matchers)
    asked: list[Any] = [None] * count  # the forced text each request was asked for last
    while True:
        asks, failed, message, drafted = done
        if failed >= 0:
            raise MatcherError(indices[failed], RuntimeError(message))
        if asks is None:
            return drafted  # type: ignore[no-any-return]
        answers: list[Any] = [None] * count
        for c, ask in enumerate(asks):
            if ask is None:
                continue
            try:
                answers[c] = _reply(c, ask, asked, segmenter, masks)
            except BaseException as exc:
                raise MatcherError(indices[c], exc) from exc
        done = native.forced_step(matchers, answers, state, out, masks, segmenter.replies)
        if done is None:
            raise _Declined


def _reply(
    c: int, ask: Any, asked: list[Any], segmenter: Segmenter, masks: np.ndarray
) -> tuple[Any, ...]:
    """The answer to request ``c``'s ask (see ``csrc/forced.c``); what it teaches about a
    forced text goes into the segmenter's replies table too (the phases answer from it)."""
    stable = type(ask) is tuple  # (text,): the mask after the whole text is in masks[c]
    if stable:  # (None,): the text is the one this request was asked for last
        ask = asked[c] if ask[0] is None else ask[0]
    else:
        asked[c] = ask
    if type(ask) is str:
        text, key = ask, ask.encode()
    else:
        key = bytes(ask)
        text = whole_characters(key)
    if not text:
        segmenter.remember(key, _packed(((), _NO_TEXT)))
        return (), _NO_TEXT
    segment = segmenter.segment(text)
    if stable:  # how many of the text's tokens are stable
        keep = segmenter.stable(text, segment, lambda: masks[c])
        segmenter.remember(key, _packed(_text_reply(segment)))
        return segment.tokens, keep
    reply = _text_reply(segment)
    segmenter.remember(key, _packed(reply))
    return reply


def _packed(reply: tuple[Any, ...]) -> bytes:
    """A text's answer as the replies table keeps it (``csrc/forced.c``'s fx_reply_packed):
    int64 ``[keep, tokens, words, entries, *tokens, *words, *known]``, one block the phases
    copy with one look-up."""
    tokens, keep = reply[0], reply[1]
    words, known = (reply[2], reply[3]) if len(reply) == 4 else ((), ())
    entries = len(known) // (len(words) + 1)
    head = [keep, len(tokens), len(words), entries]
    return np.array([*head, *tokens, *words, *known], dtype=np.int64).tobytes()


def _text_reply(segment: Segment) -> tuple[Any, ...]:
    """The answer to a forced text: its tokens and how many are stable whatever follows, when
    no character class merges with its end (known once the first stability check of this text
    ran); else the phase fills the mask, looks its words up among the counts known for this
    text, and asks when they are not there."""
    if segment.merging == ():
        return segment.tokens, len(segment.tokens)
    if segment.merging is None:
        return segment.tokens, _ASK_MASK
    return segment.tokens, _ASK_MASK, segment.words, segment.known()
