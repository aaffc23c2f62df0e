"""The vLLM plugin's checked path: any step the short paths do not take (reasoning parsers,
draft padding, outlines grammars, a grammar's first step on a path that needs its facts...),
built by the library's general build with every check.

Each request's rows become chain segments (:class:`~portable_spec.integrations.vllm.rows.Plan`,
by the row rules), ``ps.GrammarTree.from_packed_chains`` writes them into vLLM's buffer, then
the rules the build does not know (forced rows, reasoning bans, the row repeated after a
refused draft) are applied. A build the library refuses raises before any matcher moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec.integrations.vllm import internals
from portable_spec.integrations.vllm.rows import Plan, Rows, finish_rows, first_padding

__all__ = ["checked_rows", "plan_step"]


def plan_step(
    manager: Any,
    requests: dict[str, Any],
    ids: Sequence[str],
    spec: dict[str, list[int]],
    stride_k: int | None,
) -> Plan:
    """vLLM's rows of a step as chain segments. ``stride_k``: K for the strided layout, None
    for packed rows. Raises LookupError (the wrapper's class name) for a grammar whose matcher
    the library does not take. Moves no matcher; asks vLLM's bounds per request only with a
    reasoning parser (without one they are ``(0, 0)``)."""
    plan = Plan(stride_k)
    reasoning = internals.may_reason(manager)
    for req_id in ids:
        request = requests[req_id]
        grammar = internals.request_grammar(request)
        matcher = internals.inner_matcher(grammar)
        tokens = spec.get(req_id) or []
        p = first_padding(tokens)
        bounds = (0, 0)
        banned = None
        if reasoning:
            bounds = internals.constraint_bounds(manager, request, tokens[:p])
            banned = _bans(manager, request)
        plan.add_request(
            matcher,
            tokens,
            terminated=internals.is_terminated(grammar),
            xgrammar=internals.is_xgrammar(grammar),
            p=p,
            bounds=bounds,
            banned=banned,
        )
    return plan


def _bans(manager: Any, request: Any) -> Any:
    return lambda: internals.masked_reasoning_ends(manager, request)


def checked_rows(plan: Plan, buffer: np.ndarray) -> Rows:
    """``plan``'s rows written into ``buffer`` (int32 ``[rows, words]``, at least
    ``plan.total`` rows). Raises ValueError, TypeError or RuntimeError when the library
    refuses the build, before any matcher moves. Blocks until written; every matcher ends
    where it started."""
    out = buffer[: plan.total]
    vocab = out.shape[1] * 32
    # xgrammar builds flag their refused nodes themselves (the compiled repair writes them):
    # no pass over the rows to find the refused drafts
    flag = plan.xgrammar_only and bool(plan.grammar_segments)
    tree = ps.GrammarTree.from_packed_chains(
        np.array(plan.tokens, dtype=np.int64), np.array(plan.offsets, dtype=np.int64)
    )
    valid = None
    if flag:
        mask, valid = ps.build_host_bitmask(plan.matchers, tree, vocab, out=out, return_valid=True)
    else:
        mask = ps.build_host_bitmask(plan.matchers, tree, vocab, out=out)
    if mask is None:
        out[:] = -1
    finish_rows(plan, out, valid)
    return Rows(out, plan.unwritten)
