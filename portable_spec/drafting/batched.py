""":func:`portable_spec.forced_drafts` for a batch of xgrammar matchers in a few compiled
phases (:func:`portable_spec.native.forced_start`, :func:`portable_spec.native.forced_step`).

Each phase walks every request that is not done, the GIL released, until the request asks for
what only the tokenizer knows: a forced text to segment, or how many of a text's tokens are
stable given the mask after it. The answers (cached per text by the
:class:`~portable_spec.drafting.segment.Segmenter`) go to the next phase. So a batch costs a
few compiled calls and one dictionary lookup per forced text, instead of a Python loop of
xgrammar calls per request; the tokens are those of ``forced._draft_xgrammar``, call for
call. A request that is not done between phases holds its matcher moved; every one is rolled
back before this returns, also when something raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from portable_spec import native
from portable_spec.drafting.segment import Segment, Segmenter
from portable_spec.engines.cursor import whole_characters
from portable_spec.errors import MatcherError
from portable_spec.grammars import MatcherInfo

__all__ = ["MAX_TOKENS", "draft_xgrammar_batch"]

#: requests allowed more tokens than this take the per-request path (the phases write each
#: request's drafts into one row of ``max_len`` slots)
MAX_TOKENS = 4096
_HELD, _COUNT, _LIMIT = 1, 2, 3  # columns of the phases' state (csrc/forced.c)
_NO_TEXT, _ASK_MASK = -2, -1


class _Declined(Exception):
    """The compiled helper stopped serving between phases (switched off meanwhile)."""


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
    state = np.zeros((count, 8), dtype=np.int64)
    out = np.empty((count, cap), dtype=np.int64)  # read up to each request's count only
    masks = np.empty((count, words), dtype=np.int32)  # read after a fill only
    state[:, _LIMIT] = limits
    for c, start in enumerate(starts):
        if start:
            out[c, : len(start)] = start
            state[c, _COUNT] = len(start)
    matchers = list(matchers)
    texts: list[str] = [""] * count
    segments: list[Segment | None] = [None] * count
    try:
        phase = _phase(native.forced_start, matchers, (rows, content_ends), state, out, masks)
        while True:
            asks, failed, message = phase
            if failed >= 0:
                raise MatcherError(indices[failed], RuntimeError(message))
            replies: list[Any] | None = None
            for c, ask in enumerate(asks):
                if ask is None:
                    continue
                if replies is None:
                    replies = [None] * count
                try:
                    replies[c] = _reply(c, ask, texts, segments, segmenter, masks, infos[c])
                except BaseException as exc:
                    raise MatcherError(indices[c], exc) from exc
            if replies is None:
                break
            phase = _phase(native.forced_step, matchers, (replies,), state, out, masks)
        counts = state[:, _COUNT].tolist()
        drafted = out.tolist()
        return [row[:n] for row, n in zip(drafted, counts, strict=True)]
    except _Declined:
        return None
    finally:
        for c in np.flatnonzero(state[:, _HELD]).tolist():
            held = int(state[c, _HELD])
            state[c, _HELD] = 0
            matchers[c].rollback(held)


def _phase(
    call: Callable[..., Any],
    matchers: list[Any],
    lists: tuple[list[Any], ...],
    state: np.ndarray,
    out: np.ndarray,
    masks: np.ndarray,
) -> tuple[list[Any], int, str | None]:
    """One phase over every request, in one call (the GIL released inside); raises
    :class:`_Declined` when the helper declines (nothing moved by this call)."""
    done = call(matchers, *lists, state, out, masks)
    if done is None:
        raise _Declined
    return done  # type: ignore[no-any-return]


def _reply(
    c: int,
    ask: Any,
    texts: list[str],
    segments: list[Segment | None],
    segmenter: Segmenter,
    masks: np.ndarray,
    info: MatcherInfo,
) -> tuple[Any, ...]:
    """The answer to request ``c``'s ask (see ``csrc/forced.c``)."""
    if ask is True:  # the mask after the whole text: how many of its tokens are stable
        segment = segments[c]
        assert segment is not None
        keep = segmenter.stable(texts[c], segment, lambda: masks[c, : info.words])
        return segment.tokens, keep
    text = ask if type(ask) is str else whole_characters(bytes(ask))
    if not text:
        return (), _NO_TEXT
    segment = segmenter.segment(text)
    texts[c], segments[c] = text, segment
    # stable whatever follows when no character class merges with its end (known once the
    # first stability check of this text ran); else the phase fills the mask, looks its words
    # up among the counts known for this text, and asks when they are not there
    if segment.merging == ():
        return segment.tokens, len(segment.tokens)
    if segment.merging is None:
        return segment.tokens, _ASK_MASK
    return segment.tokens, _ASK_MASK, segment.words, segment.known()
