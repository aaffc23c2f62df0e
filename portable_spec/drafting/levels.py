"""Growing a draft tree by one level: which engine keeps a request's grammar state, the
checks of a level, and the engines deciding its nodes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from portable_spec.builder.routes import pool_worthy
from portable_spec.engines.base import MatcherInfo, NodeStates
from portable_spec.engines.generic import generic_states
from portable_spec.engines.llguidance import LLGuidanceStates
from portable_spec.engines.outlines import OutlinesStates
from portable_spec.engines.walk import LIVE, REFUSED
from portable_spec.engines.xgrammar import xgrammar_states
from portable_spec.errors import MatcherError
from portable_spec.grammars import GENERIC, LLGUIDANCE, OUTLINES, XGRAMMAR
from portable_spec.pool import WorkItemError, run_indexed

__all__ = ["check_depths", "check_parents", "node_states", "run_states"]


def node_states(kind: int, matcher: Any, info: MatcherInfo, words: int) -> NodeStates:
    """The draft states of a matcher of ``kind`` (as classified by
    :func:`portable_spec.grammars.classify_grammars`): its engine's."""
    if kind == XGRAMMAR:
        return xgrammar_states(matcher, info, words)
    if kind == LLGUIDANCE:
        return LLGuidanceStates(matcher, info, words)
    if kind == OUTLINES:
        return OutlinesStates(matcher, info, words)
    if kind == GENERIC:
        return generic_states(matcher, info, words)
    raise ValueError(f"no draft states for matcher kind {kind}")


def check_parents(
    first: int,
    parents: np.ndarray,
    tree_parents: np.ndarray,
    where: str,
    *,
    padding_slots: bool = True,
) -> np.ndarray | None:
    """A level's parent ids (int64 ``[batch, k]``) must be nodes ``0..first-1`` of the tree so
    far (``tree_parents``: int64 ``[batch, capacity]``) that are not padding slots, or -1;
    ``ValueError`` naming the first that is not (``where``: appended to the message).
    ``padding_slots``: False when the tree so far has no padding slot (nothing to look up).

    Returns the level's own padding slots (bool ``[batch, k]``, ``parents == -1``), or None
    when it has none."""
    low, high = int(parents.min()), int(parents.max())
    if low < -1 or high >= first:
        wrong = (parents < -1) | (parents >= first)  # argwhere only now: it costs more
        b, j = (int(x) for x in np.argwhere(wrong)[0])
        raise ValueError(
            f"parents[{b}, {j}] = {int(parents[b, j])} is not a node of the tree{where}: "
            f"parents must be existing nodes 0..{first - 1}, or -1 for a padding slot"
        )
    pad = parents < 0 if low < 0 else None
    if first == 1 or not padding_slots:
        return pad  # the root alone, or no padding slot to name
    safe = parents if pad is None else np.where(pad, 0, parents)
    # a parent whose own parent is -1 is a padding slot, unless it is the root
    wrong = (tree_parents[np.arange(parents.shape[0])[:, None], safe] < 0) & (safe > 0)
    if wrong.any():
        b, j = (int(x) for x in np.argwhere(wrong)[0])
        raise ValueError(
            f"parents[{b}, {j}] = {int(parents[b, j])} is a padding slot{where} (its "
            "parent was -1): padding has no children"
        )
    return pad


def check_depths(
    states: Sequence[NodeStates | None], constrained: Sequence[int], depth: np.ndarray, where: str
) -> None:
    """No request's tree may get deeper (``depth``: int64 ``[batch, k]`` of a new level) than
    its engine can roll back; ``ValueError`` naming the request otherwise."""
    for b in constrained:
        limit = states[b].max_depth  # type: ignore[union-attr]
        if limit is not None and depth[b].max(initial=0) > limit:
            deepest = int(depth[b].max())
            raise ValueError(
                f"the tree of request {b} would be {deepest} draft tokens deep{where} but "
                f"matchers[{b}] can roll back only {limit} (an outlines_core.Guide built "
                f"with max_rollback={limit}); build its Guide with max_rollback >= {deepest}"
            )


def run_states(
    states_of: Sequence[NodeStates | None],
    constrained: Sequence[int],
    rows: np.ndarray,
    tree_parents: np.ndarray,
    tree_tokens: np.ndarray,
    first: int,
    parents: np.ndarray,
    tokens: np.ndarray,
    candidate: np.ndarray,
    valid: np.ndarray,
    live: np.ndarray,
) -> None:
    """Decide every candidate node (``candidate``: bool ``[batch, k]``) of a level whose ids
    start at ``first`` with its request's grammar state, writing the rows of live nodes into
    ``rows`` (int32 ``[batch, capacity, words]``) and ``valid``/``live`` (bool ``[batch, k]``).
    Engines that release the GIL run on the library's pool when the level is large. A
    matcher that raises: every engine forgets the level and ``MatcherError`` names the
    request."""
    k = parents.shape[1]
    jobs: list[tuple[int, Callable[[], None]]] = []
    serial: list[tuple[int, Callable[[], None]]] = []
    for b in constrained:
        states = states_of[b]
        assert states is not None
        columns = np.flatnonzero(candidate[b])
        if columns.size == 0:
            continue
        items = [(first + int(j), int(parents[b, j]), int(tokens[b, j])) for j in columns.tolist()]

        def job(b: int = b, states: NodeStates = states, items: list = items) -> None:
            outcomes = states.grow(items, rows[b], tree_parents[b], tree_tokens[b])
            for (node, _, _), outcome in zip(items, outcomes, strict=True):
                valid[b, node - first] = outcome != REFUSED
                live[b, node - first] = outcome == LIVE

        (jobs if states.parallel else serial).append((b, job))
    if serial:  # Python-bound engines: other threads would only take turns with the GIL

        def run_serial() -> None:
            for b, job in serial:
                try:
                    job()
                except BaseException as exc:
                    raise MatcherError(b, exc) from exc

        jobs.append((serial[0][0], run_serial))
    parallel = pool_worthy(len(constrained) * k, rows.shape[-1])
    try:
        run_indexed(lambda i: jobs[i][1](), len(jobs), parallel=parallel and len(jobs) > 1)
    except WorkItemError as exc:
        for states in states_of:
            if states is not None:
                states.discard(first)
        if isinstance(exc.error, MatcherError):
            raise exc.error from exc.error.error
        raise MatcherError(jobs[exc.index][0], exc.error) from exc.error
