"""The vLLM plugin's common step in one function: every request an xgrammar grammar, no
reasoning parser, no ``-1`` padding.

vLLM's rows for such a step are each request's chain (its root row, then one row per draft),
back to back (0.32) or at a stride of ``K + 1`` rows (0.33, the rows past a request's chain
all-allowed). Each request is walked with xgrammar's C++ traversal straight into vLLM's buffer
and repaired with the compiled helper; a draft the grammar refuses repeats the row before it
on every later row of the request, as vLLM's own loop does. The links of a chain of ``L``
nodes never change and are made once per length. No tree object, no plan, no classification:
inside the engine each call starts with cold caches (the forward pass evicts them), so the
cost of a call follows the Python it runs.

Anything unusual (another backend, a matcher never probed by the library or of another
width, a matcher listed twice, padding, a reasoning parser, a chain longer than the layout
allows, a build of the library pending) returns ``None`` before any matcher moves: the
plugin's checked path then takes the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.builder.small import chain_links
from portable_spec.engines.xgrammar import xgrammar_info
from portable_spec.pending import pending_builds

__all__ = ["fast_rows", "may_reason"]


_NO_STOPS = np.zeros(0, dtype=np.int64)


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
    Blocks until the rows are written; every matcher ends where it started. Sets the manager's
    ``_portable_spec_unwritten`` (the strided rows vLLM never reads)."""
    native = compiled.native
    if native is None or not hasattr(native, "repair_chains") or pending_builds():
        return None
    if may_reason(manager):
        return None
    words = buffer.shape[1]
    grammars, infos, flat, lengths = [], [], [], []
    for req_id in ids:
        grammar = requests[req_id].structured_output_request.grammar
        if type(grammar).__name__ != "XgrammarGrammar":
            return None
        if grammar.is_terminated():
            info = None  # all-allowed rows, the matcher not called
        else:
            info = xgrammar_info(grammar.matcher)
            if info is None or info.words != words:
                return None  # first sight of this matcher: the checked path probes it
        tokens = spec.get(req_id) or ()
        if tokens and min(tokens) < 0:
            return None  # padding: the checked path splits the request
        grammars.append(grammar)
        infos.append(info)
        flat.append(0)
        flat.extend(tokens)
        lengths.append(len(tokens) + 1)
    n = len(grammars)
    if n > 1 and len({id(g.matcher) for g in grammars}) != n:
        return None
    if stride_k is None:
        total = len(flat)
    else:
        if max(lengths) > stride_k + 1:
            return None
        total = n * (stride_k + 1)
    if total > buffer.shape[0]:
        return None
    draft = np.array(flat, dtype=np.int64)
    out = buffer[:total]
    limit = words * 32
    unwritten: list[int] = []
    spans = []  # per request: first row, first token, nodes, matcher live
    pos = row = 0
    for grammar, info, nodes in zip(grammars, infos, lengths, strict=True):
        live = 0
        if info is not None and not grammar.matcher.is_terminated():
            next_token, next_sibling = chain_links(nodes)
            grammar.matcher.traverse_draft_tree(
                next_token, next_sibling, draft[pos : pos + nodes], out[row : row + nodes]
            )
            live = 1
        spans.append((row, pos, nodes, live))
        pos += nodes
        row += nodes
        if stride_k is not None and nodes <= stride_k:
            end = row + stride_k + 1 - nodes
            out[row:end] = -1
            unwritten.extend(range(row, end))
            row = end
    # one repair for the batch (live chains only) when the stop tokens agree (one tokenizer)
    table = np.array(spans, dtype=np.int64)
    walked = [i for i in infos if i is not None]
    if walked and all(i.stop_set == walked[0].stop_set for i in walked):
        native.repair_chains(out, draft, table, limit, walked[0].stop_ids, 1)
    else:
        for c, info in enumerate(infos):
            stops = _NO_STOPS if info is None else info.stop_ids
            native.repair_chains(out, draft, table[c : c + 1], limit, stops, 1)
    manager._portable_spec_unwritten = unwritten
    return out
