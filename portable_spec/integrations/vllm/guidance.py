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
_eos: dict[int, tuple[Any, int]] = {}  # id(LLTokenizer) -> (the tokenizer, its end token)


def _end_token(tokenizer: Any) -> int:
    entry = _eos.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        if len(_eos) > 64:
            _eos.clear()
        entry = _eos[id(tokenizer)] = (tokenizer, int(tokenizer.eos_token))
    return entry[1]


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
    is not one this path takes: another backend, a draft that is neither a token id nor ``-1``
    padding, a chain longer than the strided layout allows, a matcher in its error state or
    held by a build of the library, a mask width llguidance refuses. ``stride``: rows per
    request block, ``0`` for packed rows. Returns the rows written and the strided rows vLLM
    never reads. Blocks until the rows are written; every matcher ends where it started.
    """
    if not ids or internals.may_reason(manager):
        return None
    # the steady state: every wrapper class and tokenizer seen, read and written in one call
    done = compiled.vllm_guidance(requests, ids, spec, _wrapper_types, _eos, buffer, stride, _NAMES)
    if done is not None:
        return Rows(*done)
    limit = buffer.shape[1] * 32
    wrappers = _wrapper_types
    grammars: list[Any] = []
    drafts: list[list[int]] = []
    total = 0
    for req_id in ids:
        grammar = internals.wrapped_grammar(requests[req_id], wrappers, _WRAPPER)
        if grammar is None:
            return None
        tokens = spec.get(req_id) or []
        if tokens and (min(tokens) < -1 or max(tokens) >= limit):
            return None
        grammars.append(grammar)
        drafts.append(tokens)
        total += stride or len(tokens) + 1
    if total > buffer.shape[0] or (stride and max(map(len, drafts)) >= stride):
        return None
    out = buffer[:total]
    parts = [internals.guidance_parts(g) for g in grammars]
    matchers = [matcher for matcher, _, _ in parts]
    try:
        token, held_now = hold_matchers(matchers)
    except ValueError:
        return None
    try:
        unwritten = unwritten_rows(drafts, stride)
        if stride:
            out[unwritten] = -1
        written = _write(parts, drafts, out, stride)
    finally:
        release_matchers(token, held_now)
    return Rows(out, unwritten) if written else None


def _write(
    parts: list[tuple[Any, Any, bool]], drafts: list[list[int]], out: np.ndarray, stride: int
) -> bool:
    """Each request's rows (``parts``: its matcher, tokenizer and terminated flag); False when
    a matcher is in its error state (its step declined)."""
    row_bytes = out.strides[0]
    nbytes = out.shape[1] * 4
    base = out.ctypes.data
    row = 0
    for (matcher, tokenizer, terminated), tokens in zip(parts, drafts, strict=True):
        m = len(tokens)
        nxt = row + stride if stride else row + m + 1
        if terminated:
            out[row : row + m + 1] = -1
            row = nxt
            continue
        p = tokens.index(-1) if m and min(tokens) < 0 else m
        chain = tokens[:p] if p < m else tokens
        c, stopped = 0, False
        if p == 0:
            matcher.unsafe_compute_mask_ptr(base + row * row_bytes, nbytes)
        else:
            last = out[row + p]
            last[:] = 0
            matcher.unsafe_compute_mask_ptr_with_draft_token(base + row * row_bytes, nbytes, chain)
            if last.any():
                c = p
            else:  # the chain ended early: ask the matcher where (it ends where it started)
                if matcher.is_error():
                    return False
                c = matcher.try_consume_tokens(chain)
                stopped = c < p and matcher.is_stopped()
                if c:
                    matcher.rollback(c)
        guidance_tail(out, row, chain, m, c, stopped, _end_token(tokenizer))
        row = nxt
    return True
