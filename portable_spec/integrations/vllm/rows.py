"""vLLM's bitmask rows for a speculative step: the rules every path of the plugin writes by.

Every path (xgrammar's and guidance's short paths, the checked path through the library's
build) writes the rows vLLM's own ``grammar_bitmask`` writes, by these rules:

1. **Layout.** Per structured request with ``m`` scheduled drafts (``-1`` padding counted),
   ``m + 1`` rows: row ``i`` is the grammar's mask after the first ``i`` drafts. *Packed*
   (vLLM 0.32): the requests' rows back to back, in ``structured_output_request_ids`` order.
   *Strided* (0.33): request ``b``'s rows start at ``b * (K + 1)``; vLLM leaves the rows past
   a request's ``m + 1`` unwritten and never reads them: the plugin writes them all-allowed and
   lists them in :attr:`Rows.unwritten`, the one way every path hands them back (shadow mode
   does not compare them).
2. **Padding.** With ``p`` the first ``-1``, the grammar takes drafts up to ``p`` only; the
   rows after row ``p`` are all-allowed.
3. **Reasoning.** With vLLM's bounds ``(g, c)`` (``g``: the first draft the grammar takes,
   ``c``: the first row it masks, ``g`` or ``g + 1``), rows before ``c`` are all-allowed; with
   ``g > p`` or ``c > p`` every row is. Strided rows still reasoning (``< c``, ``<= p``) ban
   the implicit reasoning ends vLLM names.
4. **Terminated.** A grammar that accepted its stop token gets all-allowed rows.
5. **A refused draft** (xgrammar, outlines: the parent row's mask decides): every later row of
   the request repeats the row before it (vLLM's loop stops advancing there).
6. **Guidance** (llguidance: its parser decides whether a draft is consumed, see
   :func:`guidance_tail`): after a refused draft the last row filled repeats; after the end
   token (consumed, or offered once the grammar is complete) every later row is all-allowed;
   a complete grammar's rows repeat its end-token row until then.

Nothing here reads vLLM's objects; the callers hand in what vLLM's internals say.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Plan",
    "Rows",
    "finish_rows",
    "first_padding",
    "guidance_tail",
    "stride_of",
    "unwritten_rows",
]


class Rows(NamedTuple):
    """A step's rows as a path wrote them.

    Attributes:
        rows: int32 ``[rows used, words]``, the view of vLLM's buffer (or shadow mode's
            scratch buffer) that was written; what ``grammar_bitmask`` returns.
        unwritten: the rows vLLM leaves unwritten and never reads (strided layout only; the
            plugin writes them all-allowed).
    """

    rows: np.ndarray
    unwritten: list[int]


def stride_of(layout: str, k: int) -> int:
    """Rows per request block: ``0`` for packed rows, ``k + 1`` for strided ones."""
    if layout == "packed":
        return 0
    if layout == "strided":
        return k + 1
    raise ValueError(f"layout must be 'packed' or 'strided', got {layout!r}")


def first_padding(tokens: Sequence[int]) -> int:
    """The position of the first ``-1`` padding among ``tokens`` (``len(tokens)``: none)."""
    if not tokens or min(tokens) >= 0:
        return len(tokens)
    return next(i for i, t in enumerate(tokens) if t < 0)


def unwritten_rows(drafts: Sequence[Sequence[int]], stride: int) -> list[int]:
    """Rule 1: the strided layout's rows past each request's chain (none for packed rows)."""
    unwritten: list[int] = []
    if stride:
        for c, tokens in enumerate(drafts):
            first, length = c * stride, len(tokens) + 1
            if length < stride:
                unwritten.extend(range(first + length, first + stride))
    return unwritten


def guidance_tail(
    out: np.ndarray, row: int, chain: Sequence[int], m: int, c: int, stopped: bool, eos: int
) -> None:
    """Rules 2 and 6 on one guidance request's rows ``out[row : row + m + 1]``, once rows
    ``row .. row + c`` hold llguidance's masks: ``chain`` the drafts before the padding
    (``p = len(chain)``), ``c`` how many of them the matcher consumed, ``stopped`` whether the
    grammar was complete after them (with ``c < p``), ``eos`` the end token. The Python twin of
    the compiled ``ps_guidance_tail``."""
    p = len(chain)
    end = row + m
    if eos in chain[:c]:  # consumed: the grammar ended; every later row all-allowed
        out[row + chain.index(eos) + 1 : end + 1] = -1
    elif stopped:
        # complete grammar: vLLM's wrapper takes every draft without consuming it, each row
        # the end-token row, until the end token (then all-allowed, as after padding)
        e = chain.index(eos, c) if eos in chain[c:] else p
        out[row + c + 1 : row + e + 1] = out[row + c]
        out[row + e + 1 : end + 1] = -1
    elif c < p:  # refused: the last row filled repeats
        out[row + c + 1 : end + 1] = out[row + c]
    elif p < m:
        out[row + p + 1 : end + 1] = -1


class Plan:
    """One step's rows as chain segments for the library's packed build (the checked path):
    segments back to back, one per grammar span or all-allowed span, by rules 1 to 4."""

    __slots__ = (
        "ends",
        "forced",
        "grammar_segments",
        "masked",
        "matchers",
        "offsets",
        "stride_k",
        "tokens",
        "total",
        "unwritten",
        "xgrammar_only",
    )

    def __init__(self, stride_k: int | None) -> None:
        self.stride_k = stride_k  # strided layout: K; packed: None
        self.matchers: list[Any] = []  # one per segment; None: all-allowed rows
        self.tokens: list[int] = []  # segment chains back to back, root first
        self.offsets: list[int] = [0]  # first row of each segment, then the total
        self.ends: list[int] = []  # per segment: one past the request's last row
        self.forced: list[int] = []  # rows vLLM leaves all-allowed inside a grammar segment
        self.masked: list[tuple[int, int, tuple[int, ...]]] = []  # reasoning rows, banned ids
        self.unwritten: list[int] = []  # strided: rows past a request's chain
        self.grammar_segments: list[int] = []  # segments with a matcher and drafts
        self.xgrammar_only = True  # every matcher an xgrammar one (the build flags the nodes)
        self.total = 0

    def add(self, matcher: Any, chain: Sequence[int], end: int) -> None:
        """One segment: ``chain`` (root first) walked by ``matcher``, or all-allowed rows."""
        if matcher is not None and len(chain) > 1:
            self.grammar_segments.append(len(self.matchers))
        self.matchers.append(matcher)
        self.tokens.extend(chain)
        self.total += len(chain)
        self.offsets.append(self.total)
        self.ends.append(end)

    def add_request(
        self,
        matcher: Any,
        tokens: Sequence[int],
        *,
        terminated: bool,
        xgrammar: bool,
        p: int | None = None,
        bounds: tuple[int, int] = (0, 0),
        banned: Callable[[], Sequence[int]] | None = None,
    ) -> None:
        """One request's rows: its drafts ``tokens``, ``p`` its first padding (computed when
        None), ``bounds`` vLLM's ``(g, c)``, ``banned`` what its rows still reasoning ban
        (asked only for strided rows with ``c > 0``)."""
        m = len(tokens)
        if p is None:
            p = first_padding(tokens)
        g, c = bounds
        start = self.total
        end = start + m + 1
        if terminated or g > p or c > p:
            self.add(None, [0] * (m + 1), end)
        else:
            if g > 0:
                self.add(None, [0] * g, end)
            if c > g:
                self.forced.append(start + g)
            self.add(matcher, [0, *tokens[g:p]], end)
            self.xgrammar_only &= xgrammar
            if p < m:
                self.add(None, [0] * (m - p), end)
        if self.stride_k is None:
            return
        if c > 0 and banned is not None:
            ids = tuple(banned())
            if ids:
                self.masked.append((start, start + min(c, p + 1), ids))
        tail = self.stride_k - m
        if tail > 0:
            self.unwritten.extend(range(end, end + tail))
            self.add(None, [0] * tail, end + tail)


def finish_rows(plan: Plan, out: np.ndarray, valid: np.ndarray | None) -> None:
    """After the library wrote ``plan``'s chains into ``out`` (int32 ``[plan.total, words]``):
    the forced rows all-allowed, the reasoning bans cleared, and rule 5 from the build's node
    flags (``valid``: bool ``[plan.total]``) or, without them, from the rows themselves."""
    for row in plan.forced:
        out[row] = -1
    if plan.masked:
        bits = out.view(np.uint32)
        for lo, hi, banned in plan.masked:
            ids = np.asarray(banned, dtype=np.int64)
            bits[lo:hi, ids >> 5] &= ~(np.uint32(1) << (ids & 31).astype(np.uint32))
    if not plan.grammar_segments:
        return
    if valid is None:
        _repeat_after_refused(plan, out)
    elif not valid.all():
        _repeat_after_invalid(plan, out, valid)


def _repeat_after_invalid(plan: Plan, out: np.ndarray, valid: np.ndarray) -> None:
    """Rule 5 from the build's node flags: a grammar segment's first node the build did not
    accept is its first refused draft (or a draft after a terminated node, whose rows are
    all-allowed either way); free segments' nodes are all accepted."""
    offsets, done = plan.offsets, set()
    for row in np.flatnonzero(~valid).tolist():
        s = bisect.bisect_right(offsets, row) - 1
        if s in done or plan.matchers[s] is None or row == offsets[s]:
            continue
        done.add(s)
        out[row : plan.ends[s]] = out[row - 1]


