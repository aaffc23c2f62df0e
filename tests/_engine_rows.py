"""How TensorRT-LLM lays out and fills the grammar rows of a speculative step,
re-implemented in our own words, for the recipe tests (``tests/test_recipes.py``).

Nothing here calls portable_spec. Every engine model advances its *own* matchers, made fresh
from a :class:`_oracle.Request` (the grammar and the request's committed tokens), exactly as
that engine moves its matchers; the library under test gets separate matchers.

**TensorRT-LLM** (``GuidedDecoder._build``, ``_rollback_rejected_tokens``, the
``logits_bitmask`` kernel):

* Every scheduled request has rows, grammar or not: context requests 1, generation requests
  ``max_draft + 1``; contexts first. A per-row ``token_mask`` says which rows the kernel
  applies; rows it does not fill keep whatever the buffer held and are skipped.
* A context request on its last chunk gets a new matcher and its first row.
* A generation request's matcher first accepts the token sampled last step (``new_token``)
  inside the build; then: fill the row, accept each draft, fill the next row; a refused draft or
  a terminated matcher stops the walk (the rest of the rows are skipped by ``token_mask``).
  After verification the matcher is rolled back by the tokens it advanced beyond the new token
  and the accepted drafts.
* With a draft-to-target vocabulary map ``d2t``, logit ``j`` of a drafter's row reads the
  target bit ``j + d2t[j]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from _oracle import Request

ALL_ALLOWED = -1
PADDING = -1  # a draft position with no draft (vLLM's placeholder)


def bit(row: np.ndarray, token: int) -> bool:
    """Whether ``row`` allows ``token``."""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def grammar_row(matcher: object, words: int) -> np.ndarray:
    """The matcher's mask now (``words`` wide)."""
    row = np.zeros((1, words), dtype=np.int32)
    matcher.fill_next_token_bitmask(row, 0)  # type: ignore[attr-defined]
    return row[0]


