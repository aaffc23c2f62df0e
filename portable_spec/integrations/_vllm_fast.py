"""The vLLM plugin's common step in one function: every request an xgrammar grammar, no
reasoning parser, no ``-1`` padding.

vLLM's rows for such a step are each request's chain (its root row, then one row per draft),
back to back (0.32) or at a stride of ``K + 1`` rows (0.33, the rows past a request's chain
all-allowed). A draft the grammar refuses repeats the row before it on every later row of the
request, as vLLM's own loop does; a request whose grammar vLLM's wrapper reports terminated
gets all-allowed rows.

When the compiled helper can call xgrammar's matcher methods itself
(:func:`portable_spec.native.xgrammar_handle`) and the requests share their stop tokens, the
whole step is one compiled call with the GIL released: each chain asked ``is_terminated``,
walked by ``traverse_draft_tree`` straight into vLLM's buffer and repaired. Otherwise each
request is walked through xgrammar's Python binding and the batch repaired in one call. Inside
the engine each call starts with cold caches (the forward pass evicts them), so the cost of a
call follows the Python it runs: no tree object, no plan, no classification.

Anything unusual (another backend, a matcher never probed by the library or of another
width, a matcher listed twice, padding, a reasoning parser, a chain longer than the layout
allows, a build of the library pending) returns ``None`` before any matcher moves: the
plugin's checked path then takes the step. A matcher xgrammar refuses raises
:class:`portable_spec.MatcherError` naming the request (the plugin's checked path then takes
the step and reports it).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.builder.small import chain_links
from portable_spec.engines.xgrammar import xgrammar_info
from portable_spec.errors import MatcherError
from portable_spec.pending import pending_builds

__all__ = ["fast_rows", "forget_grammars", "may_reason"]


_NO_STOPS = np.zeros(0, dtype=np.int64)
_NO_DRAFTS: list[int] = []  # never modified
_WRAPPER = "XgrammarGrammar"  # vLLM's xgrammar grammar class
_wrapper_types: set[type] = set()  # classes of that name seen (one type test per request)

# Per vLLM grammar wrapper (by id, dropped when the wrapper dies): its matcher, the matcher's
# handle for the compiled helper (0: none), bitmask width and stop tokens (the probe's array,
# one per distinct stop set, so that "same stops" is an identity test). Read once per request
# instead of the library's per-matcher caches: inside the engine every object a call touches
# is a cache miss.
_known: dict[int, tuple[Any, int, int, np.ndarray, Any]] = {}


def _learn(grammar: Any, matcher: Any) -> tuple[Any, int, int, np.ndarray, Any] | None:
    """The entry of ``_known`` for ``grammar`` (made now), or None when the library never
    probed its matcher (nothing is called on the matcher)."""
    info = xgrammar_info(matcher)
    if info is None:
        return None
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


def may_reason(manager: Any) -> bool:
    """Whether vLLM's ``_get_constraint_bounds`` can return anything but ``(0, 0)``: it does
    only with a reasoning parser and ``enable_in_reasoning`` off (0.32 and 0.33 alike)."""
    if getattr(manager, "enable_in_reasoning", False) is True:
        return False
    return getattr(manager, "reasoner_cls", True) is not None


def fast_rows(
    manager: Any,
    requests: dict[str, Any],
    ids: Sequence[str],
    spec: dict[str, list[int]],
    stride_k: int | None,
    buffer: np.ndarray,
) -> np.ndarray | None:
    """vLLM's rows of a common step written into ``buffer`` (int32 ``[rows, words]``, vLLM's
    bitmask as numpy); returns the int32 ``[rows used, words]`` view written, or ``None``
    (nothing written, no matcher moved) when the step is not a common one. ``stride_k``: the
    number of speculative tokens for vLLM 0.33's strided rows, ``None`` for 0.32's packed ones.
    Blocks until the rows are written (the GIL released while xgrammar walks); every matcher
    ends where it started. Sets the manager's ``_portable_spec_unwritten`` (the strided rows
    vLLM never reads). Raises :class:`portable_spec.MatcherError` (``request_index``: the
    request's position in ``ids``) when xgrammar refuses a walk; rows may then be written."""
    native = compiled.native
    if native is None or not hasattr(native, "repair_chains") or pending_builds():
        return None
    if may_reason(manager):
        return None
    words = buffer.shape[1]
    known = _known
    wrappers = _wrapper_types
    drafts: list[list[int]] = []  # per request: its drafts (the root is implied)
    handles: list[int] = []  # per request: its matcher's handle, 0 when terminated
    matchers: list[Any] = []  # per request: the matcher to walk, None when terminated
    stops: list[np.ndarray] = []  # per live request: its stop tokens
    direct = native is compiled.bound_helper()  # so far every live matcher has a handle
    common = None  # the live requests' stop tokens while they agree
    same_stops = True
    stride = 0 if stride_k is None else stride_k + 1
    longest = row = 0
    for req_id in ids:
        grammar = requests[req_id].structured_output_request.grammar
        kind = type(grammar)
        if kind not in wrappers:
            if kind.__name__ != _WRAPPER:
                return None
            wrappers.add(kind)
        tokens = spec.get(req_id) or _NO_DRAFTS
        if tokens and min(tokens) < 0:
            return None  # padding: the checked path splits the request
        if grammar.is_terminated():
            matcher, handle = None, 0  # all-allowed rows, the matcher not called
        else:
            matcher = grammar.matcher
            entry = known.get(id(grammar))
            if entry is None or entry[0] is not matcher:
                entry = _learn(grammar, matcher)
                if entry is None:
                    return None  # first sight of this matcher: the checked path probes it
            _, handle, width, stop, _ = entry
            if width != words:
                return None
            if stop is not common:
                same_stops = common is None
                common = stop
            direct = direct and handle != 0
            stops.append(stop)
        matchers.append(matcher)
        handles.append(handle)
        drafts.append(tokens)
        nodes = len(tokens) + 1
        longest = max(longest, nodes)
        row += stride or nodes
    if len(stops) > 1 and len({id(m) for m in matchers if m is not None}) != len(stops):
        return None  # a matcher listed twice
    if stride and longest > stride:
        return None  # a chain longer than the layout's K + 1 rows
    total = row
    if total > buffer.shape[0]:
        return None
    out = buffer[:total]
    unwritten: list[int] = []
    if stride:
        for c, tokens in enumerate(drafts):
            first, length = c * stride, len(tokens) + 1
            if length < stride:
                unwritten.extend(range(first + length, first + stride))
    limit = words * 32
    if direct and stops and same_stops:
        # read, walked and repaired in one compiled call (padding rows of the strided
        # layout written all-allowed by it); terminated requests' rows all-allowed
        done = native.pack_chains(
            drafts, handles, stride, limit, _NO_STOPS, None, out, None, limit, common, None, 1
        )
        if done is None:
            return None  # a draft that is not a plain int: the checked path reads it
        _, _, failed, message = done
        if failed >= 0:
            raise MatcherError(failed, RuntimeError(message))
    else:
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
        _walk_each(native, matchers, stops, out, draft, table, limit, same_stops)
    manager._portable_spec_unwritten = unwritten
    return out


def _walk_each(
    native: Any,
    matchers: list[Any],
    stops: list[np.ndarray],
    out: np.ndarray,
    draft: np.ndarray,
    table: np.ndarray,
    limit: int,
    same_stops: bool,
) -> None:
    """Each live request walked through xgrammar's Python binding into its rows of ``out``,
    then the batch repaired in one compiled call (one call per request when the stop tokens
    differ). ``table`` is fast_rows' spans; its fourth column becomes the live flag."""
    table[:, 3] = 0
    for c, matcher in enumerate(matchers):
        if matcher is None or matcher.is_terminated():
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
    if same_stops:
        native.repair_chains(out, draft, table, limit, stops[0] if stops else _NO_STOPS, 1)
        return
    live = iter(stops)
    for c, matcher in enumerate(matchers):
        stop = _NO_STOPS if matcher is None else next(live)
        native.repair_chains(out, draft, table[c : c + 1], limit, stop, 1)