def _repeat_after_refused(plan: Plan, out: np.ndarray) -> None:
    """Rule 5 from the rows: a draft is refused where its bit is clear in its parent's final
    row (rows all-allowed after a terminated or refused node let every token through, and
    there vLLM's repeated row is all-allowed too)."""
    offsets, tokens = plan.offsets, plan.tokens
    rows, drafts = [], []
    for s in plan.grammar_segments:
        lo, hi = offsets[s], offsets[s + 1]
        rows.extend(range(lo, hi - 1))
        drafts.extend(tokens[lo + 1 : hi])
    parent = np.asarray(rows, dtype=np.int64)
    token = np.asarray(drafts, dtype=np.int64)
    words = out.shape[1]
    inside = token < words * 32
    word = out.view(np.uint32)[parent, np.where(inside, token >> 5, 0)]
    allowed = inside & ((word >> (token & 31).astype(np.uint32)) & 1).astype(bool)
    if allowed.all():
        return
    refused = set(np.flatnonzero(~allowed).tolist())
    i = 0
    for s in plan.grammar_segments:
        lo, hi = offsets[s], offsets[s + 1]
        for j in range(hi - lo - 1):
            if i + j in refused:
                first = lo + 1 + j
                out[first : plan.ends[s]] = out[first - 1]
                break
        i += hi - lo - 1
