"""Grammar-aware drafting in sglang: the verify mask of a drafted step.

sglang's speculative workers draft blind: an EAGLE head's top-k and an n-gram corpus both
propose tokens the grammar refuses, and each such node is a verify slot that can only be
rejected. With drafting on, the plugin's draft patches (:mod:`.eagle_draft`, :mod:`.ngram`)
grow each step's draft tree inside a :class:`portable_spec.DraftSession` of the batch's
grammars, and hand the step here (:func:`stage`): the verify build then takes the verify
tree's mask from the rows drafting computed (:func:`drafted_rows`: one gather, no second
walk), after checking that the tree sglang verifies is the tree that was drafted (node by
node: parent and token). Any other step, or a step whose tree differs, is built as before.

A session is not thrown away after its verify build: it is parked (:func:`park`), and the next
draft of the same requests restarts it (:func:`open_session`, ``DraftSession.restart``)
instead of opening a new one: the batch's classification, storage and layouts are the same
from step to step.

``PORTABLE_SPEC_SGLANG_DRAFTING`` (:mod:`.state`, read when the plugin installs):

* unset, empty, ``1``, ``on``: drafting on wherever the plugin is on; in the plugin's shadow
  mode, drafting is shadowed too;
* ``0``, ``off``: sglang's own draft code, untouched (the draft patches are not installed);
* ``shadow``: counting only: the draft trees are sglang's own, the plugin follows them in a
  session (its rows are what the verify build compares with sglang's in shadow mode) and
  counts what drafting would change;
* anything else: ValueError naming the variable.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec import native
from portable_spec.integrations.sglang.internals import logger
from portable_spec.integrations.sglang.state import STATS, drafting_mode
from portable_spec.topology import validate_links

__all__ = ["Drafted", "clear", "drafted_rows", "mode", "open_session", "park", "stage"]


def mode() -> str:
    """The drafting mode in force (:func:`.state.drafting_mode`)."""
    return drafting_mode()


@dataclass
class Drafted:
    """A step drafted under a session, waiting for its verify build.

    ``grammars``: the sglang grammar object of each request (None for none), as the session
    was opened for; ``matchers``: what the session was given per request; ``select``: int64
    ``[batch, nodes]``, the session node of each verify-tree node (-1: padding).
    """

    session: Any
    grammars: tuple[Any, ...]
    matchers: tuple[Any, ...]
    select: np.ndarray
    kind: str  # "eagle" or "ngram": which draft patch staged it

    def close(self) -> None:
        self.session.close()


_staged = threading.local()  # .step: the Drafted step of this thread's scheduler, or None


def stage(step: Drafted | None) -> None:
    """Hand a drafted step to the next verify build of this thread (a step still waiting is
    closed: its verify never came)."""
    old = getattr(_staged, "step", None)
    _staged.step = step
    if old is not None and old is not step:
        old.close()


def take() -> Drafted | None:
    """The step waiting for its verify build, removed from the stage."""
    step = getattr(_staged, "step", None)
    _staged.step = None
    return step


def clear() -> None:
    """Close and forget the step waiting in this thread, if any."""
    stage(None)


# .opened: (session, key) of the session this thread opened last (the key: what it was opened
# for); .parked: the same pair, kept after its verify build for the next draft
_sessions = threading.local()


def open_session(
    matchers: list[Any], vocab: int, *, device: Any, d2t: Any = None, max_nodes: int
) -> Any:
    """A :class:`portable_spec.DraftSession` of ``matchers`` (the step's, per request): the
    session parked by this thread's last verify build, restarted, when it was opened for the
    same matcher objects in the same order, vocabulary, device, ``d2t`` (the same array) and
    size; else a new one (the parked one is closed). Raises as the session does."""
    key = (tuple(matchers), vocab, device, d2t, max_nodes)
    kept = getattr(_sessions, "parked", None)
    _sessions.parked = None
    session = None
    if kept is not None:
        if _same(kept[1], key):
            session = kept[0]
            try:
                session.restart()
            except BaseException:  # closed by the restart, or closed here: nothing kept
                session.close()
                raise
            STATS.add("draft_sessions_restarted")
        else:
            kept[0].close()
    if session is None:
        session = ps.DraftSession(matchers, vocab, device=device, d2t=d2t, max_nodes=max_nodes)
    _sessions.opened = (session, key)
    return session


def _same(a: tuple, b: tuple) -> bool:
    """Whether two keys of :func:`open_session` name the same requests and session."""
    (m1, vocab1, device1, d2t1, n1), (m2, vocab2, device2, d2t2, n2) = a, b
    return (
        vocab1 == vocab2 and n1 == n2 and d2t1 is d2t2 and device1 == device2
        and len(m1) == len(m2) and all(x is y for x, y in zip(m1, m2, strict=True))
    )  # fmt: skip


def park(session: Any) -> None:
    """Keep ``session`` (its step built) for this thread's next draft when it is the session
    this thread opened last by :func:`open_session`; else close it. A session parked before
    is closed."""
    opened = getattr(_sessions, "opened", None)
    _sessions.opened = None
    old = getattr(_sessions, "parked", None)
    _sessions.parked = None
    if old is not None and old[0] is not session:
        old[0].close()
    if opened is not None and opened[0] is session:
        _sessions.parked = opened
    else:
        session.close()


def forget_parked() -> None:
    """Close the session kept in this thread, if any (the plugin is uninstalled)."""
    kept = getattr(_sessions, "parked", None)
    _sessions.parked = None
    _sessions.opened = None
    if kept is not None:
        kept[0].close()


def drafted_rows(
    plan: Any, arrays: list[np.ndarray], vocab_size: int, device: Any
) -> tuple[Any, np.ndarray] | None:
    """The verify mask of a drafted step from its session's rows: ``(mask, valid)`` (int32
    ``[batch * nodes, words]`` on ``device``, host bool ``[batch, nodes]``), or
    None when no step waits, when the step's requests, grammars or tree are not the drafted
    ones (the verify build then walks the tree as for any step), or when the plan needs rows a
    session does not have (a reasoning request, a request sglang's own walk builds).

    ``plan``: the step's :class:`~portable_spec.integrations.sglang.grammars.Plan`;
    ``arrays``: the verify tree's host ``(next_token, next_sibling, draft)``, int64
    ``[batch, nodes]``. Blocks for the rows of levels staged
    without masks (computed now); the upload is started without blocking.
    """
    step = take()
    if step is None:
        return None
    built = False
    try:
        if not _matches(step, plan, arrays, vocab_size):
            STATS.add("draft_mismatches")
            logger.debug("portable_spec: a drafted step's verify tree is not the drafted tree")
            return None
        mask, valid = step.session.verify_mask(step.select, return_valid=True)
        select = step.select
        real = (select > 0) & np.array([m is not None for m in step.matchers])[:, None]
        STATS.update({"draft_verify_masks": 1, "refused_draft_nodes": int((real & ~valid).sum())})
        if mask is None:  # no request has a grammar: nothing the caller could use
            return None
        if str(mask.device) != str(device):  # a session opened elsewhere than the verify
            mask = mask.to(device, non_blocking=True)
        built = True
        return mask, valid
    finally:
        if built:
            park(step.session)  # the next draft of these requests restarts it
        else:
            step.close()


def _matches(step: Drafted, plan: Any, arrays: list[np.ndarray], vocab_size: int) -> bool:
    """Whether the step to build is the drafted one: the same grammar objects and matchers,
    no request outside the session's reach, and the same tree (each node's parent and token)."""
    if plan.end_token is not None or plan.own or plan.whole_step:
        return False
    if step.session.vocab_size != vocab_size:
        return False
    if len(plan.grammars) != len(step.grammars):
        return False
    if any(a is not b for a, b in zip(plan.grammars, step.grammars, strict=True)):
        return False
    if any(a is not b for a, b in zip(plan.matchers, step.matchers, strict=True)):
        return False
    next_token, next_sibling, draft = arrays
    select = step.select
    if not draft.shape == next_token.shape == next_sibling.shape == select.shape:
        return False
    parents, tokens = step.session.tree()
    arrays64 = [np.ascontiguousarray(a, dtype=np.int64) for a in (*arrays, select)]
    same = native.tree_matches(*arrays64, parents, tokens)  # one compiled pass
    if same is not None:
        return same
    verified = _parents(next_token, next_sibling)
    if verified is None:  # malformed links: the verify build names the problem
        return False
    batch = select.shape[0]
    rows = np.arange(batch)[:, None]
    chosen = select >= 0
    safe = np.where(chosen, select, 0)
    position = np.full(parents.shape, -1, dtype=np.int64)  # session node -> verify node
    b, j = np.nonzero(chosen)
    position[b, select[b, j]] = j
    parent = parents[rows, safe]
    mine = np.where(chosen & (parent >= 0), position[rows, np.where(parent >= 0, parent, 0)], -1)
    if not np.array_equal(mine, verified):
        return False
    same = (tokens[rows, safe] == draft) | ~chosen
    same[:, 0] = True  # the root's token is the last committed one, not a draft
    return bool(same.all())


def _parents(next_token: np.ndarray, next_sibling: np.ndarray) -> np.ndarray | None:
    """Each node's parent (-1: the root, or a node no link reaches) from first-child /
    next-sibling links, int64 ``[batch, nodes]``; None when the links are not a well-formed
    tree. A fixed number of numpy passes: each sibling list's first node found by pointer
    jumping (``ceil(log2(nodes))`` rounds), once the links are known to be well formed (the
    compiled check, else the library's validator)."""
    next_token = np.ascontiguousarray(next_token, dtype=np.int64)
    next_sibling = np.ascontiguousarray(next_sibling, dtype=np.int64)
    batch, nodes = next_token.shape
    if not native.links_valid(next_token, next_sibling):
        try:
            validate_links(next_token, next_sibling)
        except ValueError:
            return None
    rows = np.arange(batch)[:, None]
    parent = np.full((batch, nodes), -1, dtype=np.int64)
    b, p = np.nonzero(next_token >= 0)
    parent[b, next_token[b, p]] = p
    first = np.broadcast_to(np.arange(nodes), (batch, nodes)).copy()  # the previous sibling
    b, v = np.nonzero(next_sibling >= 0)
    first[b, next_sibling[b, v]] = v
    for _ in range((nodes - 1).bit_length()):
        first = first[rows, first]
    return parent[rows, first]
