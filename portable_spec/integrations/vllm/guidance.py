"""The vLLM plugin's common step with the guidance backend (llguidance matchers): every request
a ``GuidanceGrammar``, no reasoning parser.

vLLM's own fill walks each request token by token through its wrapper (fill the row, consume
the draft, ... then roll back): about six llguidance calls and a dozen Python frames per row.
Here each request's chain is one llguidance call, ``LLMatcher.unsafe_compute_mask_ptr_with_
draft_token``, which writes the root row and one row per draft the matcher consumes (in Rust,
the GIL released) and leaves the matcher where it started; the rows vLLM derives from the
chain's end are then written from the draft list alone.

vLLM's rule, per request with drafts ``d`` (``p``: the first ``-1`` padding, or their count):
the matcher consumes ``d[0] ... d[p-1]`` while it takes them (llguidance's parser decides,
not the parent row's mask: a draft outside the mask that the parser accepts is consumed, as
vLLM does); row ``i`` holds the mask after ``i`` drafts. After a draft it refuses, or any draft
once the grammar is complete, every later row repeats the last row filled; after the end token
(consumed, or offered once the grammar is complete) every later row is all-allowed, as after
the padding. A request whose wrapper is terminated gets all-allowed rows.

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
from portable_spec.integrations._vllm_fast import may_reason, wrapped_grammar
from portable_spec.pending import hold_matchers, release_matchers

__all__ = ["guidance_rows"]

_WRAPPER = "GuidanceGrammar"  # vLLM's llguidance grammar class
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
    stride_k: int | None,
    buffer: np.ndarray,
) -> tuple[np.ndarray, list[int]] | None:
    """vLLM's rows of a guidance step written into ``buffer`` (int32 ``[rows, words]``, vLLM's
    bitmask as numpy): returns the int32 ``[rows used, words]`` view written and the strided
    rows vLLM never reads, or ``None`` (nothing moved; rows may have been written) when the
    step is not one this path takes: another backend, a draft that is neither a token id nor
    ``-1`` padding, a chain longer than the strided layout allows, a matcher in its error
    state or held by a build of the library, a mask width llguidance refuses. ``stride_k``: the
    number of speculative tokens for vLLM 0.33's strided rows, ``None`` for 0.32's packed ones.
    Blocks until the rows are written; every matcher ends where it started.
    """
    if not ids or may_reason(manager):
        return None
    stride = 0 if stride_k is None else stride_k + 1
    # the steady state: every wrapper class and tokenizer seen, read and written in one call
    done = compiled.vllm_guidance(requests, ids, spec, _wrapper_types, _eos, buffer, stride)
    if done is not None:
        return done
    limit = buffer.shape[1] * 32
    wrappers = _wrapper_types
    grammars: list[Any] = []
    drafts: list[list[int]] = []
    total = 0
    for req_id in ids:
        grammar = wrapped_grammar(requests[req_id].structured_output_request, wrappers, _WRAPPER)
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
    matchers = [g.ll_matcher for g in grammars]
    try:
        token, held_now = hold_matchers(matchers)
    except ValueError:
        return None
    try:
        unwritten = _write(grammars, matchers, drafts, out, stride)
    finally:
        release_matchers(token, held_now)
    if unwritten is None:
        return None
    return out, unwritten


def _write(
    grammars: list[Any], matchers: list[Any], drafts: list[list[int]], out: np.ndarray, stride: int
) -> list[int] | None:
    row_bytes = out.strides[0]
    nbytes = out.shape[1] * 4
    base = out.ctypes.data
    unwritten: list[int] = []
    row = 0
    for grammar, matcher, tokens in zip(grammars, matchers, drafts, strict=True):
        m = len(tokens)
        end = row + m  # the request's last row
        if stride:
            if m + 1 < stride:
                unwritten.extend(range(end + 1, row + stride))
                out[end + 1 : row + stride] = -1
            nxt = row + stride
        else:
            nxt = end + 1
        if grammar.terminated:
            out[row : end + 1] = -1
            row = nxt
            continue
        p = tokens.index(-1) if m and min(tokens) < 0 else m
        if p == 0:
            matcher.unsafe_compute_mask_ptr(base + row * row_bytes, nbytes)
            if m:
                out[row + 1 : end + 1] = -1
            row = nxt
            continue
        chain = tokens[:p] if p < m else tokens
        last = out[row + p]
        last[:] = 0
        matcher.unsafe_compute_mask_ptr_with_draft_token(base + row * row_bytes, nbytes, chain)
        eos = _end_token(grammar.ll_tokenizer)
        stopped = False
        if last.any():
            c = p
        else:  # the chain ended early: ask the matcher where (it ends where it started)
            if matcher.is_error():
                return None
            c = matcher.try_consume_tokens(chain)
            stopped = c < p and matcher.is_stopped()
            if c:
                matcher.rollback(c)
        if eos in chain[:c]:  # consumed: the grammar ended; every later row all-allowed
            out[row + chain.index(eos) + 1 : end + 1] = -1
        elif stopped:
            # complete grammar: vLLM's wrapper takes every draft without consuming it, each
            # row the end-token row, until the end token (then all-allowed, as after padding)
            e = chain.index(eos, c) if eos in chain[c:] else p
            out[row + c + 1 : row + e + 1] = out[row + c]
            out[row + e + 1 : end + 1] = -1
        elif c < p:  # refused: vLLM repeats the last row filled
            out[row + c + 1 : end + 1] = out[row + c]
        elif p < m:
            out[row + p + 1 : end + 1] = -1
        row = nxt
    return unwritten
