"""The vLLM plugin's common step with the xgrammar backend in one function: every request an
xgrammar grammar, no reasoning parser, no ``-1`` padding.

vLLM's rows for such a step are each request's chain (its root row, then one row per draft),
laid out by the row rules (:mod:`portable_spec.integrations.vllm.rows`: a draft the grammar
refuses repeats the row before it on every later row of the request, as vLLM's own loop does;
a request whose grammar is terminated gets all-allowed rows). Whether a grammar is terminated
is asked of the matcher: vLLM's wrapper keeps its flag equal to the matcher's after every
accept and rollback, and asking the wrapper would cost a Python call per request.

In the steady state (every request's grammar seen before, each matcher's handle usable by the
compiled helper, see :func:`portable_spec.native.xgrammar_handle`, one set of stop tokens) the
whole step is one compiled call: it reads vLLM's own objects (the request dict, each request's
grammar and its matcher, through the attribute names
:data:`~portable_spec.integrations.vllm.internals.XGRAMMAR_NAMES` it is handed, the draft
lists), then with the GIL released asks each matcher ``is_terminated``, walks its chain by
``traverse_draft_tree`` straight into vLLM's buffer and repairs it. Inside the engine each
call starts with cold caches (the forward pass evicts them), and every Python line costs about
a microsecond there.

Otherwise the same step runs in Python: a grammar seen for the first time is learnt (its
matcher probed, which does not move it), matchers without a handle are walked through
xgrammar's Python binding and the batch repaired in one call. Anything unusual (another
backend, a matcher of another width, a matcher listed twice, padding, a reasoning parser, a
chain longer than the layout allows, a build of the library pending) returns ``None`` before
any matcher moves: the plugin's checked path then takes the step. A matcher xgrammar refuses
raises :class:`portable_spec.MatcherError` naming the request (the plugin's checked path then
takes the step and reports it).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.builder.small import chain_links
from portable_spec.engines.xgrammar import probe_xgrammar
from portable_spec.errors import MatcherError
from portable_spec.integrations.vllm import internals
from portable_spec.integrations.vllm.rows import Rows, unwritten_rows
from portable_spec.pending import hold_matchers, release_matchers

__all__ = ["fast_rows", "forget_grammars"]


_NO_STOPS = np.zeros(0, dtype=np.int64)
_NO_DRAFTS: list[int] = []  # never modified
_NAMES = internals.XGRAMMAR_NAMES  # what the compiled reader reads of vLLM's objects
_WRAPPER = internals.XGRAMMAR_WRAPPER
_wrapper_types: set[type] = set()  # classes of that name seen (one type test per request)

# Per vLLM grammar wrapper (by id, dropped when the wrapper dies): its matcher, the matcher's
# handle for the compiled helper (0: none), bitmask width and stop tokens (the probe's array,
# one per distinct stop set, so that "same stops" is an identity test). Read once per request
# instead of the library's per-matcher caches: inside the engine every object a call touches
# is a cache miss. The compiled step (`vllm_chains`) reads these entries as they are.
_known: dict[int, tuple[Any, int, int, np.ndarray, Any]] = {}


def _learn(grammar: Any, matcher: Any, words: int) -> tuple[Any, int, int, np.ndarray, Any]:
    """The entry of ``_known`` for ``grammar`` (made now; the matcher probed at the width of
    ``words`` int32 words when the library has not seen it yet, which does not move it).
    Raises what :func:`portable_spec.engines.xgrammar.probe_xgrammar` raises."""
    info = probe_xgrammar(matcher, words)
    key = id(grammar)
    try:
        # the callback runs while the wrapper is freed, before its id can be reused
        ref = weakref.ref(grammar, lambda _, key=key: _known.pop(key, None))
    except TypeError:  # no weak references: looked up again on every call
        ref = None
    entry = (matcher, compiled.xgrammar_handle(matcher), info.words, info.stop_ids, ref)
    if ref is not None:
        _known[key] = entry
    return entry


def forget_grammars() -> None:
    """Drop what :func:`fast_rows` remembers about vLLM's grammar wrappers (the next call
    reads each matcher's facts and handle again)."""
    _known.clear()


