"""How vLLM (0.33) and TensorRT-LLM lay out and fill the grammar rows of a speculative step,
re-implemented in our own words, for the recipe tests (``tests/test_recipes.py``).

Nothing here calls portable_spec. Every engine model advances its *own* matchers, made fresh
from a :class:`_oracle.Request` (the grammar and the request's committed tokens), exactly as
that engine moves its matchers; the library under test gets separate matchers.

**vLLM v1** (``StructuredOutputManager.grammar_bitmask`` and the worker's apply):

* The manager lists only requests with a grammar (``structured_output_request_ids``), in that
  order; every request occupies ``K + 1`` rows (``K`` = ``num_speculative_tokens``: one row
  per draft position and one for the bonus token). Drafts are padded with ``-1`` to ``K``.
* Row ``i`` of a request is the mask after its first ``i`` drafts. It is filled serially on
  the request's matcher: fill row ``i``, then accept draft ``i``, ... and roll back at the end.
* A ``-1`` draft stops the walk: every later row is all-allowed. A terminated matcher (the
  end token was accepted) gives all-allowed rows.
* Requests whose reasoning has ended get their drafts validated before scheduling
  (``validate_tokens``: the longest prefix the grammar accepts, stopping after a token that
  terminates it; the rest becomes ``-1``), so every accept succeeds. Requests still reasoning
  are not validated: their drafts reach the fill as the drafter wrote them.
* Reasoning: while the request reasons, rows allow everything except the *implicit* end tokens
  (tokens that end the reasoning and are also the answer's first token, such as a tool-call
  start) that the grammar would refuse as its first token. Scanning the drafts, an explicit end
  token at draft ``j`` starts the grammar after it (the grammar consumes drafts from ``j + 1``,
  rows from ``j + 1`` are the grammar's); an implicit end at ``j`` is consumed by the grammar
  (drafts from ``j``; rows from ``j + 1``). These are ``_get_constraint_bounds``'s
  ``grammar_start`` and ``constraint_start``.
* A draft the grammar refuses on that unvalidated path ends the walk: the rows after it repeat
  the last row written (``after_failure="copy"``, the convention the issue reports for 0.33) or
  are all-allowed (``"full"``, what the ``failed`` flag of the loop quoted in vLLM PR #54442
  gives). Both are modelled; neither row can be sampled (the draft is refused by the row before
  it, so the verify rejects it).
* The worker maps each request's rows onto its logits rows by request id (requests without a
  grammar keep their logits) and sets the logits of refused tokens to ``-inf``.

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


def words_of(vocab: int) -> int:
    """int32 words of a ``vocab``-token row."""
    return -(-vocab // 32)


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


# -- vLLM ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningParser:
    """What a reasoning parser tells the structured-output manager: the explicit end tokens
    (``</think>``: the grammar starts after them) and the implicit ones (the answer's first
    token, consumed by the grammar)."""

    end_ids: frozenset[int]
    implicit_end_ids: frozenset[int] = frozenset()


@dataclass
class VllmRequest:
    """A vLLM request with a grammar: its grammar and committed answer tokens, and whether its
    reasoning had ended before this step (``structured_output_request.reasoning_ended``)."""

    grammar: Request
    reasoning_ended: bool = True


def vllm_validate_tokens(request: VllmRequest, drafts: Sequence[int]) -> list[int]:
    """``validate_tokens``: the longest prefix of ``drafts`` the grammar accepts from the
    committed state, ending after a token that terminates it (a fresh matcher; nothing kept)."""
    matcher = request.grammar.fresh()
    kept: list[int] = []
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(int(token)):
            break
        kept.append(int(token))
    return kept


def vllm_schedule(
    request: VllmRequest | None, drafts: Sequence[int], k: int, validate: bool = True
) -> list[int]:
    """The drafts vLLM hands to ``grammar_bitmask`` for a request: validated when its reasoning
    has ended (and ``validate``), then padded with ``-1`` to ``k`` (the fixed row stride)."""
    drafts = [int(t) for t in drafts]
    if request is not None and request.reasoning_ended and validate:
        drafts = vllm_validate_tokens(request, drafts)
    return drafts + [PADDING] * (k - len(drafts))


def vllm_constraint_bounds(
    request: VllmRequest, drafts: Sequence[int], parser: ReasoningParser | None
) -> tuple[int, int]:
    """``(grammar_start, constraint_start)``: the first draft the grammar consumes and the
    first row it fills. Past the window (``len(drafts) + 1``) when the reasoning does not end
    in it."""
    if parser is None or request.reasoning_ended:
        return 0, 0
    for j, token in enumerate(drafts):
        if token == PADDING:
            break
        if token in parser.end_ids:
            return j + 1, j + 1
        if token in parser.implicit_end_ids:
            return j, j + 1
    beyond = len(drafts) + 1
    return beyond, beyond


def vllm_reasoning_row(
    request: VllmRequest, parser: ReasoningParser, words: int, vocab: int
) -> np.ndarray:
    """The row of a position still reasoning: all allowed but the implicit end tokens the
    grammar refuses as its first token (``_masked_reasoning_ends``)."""
    row = np.full(words, ALL_ALLOWED, dtype=np.int32)
    first = grammar_row(request.grammar.fresh(), words)
    unsigned = row.view(np.uint32)
    for token in parser.implicit_end_ids:
        if 0 <= token < vocab and not bit(first, token):
            unsigned[token // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (token % 32)))
    return row


def vllm_request_rows(
    request: VllmRequest,
    drafts: Sequence[int],
    words: int,
    vocab: int,
    parser: ReasoningParser | None = None,
    after_failure: str = "copy",
) -> np.ndarray:
    """One request's ``[len(drafts) + 1, words]`` rows as vLLM's serial fill writes them
    (``drafts`` as scheduled: ``-1`` padded). ``after_failure``: ``"copy"`` or ``"full"``, the
    rows after a draft the grammar refuses on the unvalidated path (see the module doc)."""
    if after_failure not in ("copy", "full"):
        raise ValueError(f"after_failure must be 'copy' or 'full', got {after_failure!r}")
    k = len(drafts)
    grammar_start, constraint_start = vllm_constraint_bounds(request, drafts, parser)
    reasoning = (
        vllm_reasoning_row(request, parser, words, vocab)
        if parser is not None and constraint_start > 0
        else None
    )
    full = np.full(words, ALL_ALLOWED, dtype=np.int32)
    matcher = request.grammar.fresh()
    rows = np.empty((k + 1, words), dtype=np.int32)
    padded = failed = False
    for i in range(k + 1):
        if padded:
            rows[i] = full
        elif i < constraint_start:
            assert reasoning is not None
            rows[i] = reasoning
        elif failed:
            rows[i] = rows[i - 1] if after_failure == "copy" else full
        elif matcher.is_terminated():
            rows[i] = full
        else:
            rows[i] = grammar_row(matcher, words)
        if i == k:
            break
        token = int(drafts[i])
        if token == PADDING:
            padded = True
        elif i >= grammar_start and not failed and not matcher.is_terminated():
            failed = not matcher.accept_token(token)
    return rows


def vllm_grammar_bitmask(
    requests: dict[str, VllmRequest],
    structured_ids: Sequence[str],
    scheduled: dict[str, list[int]],
    k: int,
    words: int,
    vocab: int,
    parser: ReasoningParser | None = None,
    after_failure: str = "copy",
) -> np.ndarray | None:
    """The manager's bitmask: ``K + 1`` rows per request of ``structured_ids``, in that order
    (``None`` when no request has a grammar). ``scheduled`` holds the drafts as scheduled."""
    if not structured_ids:
        return None
    blocks = []
    for req_id in structured_ids:
        drafts = scheduled.get(req_id, [])
        drafts = list(drafts) + [PADDING] * (k - len(drafts))
        blocks.append(
            vllm_request_rows(requests[req_id], drafts, words, vocab, parser, after_failure)
        )
    return np.concatenate(blocks)


def vllm_apply(
    logits: np.ndarray,
    bitmask: np.ndarray | None,
    batch_ids: Sequence[str],
    structured_ids: Sequence[str],
    k: int,
) -> np.ndarray:
    """The worker side: ``logits`` has ``K + 1`` rows per request in the running batch's order
    (``batch_ids``); each grammar request's rows get its bitmask rows, found by request id; the
    others are left as they are. Returns the masked logits (a copy)."""
    out = logits.copy()
    if bitmask is None:
        return out
    source = {req_id: n * (k + 1) for n, req_id in enumerate(structured_ids)}
    for position, req_id in enumerate(batch_ids):
        if req_id in source:
            rows = slice(position * (k + 1), (position + 1) * (k + 1))
            start = source[req_id]
            out[rows] = masked_logits(logits[rows], bitmask[start : start + k + 1])
    return out


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