def masked_logits(logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``logits`` with ``-inf`` wherever the row's bit is clear (our own bit unpacking)."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(rows.view(np.uint8), axis=-1, bitorder="little")[..., :vocab]
    return np.where(bits.astype(bool), logits, -np.inf)


# -- reasoning -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningParser:
    """What a reasoning parser tells the structured-output manager: the explicit end tokens
    (``</think>``: the grammar starts after them) and the implicit ones (the answer's first
    token, consumed by the grammar)."""

    end_ids: frozenset[int]
    implicit_end_ids: frozenset[int] = frozenset()


# -- TensorRT-LLM ----------------------------------------------------------------------------------


@dataclass
class TrtRequest:
    """A scheduled TensorRT-LLM request: a context request on its last chunk (``context``) or
    a generation request in progress, with or without guided decoding (``grammar``)."""

    slot: int
    grammar: Request | None
    context: bool
    new_token: int = 0  # generation: the token sampled last step, not yet in the matcher
    drafts: list[int] = field(default_factory=list)


class TrtGuidedDecoder:
    """TensorRT-LLM's guided decoder: per-slot matchers, the row layout, ``token_mask``, the
    build that advances the matchers and the rollback after verification."""

    def __init__(self, max_draft: int, words: int, capacity: int, seed: int = 0) -> None:
        self.max_draft = max_draft
        self.words = words
        rng = np.random.default_rng(seed)
        # a pinned buffer reused step after step: rows not filled hold stale data
        self.bitmask = rng.integers(-(2**31), 2**31, size=(capacity, words), dtype=np.int64)
        self.bitmask = self.bitmask.astype(np.int32)
        self.token_mask = np.zeros(capacity, dtype=np.int32)
        self.matchers: dict[int, object] = {}
        self.advanced: dict[int, int] = {}

    def rows_of(self, request: TrtRequest) -> int:
        """Rows a request occupies."""
        return 1 if request.context else self.max_draft + 1

    def build(self, requests: Sequence[TrtRequest]) -> tuple[np.ndarray, np.ndarray]:
        """Fill the rows of one step; returns ``(bitmask, token_mask)`` of its rows."""
        total = sum(self.rows_of(r) for r in requests)
        self.token_mask[:total] = 0
        offset = 0
        for request in requests:
            slot = request.slot
            self.advanced[slot] = 0
            if request.grammar is not None:
                self._build_one(request, offset)
            offset += self.rows_of(request)
        return self.bitmask[:total], self.token_mask[:total]

    def _build_one(self, request: TrtRequest, offset: int) -> None:
        slot = request.slot
        if request.context:
            self.matchers[slot] = request.grammar.fresh()  # type: ignore[union-attr]
            matcher = self.matchers[slot]
        else:
            matcher = self.matchers[slot]
            if matcher.is_terminated():  # type: ignore[attr-defined]
                return
            if not matcher.accept_token(request.new_token):  # type: ignore[attr-defined]
                raise ValueError(f"slot {slot} refused its new token {request.new_token}")
        self.advanced[slot] += 1
        if matcher.is_terminated():  # type: ignore[attr-defined]
            return
        self._fill(matcher, offset)
        for i, token in enumerate(request.drafts, 1):
            if not matcher.accept_token(token):  # type: ignore[attr-defined]
                break
            self.advanced[slot] += 1
            if matcher.is_terminated():  # type: ignore[attr-defined]
                break
            self._fill(matcher, offset + i)

    def _fill(self, matcher: object, row: int) -> None:
        self.bitmask[row] = grammar_row(matcher, self.words)
        self.token_mask[row] = 1

    def rollback_rejected(self, requests: Sequence[TrtRequest], accepted: dict[int, int]) -> None:
        """After verification: keep the new token and the ``accepted[slot]`` accepted drafts."""
        for request in requests:
            slot = request.slot
            if request.grammar is None or self.advanced.get(slot, 0) <= 0:
                continue
            back = self.advanced[slot] - (1 + accepted.get(slot, 0))
            if back < 0:
                raise ValueError(f"slot {slot}: cannot roll back {back} tokens")
            if back:
                self.matchers[slot].rollback(back)  # type: ignore[attr-defined]


def trt_apply(
    logits: np.ndarray,
    bitmask: np.ndarray,
    token_mask: np.ndarray,
    d2t: np.ndarray | None = None,
) -> np.ndarray:
    """The ``logits_bitmask`` kernel: rows whose ``token_mask`` is 0 are left alone; with
    ``d2t``, logit ``j`` (a drafter's vocabulary) reads the target bit ``j + d2t[j]``."""
    out = logits.copy()
    for r in np.flatnonzero(token_mask):
        row = bitmask[r]
        if d2t is None:
            out[r] = masked_logits(logits[r], row)
        else:
            target = np.arange(logits.shape[-1]) + d2t
            allowed = (row.view(np.uint32)[target // 32] >> (target % 32).astype(np.uint32)) & 1
            out[r] = np.where(allowed.astype(bool), logits[r], -np.inf)
    return out


# -- verification (what an engine samples from the masked logits) ------------------------------


def greedy_verify(
    masked: np.ndarray, drafts: Sequence[int], stop_ids: frozenset[int]
) -> tuple[int, list[int]]:
    """Greedy verification of one request's chain: ``masked`` holds its ``len(drafts) + 1``
    masked logit rows. Returns ``(accepted drafts, emitted tokens)``: drafts are accepted while
    the target's choice equals them (``-1`` never matches) and the request ends at an accepted
    stop token; otherwise the token chosen at the first mismatch (or after the last draft) is
    emitted too."""
    emitted: list[int] = []
    for i, draft in enumerate(drafts):
        choice = int(np.argmax(masked[i]))
        emitted.append(choice)
        if choice != draft:
            return i, emitted
        if choice in stop_ids:
            return i + 1, emitted
    emitted.append(int(np.argmax(masked[len(drafts)])))
    return len(drafts), emitted


def sampled_rows(rows: np.ndarray, drafts: Sequence[int]) -> list[int]:
    """Indices of the rows a verification can reach under these masks: row 0, and row
    ``i + 1`` while row ``i`` is reachable and allows draft ``i`` (``-1`` never does)."""
    reach = [0]
    for i, draft in enumerate(drafts):
        if draft < 0 or not bit(rows[i], draft):
            break
        reach.append(i + 1)
    return reach