def fast_rows(
    manager: Any,
    requests: dict[str, Any],
    ids: Sequence[str],
    spec: dict[str, list[int]],
    stride: int,
    buffer: np.ndarray,
) -> Rows | None:
    """vLLM's rows of a common step written into ``buffer`` (int32 ``[rows, words]``, vLLM's
    bitmask as numpy), or ``None`` (nothing written, no matcher moved) when the step is not a
    common one. ``stride``: rows per request block, ``0`` for packed rows (see
    :func:`~portable_spec.integrations.vllm.rows.stride_of`). Returns the rows written and
    the strided rows vLLM never reads. Blocks until the rows are written (the GIL released
    while xgrammar walks); every matcher ends where it started. Raises
    :class:`portable_spec.MatcherError` (``request_index``: the request's position in
    ``ids``) when xgrammar refuses a walk; rows may then be written."""
    if not ids or compiled.native is None or internals.may_reason(manager):
        return None
    direct = compiled.walks_xgrammar()  # the helper made the handles and calls xgrammar
    if direct:
        # the steady state: every request's facts known, read and walked in one compiled call
        step = compiled.vllm_chains(
            requests, ids, spec, _known, _wrapper_types, buffer, stride, _NO_STOPS, _NAMES
        )
        if step is not None:
            out, (_, _, failed, message), drafts = step
            if failed >= 0:
                raise MatcherError(failed, RuntimeError(message))
            return Rows(out, unwritten_rows(drafts, stride))
    words = buffer.shape[1]
    known = _known
    wrappers = _wrapper_types
    drafts: list[list[int]] = []  # per request: its drafts (the root is implied)
    handles: list[int] = []  # per request: its matcher's handle for the compiled helper
    matchers: list[Any] = []  # per request: its matcher
    stops: list[np.ndarray] = []  # per request: its stop tokens
    common = None  # the requests' stop tokens while they agree
    same_stops = True
    tokens_total = 0
    for req_id in ids:
        grammar = internals.wrapped_grammar(requests[req_id], wrappers, _WRAPPER)
        if grammar is None:
            return None
        # Terminated requests are walked too: the compiled walk asks the matcher (whose
        # state vLLM's wrapper mirrors) and writes their rows all-allowed.
        matcher = internals.xgrammar_matcher(grammar)
        entry = known.get(id(grammar))
        if entry is None or entry[0] is not matcher:
            entry = _learn(grammar, matcher, words)
        _, handle, width, stop, _ = entry
        if width != words:
            return None
        if stop is not common:
            same_stops = common is None
            common = stop
        stops.append(stop)
        matchers.append(matcher)
        handles.append(handle)
        tokens = spec.get(req_id) or _NO_DRAFTS
        drafts.append(tokens)
        tokens_total += len(tokens)
    n = len(drafts)
    direct = direct and 0 not in handles
    if n > 1 and len(set(handles) if direct else {id(m) for m in matchers}) != n:
        return None  # a matcher listed twice
    total = n * stride if stride else tokens_total + n
    if total > buffer.shape[0]:
        return None
    out = buffer[:total]
    limit = words * 32
    if direct and same_stops:
        # read, walked and repaired in one compiled call, which declines padding (negative
        # drafts) and chains longer than the stride before any matcher moves; the strided
        # layout's rows past a chain are written all-allowed
        done = compiled.pack_chains(
            drafts, matchers, stride, limit, _NO_STOPS, None, out, None, limit, common, None, 1, 1
        )
        if done is None:
            return None  # padding, a chain too long, a draft not a plain int, a matcher held
        _, _, failed, message = done
        if failed >= 0:
            raise MatcherError(failed, RuntimeError(message))
        unwritten = unwritten_rows(drafts, stride)
    else:
        for tokens in drafts:
            if tokens and (min(tokens) < 0 or (stride and len(tokens) >= stride)):
                return None  # padding (the checked path splits the request), or too long
        unwritten = unwritten_rows(drafts, stride)
        flat: list[int] = []  # chains back to back, root (0) first
        spans: list[int] = []  # per request: first row, first token, nodes, live (later)
        pos = 0
        for c, tokens in enumerate(drafts):
            nodes = len(tokens) + 1
            spans += (c * stride if stride else pos, pos, nodes, 0)
            flat.append(0)
            flat += tokens
            pos += nodes
        if stride:
            out[unwritten] = -1
        draft = np.array(flat, dtype=np.int64)
        table = np.array(spans, dtype=np.int64).reshape(len(drafts), 4)
        try:
            token, held = hold_matchers(matchers)
        except ValueError:  # another build walks one of them: the checked path says which
            return None
        try:
            _walk_each(matchers, stops, out, draft, table, limit, common if same_stops else None)
        finally:
            release_matchers(token, held)
    return Rows(out, unwritten)


def _walk_each(
    matchers: list[Any],
    stops: list[np.ndarray],
    out: np.ndarray,
    draft: np.ndarray,
    table: np.ndarray,
    limit: int,
    common: np.ndarray | None,
) -> None:
    """Each live request walked through xgrammar's Python binding into its rows of ``out``,
    then the batch repaired in one compiled call with ``common`` stop tokens (one call per
    request with its own when ``common`` is None). ``table`` is fast_rows' spans; its fourth
    column becomes the live flag."""
    table[:, 3] = 0
    for c, matcher in enumerate(matchers):
        if matcher.is_terminated():
            continue
        row, pos, nodes, _ = table[c].tolist()
        next_token, next_sibling = chain_links(nodes)
        try:
            matcher.traverse_draft_tree(
                next_token, next_sibling, draft[pos : pos + nodes], out[row : row + nodes]
            )
        except Exception as exc:
            raise MatcherError(c, exc) from exc
        table[c, 3] = 1
    if common is not None:
        compiled.repair_chains(out, draft, table, limit, common, 1)
        return
    for c, stop in enumerate(stops):
        compiled.repair_chains(out, draft, table[c : c + 1], limit, stop, 1)
