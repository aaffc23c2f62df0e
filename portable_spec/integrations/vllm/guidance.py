"""The vLLM plugin's common step with the guidance backend (llguidance matchers): every request
vLLM's guidance wrapper, no reasoning parser.

vLLM's own fill walks each request token by token through its wrapper (fill the row, consume
the draft, ... then roll back): about six llguidance calls and a dozen Python frames per row.
Here each request's chain is one llguidance call, ``LLMatcher.unsafe_compute_mask_ptr_with_
draft_token``, which writes the root row and one row per draft the matcher consumes (in Rust,
the GIL released) and leaves the matcher where it started; the rows vLLM derives from the
chain's end are then written from the draft list alone.

vLLM's rule for guidance (rules 2, 4 and 6 of :mod:`portable_spec.integrations.vllm.rows`),
per request with drafts ``d`` (``p``: the first ``-1`` padding, or their count): the matcher
consumes ``d[0] ... d[p-1]`` while it takes them (llguidance's parser decides, not the parent
row's mask: a draft outside the mask that the parser accepts is consumed, as vLLM does); row
``i`` holds the mask after ``i`` drafts; :func:`~portable_spec.integrations.vllm.rows.
guidance_tail` writes the rows after the chain's end. A request whose wrapper is terminated
gets all-allowed rows.

Whether llguidance consumed every draft is read off the chain's last row, cleared before the
call: llguidance writes it only then, and a written row is (almost) never all-zero. A row left
all-zero (a refused draft, a complete grammar, the end token, or that rare row) makes the
matcher say how far it goes: ``try_consume_tokens``, rolled back.

A draft at or past the tokenizer's vocabulary (a padding id of logits wider than the
tokenizer) is never handed to llguidance, which takes one for an error it never leaves: the
chain stops before it, and it is refused as a draft the parser does not take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.integrations.vllm import internals
from portable_spec.integrations.vllm.rows import Rows, guidance_tail, unwritten_rows
from portable_spec.pending import hold_matchers, release_matchers

__all__ = ["guidance_rows"]

_WRAPPER = internals.GUIDANCE_WRAPPER
_NAMES = internals.GUIDANCE_NAMES  # what the compiled reader reads of vLLM's objects
_wrapper_types: set[type] = set()
# id(LLTokenizer) -> (the tokenizer, its end token, its vocabulary size)
_eos: dict[int, tuple[Any, int, int]] = {}


def _tokenizer_facts(tokenizer: Any) -> tuple[Any, int, int]:
    entry = _eos.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        if len(_eos) > 64:
            _eos.clear()
        entry = (tokenizer, int(tokenizer.eos_token), int(tokenizer.vocab_size))
        _eos[id(tokenizer)] = entry
    return entry


def guidance_rows(
    manager: Any,
    requests: dict[str, Any],
    ids: Sequence[str],
    spec: dict[str, list[int]],
    stride: int,
    buffer: np.ndarray,
) -> Rows | None:
    """vLLM's rows of a guidance step written into ``buffer`` (int32 ``[rows, words]``, vLLM's
    bitmask as numpy), or ``None`` (nothing moved; rows may have been written) when the step
    is not one this path takes: another backend, objects not shaped as vLLM's, a draft that is
    neither a token id inside the mask nor ``-1`` padding, a chain longer than the strided
    layout allows, a mask whose width is not the tokenizer's, a matcher in its error state or
    held by a build of the library. A draft at or past the tokenizer's vocabulary (inside the
    mask) is a refused draft, never handed to llguidance. ``stride``: rows per request block,
    ``0`` for packed rows. Returns the rows written and the strided rows vLLM never reads.
    Blocks until the rows are written; every matcher ends where it started. Raises only what
    llguidance itself raises once asked for a row.
    """
    if not ids or internals.may_reason(manager):
        return None
    # the steady state: every wrapper class and tokenizer seen, read and written in one call
    done = compiled.vllm_guidance(requests, ids, spec, _wrapper_types, _eos, buffer, stride, _NAMES)
    if done is not None:
        return Rows(*done)
    try:  # vLLM's objects read; nothing moves
        step = _read(requests, ids, spec, buffer.shape[1])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None  # not shaped as vLLM's: the checked path says what is wrong
    if step is None:
        return None
    drafts = [tokens for _, tokens, _ in step]
    total = sum(stride or len(tokens) + 1 for tokens in drafts)
    if total > buffer.shape[0] or (stride and max(map(len, drafts)) >= stride):
        return None
    out = buffer[:total]
    try:
        token, held_now = hold_matchers([matcher for matcher, _, _ in step if matcher is not None])
    except ValueError:
        return None
    try:
        unwritten = unwritten_rows(drafts, stride)
        if stride:
            out[unwritten] = -1
        written = _write(step, out, stride)
    finally:
        release_matchers(token, held_now)
    return Rows(out, unwritten) if written else None


#: per request: its matcher (None: vLLM's wrapper says terminated), its drafts, and its
#: tokenizer's (end token, vocabulary size)
_Request = tuple[Any, list[int], tuple[int, int]]


def _read(
    requests: dict[str, Any], ids: Sequence[str], spec: dict[str, list[int]], words: int
) -> list[_Request] | None:
    """Each request of the step as :func:`_write` takes it, or None when one is not a
    guidance request, a draft is neither an int inside the mask nor ``-1``, or the mask is not
    as wide as the tokenizer's. Raises what reading an object shaped unlike vLLM's raises."""
    limit = 32 * words
    step: list[_Request] = []
    for req_id in ids:
        grammar = internals.wrapped_grammar(requests[req_id], _wrapper_types, _WRAPPER)
        if grammar is None:
            return None
        tokens = spec.get(req_id) or []
        if type(tokens) not in (list, tuple) or not all(
            type(t) is int and -1 <= t < limit for t in tokens
        ):
            return None
        matcher, tokenizer, terminated = internals.guidance_parts(grammar)
        _, eos, vocab = _tokenizer_facts(tokenizer)
        if (vocab + 31) // 32 != words:
            return None
        step.append((None if terminated else matcher, list(tokens), (eos, vocab)))
    return step


def _write(step: list[_Request], out: np.ndarray, stride: int) -> bool:
    """Each request's rows; False when a matcher is in its error state (its step declined)."""
    row_bytes = out.strides[0]
    nbytes = out.shape[1] * 4
    base = out.ctypes.data
    row = 0
    for matcher, tokens, (eos, vocab) in step:
        m = len(tokens)
        nxt = row + stride if stride else row + m + 1
        if matcher is None:  # vLLM's wrapper says terminated: every row all-allowed
            out[row : row + m + 1] = -1
            row = nxt
            continue
        p = tokens.index(-1) if m and min(tokens) < 0 else m
        # llguidance is handed the drafts before the first one past its vocabulary
        q = next((i for i in range(p) if tokens[i] >= vocab), p)
        if q == 0:
            if matcher.is_error():
                return False
            matcher.unsafe_compute_mask_ptr(base + row * row_bytes, nbytes)
            c, stopped = 0, p > 0 and matcher.is_stopped()
        else:
            chain = tokens[:q]
            last = out[row + q]
            last[:] = 0
            matcher.unsafe_compute_mask_ptr_with_draft_token(base + row * row_bytes, nbytes, chain)
            if q == p and last.any():
                c, stopped = p, False
            else:  # the chain ended early: ask the matcher where (it ends where it started)
                if matcher.is_error():
                    return False
                c = matcher.try_consume_tokens(chain)
                stopped = c < p and matcher.is_stopped()
                if c:
                    matcher.rollback(c)
        guidance_tail(out, row, tokens[:p], m, c, stopped, eos)
        row = nxt
    return True
