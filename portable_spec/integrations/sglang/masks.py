"""The replacement of sglang's ``build_grammar_vocab_mask`` and its shadow mode.

sglang's contract, kept exactly: ``barrier()`` first (it advances the grammars over the
previous step's tokens), once; ``None`` when no request has a grammar (and then
``sampling_info.grammar_mask`` is left as it is); otherwise ``sampling_info.grammar_mask`` is
cleared and a ``GrammarMask`` holding the last request's grammar and the ``[batch * nodes,
words]`` int32 mask on ``device`` comes back, every row equal to sglang's
``generate_token_bitmask``. The library builds it (:func:`portable_spec.build_grammar_vocab_mask`:
the tree's host tensors read in place, the rows built over its thread pool, the upload started
from its pooled pinned buffers without blocking); the requests it leaves to sglang
(:mod:`.grammars`) are walked by sglang's own ``traverse_tree`` into rows allocated as sglang
does, and copied into place on the device's stream, as are the llguidance rows of
:mod:`.guidance`.

A step the library refuses (a tree it finds malformed, a matcher in an error state) is not an
error of the step: the refused requests are found, logged once, and built by sglang's own code
like the others above. No matcher moves before the library has checked its input, and every
matcher is back in its state when a build fails.

Shadow mode builds both: sglang's rows are used, the library's are compared with them row by
row, and each differing row is logged.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec.errors import MatcherError
from portable_spec.integrations.sglang import drafting, internals
from portable_spec.integrations.sglang.grammars import Plan, plan_step
from portable_spec.integrations.sglang.guidance import repaired_rows
from portable_spec.integrations.sglang.internals import CHAIN_MARK, logger
from portable_spec.integrations.sglang.state import INTEGRATION, LOG, STATS

__all__ = ["build_replacement", "chain_replacement"]

_LOGGED_DIFFERENCES = 20


def chain_replacement(original: Any) -> Any:
    """``GrammarTree.from_linear_chain``, marking its trees as chains."""

    def from_linear_chain(cls: Any, verify_ids_2d: Any) -> Any:
        tree = original(cls, verify_ids_2d)
        setattr(tree, CHAIN_MARK, True)
        return tree

    return from_linear_chain


def build_replacement(original: Any) -> Any:
    """``build_grammar_vocab_mask`` built by the library (``original``: sglang's own)."""

    def build_grammar_vocab_mask(
        *, reqs: Any, tree: Any, sampling_info: Any, device: Any, barrier: Any
    ) -> Any:
        if barrier is not None:
            barrier()
        return _build(original, reqs, tree, sampling_info, device)

    return build_grammar_vocab_mask


def _build(original: Any, reqs: Any, tree: Any, sampling_info: Any, device: Any) -> Any:
    vocab_size = int(sampling_info.vocab_size)
    plan = plan_step(reqs, vocab_size)
    if not plan.has_grammar:
        return None
    STATS.add("steps")
    if plan.whole_step:
        return _sglang_step(original, reqs, tree, sampling_info, device, plan.whole_step)
    host = tree.resolve()
    batch = len(plan.matchers)
    started = time.perf_counter()
    mask = _library_mask(plan, host, getattr(tree, CHAIN_MARK, False), vocab_size, device)
    if mask is None:  # refused beyond what the requests' own walks can take
        return _sglang_step(original, reqs, tree, sampling_info, device, "")
    STATS.time("portable_spec", batch, time.perf_counter() - started)
    STATS.add("built")
    if INTEGRATION.mode == "shadow":
        mask = _shadow(reqs, host, vocab_size, mask, device, batch)
    sampling_info.grammar_mask = None
    return internals.grammar_mask(plan.handle, mask)


def _sglang_step(
    original: Any, reqs: Any, tree: Any, sampling_info: Any, device: Any, why: str
) -> Any:
    """The step built by sglang's own function (its barrier already run)."""
    STATS.add("whole_steps")
    if why:
        LOG.warning(
            f"step:{why}",
            "portable_spec: %s: steps with them are built by sglang's own code",
            why,
        )
    return original(reqs=reqs, tree=tree, sampling_info=sampling_info, device=device, barrier=None)


def _library_mask(plan: Plan, host: Any, chain: bool, vocab_size: int, device: Any) -> Any:
    """The step's device mask: the library's rows, then the rows sglang builds itself."""
    import torch

    next_token, next_sibling, draft = (t.numpy() for t in host)
    arrays = [next_token, next_sibling, draft]
    try:
        mask, valid = _library_rows(plan, arrays, chain, vocab_size, device)
    except (TypeError, ValueError, MatcherError) as exc:
        STATS.add("refused_steps")
        refused = _refused_requests(plan, arrays, chain, vocab_size)
        if not refused:
            LOG.warning(f"refused:{type(exc).__name__}", "portable_spec: %s", exc)
            return None
        for b in refused:
            LOG.warning(
                "refused-request",
                "portable_spec: the library refused a request's grammar or tree (%s); "
                "such requests are built by sglang's own code",
                exc,
            )
            plan.matchers[b] = None
            plan.own.append(b)
        plan.guided = [g for g in plan.guided if g.index not in refused]
        arrays = _without(arrays, refused)  # their links go unread: sglang walks them
        chain = False
        try:
            mask, valid = _library_rows(plan, arrays, chain, vocab_size, device)
        except (TypeError, ValueError, MatcherError) as again:
            LOG.warning(f"refused:{type(again).__name__}", "portable_spec: %s", again)
            return None
    nodes = draft.shape[1]
    words = (vocab_size + 31) // 32
    if mask is None:
        mask = torch.full((len(plan.matchers) * nodes, words), -1, dtype=torch.int32, device=device)
    rows = []
    if plan.guided:
        rows = repaired_rows(plan.guided, (next_token, next_sibling, draft), valid,
                             plan.end_token, words)  # fmt: skip
        STATS.add("repaired_rows", len(rows))
    if plan.own:
        STATS.add("own_requests", len(plan.own))
        rows.extend(_own_rows(plan, host, vocab_size, nodes))
    if rows:
        _write_rows(mask, rows, device)
    return mask


def _library_rows(
    plan: Plan, arrays: list[np.ndarray], chain: bool, vocab_size: int, device: Any
) -> tuple[Any, np.ndarray | None]:
    import torch

    drafted = drafting.drafted_rows(plan, arrays, vocab_size, device)
    if drafted is not None:  # the step was drafted in a session: its rows, gathered
        return drafted
    next_token, next_sibling, draft = arrays
    if chain:
        tree = ps.GrammarTree.from_linear_chain(draft)
    else:
        tree = ps.GrammarTree.from_host(next_token, next_sibling, draft)
    reasoning = None
    if plan.end_token is not None:
        reasoning = ps.Reasoning(np.array(plan.thinking, dtype=bool), plan.end_token)
    if isinstance(device, str):
        device = torch.device(device)
    if plan.guided:
        return ps.build_grammar_vocab_mask(
            plan.matchers, tree, vocab_size, device=device, reasoning=reasoning, return_valid=True
        )
    mask = ps.build_grammar_vocab_mask(
        plan.matchers, tree, vocab_size, device=device, reasoning=reasoning
    )
    return mask, None


def _refused_requests(
    plan: Plan, arrays: list[np.ndarray], chain: bool, vocab_size: int
) -> list[int]:
    """The requests the library refuses on their own (their tree or their grammar)."""
    refused = []
    for b, matcher in enumerate(plan.matchers):
        one = [a[b : b + 1] for a in arrays]
        try:
            tree = (
                ps.GrammarTree.from_linear_chain(one[2])
                if chain
                else ps.GrammarTree.from_host(*one)
            )
            tree.validate()
            if matcher is not None:
                reasoning = None
                if plan.end_token is not None:
                    reasoning = ps.Reasoning(np.array([plan.thinking[b]]), plan.end_token)
                ps.build_host_bitmask([matcher], tree, vocab_size, reasoning=reasoning)
        except (TypeError, ValueError, MatcherError):
            refused.append(b)
    return refused


def _without(arrays: list[np.ndarray], refused: list[int]) -> list[np.ndarray]:
    """Copies of the tree arrays in which the refused requests are their root alone."""
    next_token, next_sibling, draft = (a.copy() for a in arrays)
    for b in refused:
        next_token[b] = -1
        next_sibling[b] = -1
    return [next_token, next_sibling, draft]


def _own_rows(plan: Plan, host: Any, vocab_size: int, nodes: int) -> list[tuple[int, Any]]:
    """The rows of the requests sglang builds itself: its ``traverse_tree``, into rows
    allocated as its build does (the step's first grammar allocates them)."""
    next_token, next_sibling, draft = host
    out = []
    for b in sorted(plan.own):
        grammar = plan.grammars[b]
        rows = internals.allocate_rows(plan.first, vocab_size, nodes)
        internals.traverse_tree(
            next_token[b], next_sibling[b], draft[b], grammar, rows, vocab_size=vocab_size
        )
        out.extend((b * nodes + j, rows[j]) for j in range(nodes))
    return out


def _write_rows(mask: Any, rows: list[tuple[int, Any]], device: Any) -> None:
    """Copy host rows into the device mask, on the current stream (non-blocking from pinned
    memory)."""
    import torch

    pinned = mask.device.type != "cpu"
    index = torch.tensor([r for r, _ in rows], dtype=torch.int64)
    values = torch.stack([v for _, v in rows])
    if pinned:
        values = values.pin_memory()
        mask.index_copy_(0, index.to(mask.device, non_blocking=True),
                         values.to(mask.device, non_blocking=True))  # fmt: skip
    else:
        mask.index_copy_(0, index, values)


def _shadow(reqs: Any, host: Any, vocab_size: int, ours: Any, device: Any, batch: int) -> Any:
    """sglang's own rows (used), compared with the library's."""
    started = time.perf_counter()
    theirs, _ = internals.generate_token_bitmask(reqs, *host, vocab_size)
    STATS.time("sglang", batch, time.perf_counter() - started)
    mine = ours.cpu().numpy()
    own = theirs.numpy()
    differing = np.flatnonzero((mine != own).any(axis=1)) if mine.shape == own.shape else None
    STATS.add("rows_compared", own.shape[0])
    if differing is None:
        STATS.add("rows_differing", own.shape[0])
        logger.warning(
            "portable_spec shadow: mask shapes differ: library %s, sglang %s",
            mine.shape,
            own.shape,
        )
    elif len(differing):
        STATS.add("rows_differing", len(differing))
        nodes = host[2].shape[1]
        for row in differing[:_LOGGED_DIFFERENCES]:
            logger.warning(
                "portable_spec shadow: row %d (request %d, node %d) differs from sglang's",
                row,
                row // nodes,
                row % nodes,
            )
    return theirs.to(device, non_blocking=True)
