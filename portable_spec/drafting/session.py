"""``DraftSession``: one grammar state per drafted node, masks for the drafter and the
verify mask from the same rows (see :mod:`portable_spec.drafting`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Any

import numpy as np

from portable_spec import native
from portable_spec.backend import Backend, MaskLayout
from portable_spec.builder import build_host_bitmask
from portable_spec.delivery import built_rows, deliver, plan, resolve_target, settle_dense
from portable_spec.drafting.levels import check_depths, check_parents, node_states, run_states
from portable_spec.drafting.trees import (
    StagedColumns,
    check_selection,
    host_view,
    links_from_parents,
    selection_tree,
)
from portable_spec.drafting.vocab import DraftVocab
from portable_spec.engines.base import NodeStates
from portable_spec.errors import MatcherError
from portable_spec.grammars import NONE, XGRAMMAR, classify_grammars
from portable_spec.hostbuffers import HostBuffer, HostBufferPool
from portable_spec.masks import ALL_ALLOWED, check_vocab_size, words_for
from portable_spec.pending import check_not_pending
from portable_spec.tree import GrammarTree, host_array

__all__ = ["DraftSession", "forced_tokens"]

_GENERAL = object()  # a level the one-call path leaves to the general one (nothing done)

# The session's host copy of every node's row, reused from session to session (a fresh
# multi-megabyte block per step costs page faults).
_stores = HostBufferPool(max_free=4)
# Blocks the masks of a session that stay in host memory are carved from: one block lent per
# session (and per row width) instead of a buffer taken and lent per level; a block returns
# here once the session and every mask carved from it are gone.
_outputs = HostBufferPool(max_free=4)


class DraftSession:
    """Grammar masks for a batch of draft trees grown level by level.

    Args:
        matchers: one entry per request, as for :func:`portable_spec.build_grammar_vocab_mask`:
            ``None``, an ``xgrammar.GrammarMatcher``, an ``llguidance.LLMatcher``, an
            ``outlines_core.Guide`` or a :class:`portable_spec.GrammarMatcherLike`, each in the
            state after the request's committed tokens (the root's token included). They are
            never moved by xgrammar, llguidance and protocol matchers with a ``fork()``; the
            others are moved inside a call and restored before it returns. Do not move them
            while the session is open.
        vocab_size: the target model's vocabulary size (the verify logits' width).
        device: where masks go: a ``torch.device``, a ``jax.Device`` or ``jax.sharding.Sharding``
            (its backend is found from it), a device string together with ``backend``, or
            ``None`` for numpy host arrays (or the default device of ``backend``).
        backend: a backend name (``"numpy"``, ``"torch"``/``"cuda"``, ``"jax"``) or object;
            default: the backend of ``device``.
        d2t: optional host int ``[draft_vocab]`` map from the drafter's vocabulary to target
            token ids (EAGLE-3's reduced draft vocabulary). The rows of :meth:`root_mask` and
            :meth:`extend` are then in the draft vocabulary (``ceil(draft_vocab / 32)``
            words); tokens passed to :meth:`extend` and the verify mask stay in the target
            vocabulary.
        max_nodes: expected tree size (nodes per request, root included): the host storage
            is sized for it and grows when a tree gets larger.

    Raises:
        TypeError, ValueError: bad matchers, vocabulary, device or ``d2t``; a matcher that a
            build started with ``wait=False`` still walks (as for a blocking build; the
            DraftSession's own calls that use the matchers refuse it too).
        MatcherError: a matcher raised while the root rows were filled.

    The constructor fills the root rows on the host (one fill per constrained request); it
    never waits for a device. Use the session from one thread at a time. For the next draft
    of the same requests, :meth:`restart` it rather than opening a new one.
    """

    def __init__(
        self,
        matchers: Sequence[Any],
        vocab_size: int,
        *,
        device: Any = None,
        backend: str | Backend | None = None,
        d2t: Any = None,
        max_nodes: int = 64,
    ) -> None:
        self.vocab_size = check_vocab_size(vocab_size)
        if isinstance(matchers, (str, bytes)) or not isinstance(matchers, Sequence):
            raise TypeError(
                "matchers must be a sequence with one entry per request, got "
                f"{type(matchers).__name__}"
            )
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, Integral) or max_nodes < 1:
            raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}")
        self.batch = len(matchers)
        if self.batch == 0:
            raise ValueError("a draft session needs at least one request")
        self._backend, self._placement = resolve_target(device, backend)
        self._draft = None if d2t is None else DraftVocab(d2t, self.vocab_size)
        kinds, infos = classify_grammars(matchers, self.batch, self.vocab_size)
        check_not_pending(matchers)  # a pending build is walking them: refused before any move
        self.words = words_for(self.vocab_size)
        self._kinds = kinds
        self._grammars = list(matchers)
        self._constrained = [b for b, kind in enumerate(kinds) if kind != NONE]
        # xgrammar requests: a level's rows from one compiled call that moves each matcher
        # over the new nodes only (a fork, an accept and a fill per node from Python cost
        # several times more); the others: their engine's draft states, node by node
        self._walked = [b for b in self._constrained if kinds[b] == XGRAMMAR]
        self._forked = [b for b in self._constrained if kinds[b] != XGRAMMAR]
        self._walked_index: np.ndarray | None = None  # the compiled walk's arguments, made once
        self._walked_limits: np.ndarray | None = None
        self._walked_matchers: list[Any] = []
        self._unconstrained = [b for b, kind in enumerate(kinds) if kind == NONE]
        self._others = [b for b in range(self.batch) if kinds[b] != XGRAMMAR]  # not walked
        # a level in one compiled call (checked, written, walked, copied out) while every
        # constrained request is walked; off for good once the helper is not in use
        self._one_call = bool(self._walked) and not self._forked
        self._batch_rows = np.arange(self.batch)[:, None]
        self._limits = np.zeros(self.batch, dtype=np.int64)
        for b in self._constrained:
            self._limits[b] = min(self.vocab_size, infos[b].vocab_size)  # type: ignore[union-attr]
        self._layouts: dict[tuple[Any, ...], MaskLayout | None] = {}
        # masks in host memory: carved from lent blocks, {words: (block, rows used)}
        self._outbox: dict[int, tuple[np.ndarray, int]] = {}
        # whether masks stay in host memory: asked once, of an empty mask
        empty = np.empty((0, 1), np.int32)
        self._host_masks = self._backend.host_mask(empty, self._placement) is not None
        self._padding_slots = False  # whether a level added so far had a padding slot
        self._closed = False
        self._nodes = 1
        self._levels = 0
        self._pending: list[tuple[int, StagedColumns]] = []
        self.timings = {"levels": 0, "wait_s": 0.0, "grammar_s": 0.0, "upload_s": 0.0}
        self._capacity = 0
        self._store: HostBuffer | None = None
        self._grow(int(max_nodes))
        self._infos = infos
        self._states: list[NodeStates | None] = [None] * self.batch
        self._limited: list[int] = []  # requests whose engine bounds a tree's depth
        self._start_root()

    def _start_root(self, *, again: bool = False) -> None:
        """The root column: each constrained request's draft states and root row from its
        matcher's current state (``again``: the column was set up by an earlier draft, which
        left every column-0 entry as it was but the constrained requests' rows and live
        flags). Closes the session when a matcher fails."""
        started = time.perf_counter()
        rows = self._rows
        if again:
            self._live[self._constrained, 0] = True
        else:
            rows[:, 0] = ALL_ALLOWED
            self._parents[:, 0] = -1
            self._tokens[:, 0] = 0
            self._depth[:, 0] = 0
            self._valid[:, 0] = True
            self._live[:, 0] = True
        kinds, matchers, infos = self._kinds, self._grammars, self._infos
        try:
            for b in self._constrained:
                if self._states[b] is not None:  # kept by restart(), emptied
                    continue
                states = node_states(kinds[b], matchers[b], infos[b], self.words)  # type: ignore[arg-type]
                self._states[b] = states
                if states.max_depth is not None:
                    self._limited.append(b)
            # the walked requests' root rows in one compiled call, else each engine's own
            walked = self._start_walked()
            for b in self._constrained:
                if walked and kinds[b] == XGRAMMAR:
                    continue
                states = self._states[b]  # type: ignore[assignment]
                try:
                    alive = states.start(rows[b])
                except BaseException as exc:
                    raise MatcherError(b, exc) from exc
                if not alive:
                    rows[b, 0] = ALL_ALLOWED
                    self._live[b, 0] = False
        except BaseException:
            self.close()
            raise
        self.timings["grammar_s"] += time.perf_counter() - started

    def restart(self) -> None:
        """Begin the next draft of the same requests: every node but the root is dropped and
        the root rows are computed again from the matchers' current state (moved, since the
        last draft, over the tokens the engine committed).

        What depends only on the requests is kept: their classification, the host storage,
        the planned mask layouts, the compiled walk's arguments. So an engine that drafts
        the same batch step after step restarts one session instead of opening a new one
        each step. The matchers must be the same objects the session was opened with, in a
        state a new session would accept; a request whose grammar has ended gets an
        all-allowed root row, as in a new session. Masks already returned stay valid.

        Raises:
            RuntimeError: the session is closed.
            ValueError: a matcher that a build started with ``wait=False`` still walks
                (nothing changed: the session keeps its tree).
            MatcherError: a matcher raised while the root rows were filled (the session is
                then closed).

        Blocks for the root rows' host work; never waits for a device.
        """
        self._check_open()
        check_not_pending(self._grammars)
        self._pending.clear()
        for b in self._constrained:
            self._states[b].close()  # type: ignore[union-attr]
            if self._kinds[b] != XGRAMMAR:  # made again from the matcher's current state
                self._states[b] = None
        # an xgrammar request's states (a fork per kept node, the matcher itself at the root)
        # are empty once closed: kept for the next draft
        self._limited = [b for b in self._limited if self._kinds[b] == XGRAMMAR]
        self._padding_slots = False
        self._nodes = 1
        self._levels = 0
        self._start_root(again=True)

    def _start_walked(self) -> bool:
        """The walked requests' root rows and live flags by the compiled walk (their matchers
        stay where they are); False, nothing written, when the helper cannot do it."""
        if not self._walked or not self._grow_walked(0, 1):
            return False
        for b in self._walked:
            if self._live[b, 0]:
                self._states[b].started()  # type: ignore[union-attr]
        return True

    def _grow_walked(self, start: int, end: int) -> bool:
        """:func:`portable_spec.native.grow_xgrammar` over the walked requests' nodes ``start
        .. end - 1`` (node 0: the roots); False, nothing written, when the helper declines. A
        matcher's failure is raised as :class:`MatcherError` naming its request."""
        sub = self._walked
        self._walk_args()
        done = native.grow_xgrammar(
            self._walked_matchers,
            self._walked_index,
            self._walked_limits,
            self._rows,
            self._parents,
            self._tokens,
            self._valid,
            self._live,
            start,
            end,
        )
        if done is None:
            return False
        failed, message, _, _ = done
        if failed >= 0:
            raise MatcherError(sub[failed], RuntimeError(message))
        return True

    def _walk_args(self) -> None:
        """The compiled walk's arguments for the walked requests, made once."""
        if self._walked_index is None:
            self._walked_index = np.asarray(self._walked, dtype=np.int64)
            self._walked_limits = self._limits[self._walked_index]
            self._walked_matchers = [self._grammars[b] for b in self._walked]

    # -- storage ------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        """Make room for ``capacity`` nodes per request (keeps what is stored)."""
        if capacity <= self._capacity:
            return
        capacity = max(capacity, 2 * self._capacity)
        store = _stores.acquire((self.batch, capacity, self.words), np.int32)
        parents = np.full((self.batch, capacity), -1, dtype=np.int64)
        tokens = np.zeros((self.batch, capacity), dtype=np.int64)
        depth = np.zeros((self.batch, capacity), dtype=np.int64)
        valid = np.zeros((self.batch, capacity), dtype=bool)
        live = np.zeros((self.batch, capacity), dtype=bool)
        if self._store is not None:
            n = self._capacity
            store.array[:, :n] = self._rows[:, :n]
            parents[:, :n] = self._parents[:, :n]
            tokens[:, :n] = self._tokens[:, :n]
            depth[:, :n] = self._depth[:, :n]
            valid[:, :n] = self._valid[:, :n]
            live[:, :n] = self._live[:, :n]
            _stores.release(self._store)
        self._store = store
        self._rows = store.array
        self._parents, self._tokens, self._depth = parents, tokens, depth
        self._valid, self._live = valid, live
        self._capacity = capacity

    # -- the public state ---------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """Nodes per request so far, the root and levels submitted with ``masks=False``
        included (padding slots count as nodes)."""
        return self._nodes

    @property
    def levels(self) -> int:
        """Levels added so far."""
        return self._levels

    @property
    def backend(self) -> Backend:
        """The backend the masks are uploaded with."""
        return self._backend

    @property
    def draft_vocab_size(self) -> int:
        """The drafter's vocabulary size (``len(d2t)``, else ``vocab_size``)."""
        return self.vocab_size if self._draft is None else self._draft.size

    def __enter__(self) -> DraftSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release the kept grammar states and host storage. Idempotent. Masks already
        returned stay valid."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        self._grammars = []
        self._outbox = {}  # masks already returned keep their block
        for states in self._states if hasattr(self, "_states") else ():
            if states is not None:
                states.close()
        if self._store is not None:
            _stores.release(self._store)
            self._store = None

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DraftSession is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._nodes} nodes, {self._levels} levels"
        return (
            f"DraftSession(batch={self.batch}, vocab_size={self.vocab_size}, "
            f"backend={self._backend.name!r}, {state})"
        )

    # -- rows for the drafter -----------------------------------------------------------------
    def root_mask(self, *, row_capacity: int | None = None) -> Any:
        """The root rows: int32 ``[batch, words]`` on the session's device, one row per request
        (the grammar's mask after the committed tokens), to apply to the drafter's first
        logits. ``words`` is ``ceil(draft_vocab / 32)`` with ``d2t``, else
        ``ceil(vocab_size / 32)``.

        Returns ``None`` when no request has a grammar, unless ``row_capacity`` is given or
        the placement spans several processes (then an all-allowed mask of that shape, as
        :func:`portable_spec.build_grammar_vocab_mask` does). Needs no device synchronization:
        the rows were filled on the host when the session started; the upload is started
        without blocking.
        """
        self._check_open()
        layout = self._layout(1, row_capacity, draft=True)
        out = self._plain_host(layout, self.batch)
        if out is None:
            return self._deliver(self._rows[:, :1], layout, draft=True)
        np.copyto(out, self._rows[:, 0])
        return self._backend.host_mask(out, layout.placement)  # type: ignore[union-attr]

    def extend(
        self, parents: Any, tokens: Any, *, masks: bool = True, row_capacity: int | None = None
    ) -> Any:
        """Add a level of nodes and return their rows.

        Args:
            parents: int ``[batch, k]`` (``[k]`` for batch 1): the parent of each new node, an
                existing node id (``0 <= parent < session.nodes``, not a padding slot), or -1
                for a padding slot. Host or device array (torch, JAX, numpy, lists).
            tokens: int ``[batch, k]``: each new node's draft token (target vocabulary ids;
                any value: ids outside the vocabulary are rejected nodes, as in a verify
                tree). Same framework rules as ``parents``.
            masks: False to add the level without computing or returning its rows now: the
                arrays' host copies are started and the rows are computed on the next call
                that needs them (a later :meth:`extend`, :meth:`verify_mask`, ...). Use it for
                the last level, whose rows only the verify mask needs: call it before
                launching the verify forward and :meth:`verify_mask` after, so that the
                grammar work overlaps the forward.
            row_capacity: rows of the returned mask (all-allowed padding), as for
                :func:`portable_spec.build_grammar_vocab_mask`.

        Returns:
            With ``masks``: int32 ``[batch * k, words]`` (``row_capacity`` rows if given) on the
            session's device, row ``b * k + j`` for new node ``j`` of request ``b``: the mask
            to apply to the logits that node produces (the grammar's mask after its root path
            if the grammar accepts the path, else all-allowed, -1). ``None`` without
            ``masks``, or when no request has a grammar (see :meth:`root_mask`).

        Raises:
            TypeError, ValueError: malformed arrays (dtype, shape), a parent that is not an
                existing node or is a padding slot, a tree deeper than an outlines-core guide
                can roll back, a matcher that a build started with ``wait=False`` still
                walks. Raised before any matcher moves; the level is not added.
            MatcherError: a matcher raised (the level is not added; every matcher is back in
                its state).

        Blocks while a device array's host copy lands (the drafter's kernels that produced it
        run first) and while the rows are computed; the upload is started without blocking.
        New node ids: ``session.nodes`` (read before the call) up to ``session.nodes + k - 1``.
        """
        self._check_open()
        one_call = masks and row_capacity is None and self._one_call
        if one_call and not self._pending:  # host arrays: no staging at all
            level = self._host_level(parents, tokens)
            if level is not None:
                rows = self._one_call_level(*level)
                if rows is not _GENERAL:
                    return rows
        staged = StagedColumns((parents, tokens), ("parents", "tokens"), self.batch, self._backend)
        if masks:  # the states fork or move the session's matchers: not while a build walks them
            check_not_pending(self._grammars)
        k = staged.shape[1]
        if not masks:
            self._pending.append((self._nodes, staged))
            self._nodes += k
            self._levels += 1
            return None
        layout = self._layout(k, row_capacity, draft=True)  # refused before anything moves
        self._flush()
        if one_call and self._one_call:
            level = staged.resolve()
            rows = self._one_call_level(*level)
            if rows is not _GENERAL:
                return rows
            staged = StagedColumns(level, ("parents", "tokens"), self.batch)
        first = self._nodes
        self._add_level(first, staged)
        return self._deliver(self._rows[:, first : first + k], layout, draft=True)

    def _host_level(self, parents: Any, tokens: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """A level's arrays as they are when both are C-contiguous int64 ``[batch, k]`` host
        arrays (numpy, or the numpy view of a CPU tensor); else None (staged as usual)."""
        out = []
        for array in (parents, tokens):
            if type(array) is not np.ndarray:
                if isinstance(array, (list, tuple)) or not self._backend.owns(array):
                    return None
                array = host_view(self._backend, array)
                if array is None:
                    return None
            if (
                array.dtype != np.int64 or array.ndim != 2 or array.shape[0] != self.batch
                or array.shape[1] < 1 or not array.flags.c_contiguous
            ):  # fmt: skip
                return None
            out.append(array)
        return (out[0], out[1]) if out[0].shape == out[1].shape else None

    def _one_call_level(self, parents: np.ndarray, tokens: np.ndarray) -> Any:
        """:meth:`extend` of a level (int64 ``[batch, k]`` arrays, no ``row_capacity``, nothing
        pending) by :func:`portable_spec.native.level_xgrammar`: its checks, its columns, its
        walk and the copy into the mask in one call. ``_GENERAL``, nothing done, when the
        level needs the general path (a malformed parent, which it names; no helper)."""
        check_not_pending(self._grammars)
        first, k = self._nodes, parents.shape[1]
        layout = self._layout(k, None, draft=True)
        t0 = time.perf_counter()
        self._grow(first + k)
        self._walk_args()
        out = self._plain_host(layout, self.batch * k)
        done = native.level_xgrammar(
            self._walked_matchers, self._walked_index, self._walked_limits,  # type: ignore[arg-type]
            self._rows, self._parents, self._tokens, self._valid, self._live, first,
            parents, tokens, out,
        )  # fmt: skip
        if done is None:
            self._one_call = False
            return _GENERAL
        status, padded, _, _, failed, message = done
        if status == 1:
            return _GENERAL
        try:
            if failed >= 0:
                raise MatcherError(self._walked[failed], RuntimeError(message))
            if status == 2:  # the compiled walk declined: the whole tree walked instead
                self._walk_whole(first, first + k)
                out = None
        except BaseException:
            for states in self._states:
                if states is not None:
                    states.discard(first)
            raise
        self._padding_slots = self._padding_slots or padded
        self._nodes = first + k
        self._levels += 1
        self.timings["levels"] += 1
        self.timings["grammar_s"] += time.perf_counter() - t0
        if out is None:
            return self._deliver(self._rows[:, first : first + k], layout, draft=True)
        return self._backend.host_mask(out, layout.placement)  # type: ignore[union-attr]

    def _flush(self) -> None:
        """Compute the rows of levels added with ``masks=False`` (the walked requests' rows of
        all of them in one walk)."""
        if not self._pending:
            return
        check_not_pending(self._grammars)  # nothing dropped: the caller may retry
        start, count = self._pending[0][0], len(self._pending)
        try:
            while self._pending:
                first, staged = self._pending[0]
                self._add_level(first, staged, pending=True, walk=False)
                self._pending.pop(0)
            t0 = time.perf_counter()
            self._walk(start, self._nodes)
            self.timings["grammar_s"] += time.perf_counter() - t0
        except BaseException:
            # these levels are dropped
            for states in self._states:
                if states is not None:
                    states.discard(start)
            self._nodes = start
            self._levels -= count
            self._pending.clear()
            raise

    def _add_level(
        self, first: int, staged: StagedColumns, *, pending: bool = False, walk: bool = True
    ) -> None:
        t0 = time.perf_counter()
        parents, tokens = staged.resolve()
        t1 = time.perf_counter()
        k = parents.shape[1]
        where = " (a level added with masks=False)" if pending else ""
        found = check_parents(
            first, parents, self._parents, where, padding_slots=self._padding_slots
        )
        padded = found is not None
        safe_parent = np.where(found, 0, parents) if padded else parents
        self._grow(first + k)
        columns = slice(first, first + k)
        rows_b = self._batch_rows
        if self._limited:  # depths only matter to engines that bound them
            depth = self._depth[rows_b, safe_parent] + 1
            if padded:
                depth[found] = 0
            check_depths(self._states, self._limited, depth, where)
            self._depth[:, columns] = depth

        # writes below stay invisible until self._nodes moves past them
        if padded:
            self._padding_slots = True  # later levels look their parents up
        self._parents[:, columns] = parents
        self._tokens[:, columns] = np.where(found, 0, tokens) if padded else tokens
        if self._forked or self._unconstrained:
            pad = found if found is not None else np.zeros(parents.shape, dtype=bool)
            self._decide_others(first, parents, tokens, pad, safe_parent)
        if walk:
            try:
                self._walk(first, first + k)
            except BaseException:
                for states in self._states:
                    if states is not None:
                        states.discard(first)
                raise
        if not pending:
            self._nodes = first + k
            self._levels += 1
        self.timings["levels"] += 1
        self.timings["wait_s"] += t1 - t0
        self.timings["grammar_s"] += time.perf_counter() - t1

    def _decide_others(
        self,
        first: int,
        parents: np.ndarray,
        tokens: np.ndarray,
        pad: np.ndarray,
        safe_parent: np.ndarray,
    ) -> None:
        """Rows, ``valid`` and ``live`` of a level's nodes (ids from ``first``; ``parents`` and
        ``tokens`` int64 ``[batch, k]``, ``pad`` their padding slots) for the requests that
        are not walked: unconstrained ones (every node valid and live, all-allowed) and those
        whose engine decides node by node. The walked requests' columns are left to their
        walk, which writes all of them."""
        batch, k = parents.shape
        columns = slice(first, first + k)
        rows_b = self._batch_rows
        valid = np.zeros((batch, k), dtype=bool)
        live = np.zeros((batch, k), dtype=bool)
        unconstrained = self._unconstrained
        if unconstrained:
            valid[unconstrained] = ~pad[unconstrained]
            live[unconstrained] = ~pad[unconstrained]
        if self._forked:
            parent_live = self._live[rows_b, safe_parent] & ~pad
            limits = self._limits[:, None]
            in_range = (tokens >= 0) & (tokens < limits)
            safe_token = np.where(in_range, tokens, 0)
            word = self._rows[rows_b, safe_parent, safe_token >> 5]
            allowed = ((word >> (safe_token & 31)) & 1).astype(bool)
            candidate = parent_live & in_range & allowed
            run_states(
                self._states,
                self._forked,
                self._rows,
                self._parents,
                self._tokens,
                first,
                parents,
                tokens,
                candidate,
                valid,
                live,
            )
        # all-allowed rows: padding, nodes of unconstrained requests, forked requests' nodes
        # that are not live; the walked requests' rows are all written by their walk
        fill = ~live | pad
        if unconstrained:
            fill[unconstrained] = True
        if self._walked:
            fill[self._walked] = False
        if fill.any():
            self._rows[:, columns][fill] = ALL_ALLOWED
        others = self._others
        self._valid[others, columns] = valid[others]
        self._live[others, columns] = live[others]

    def _walk(self, start: int, end: int) -> None:
        """The walked requests' rows, ``valid`` and ``live`` for nodes ``start .. end - 1``
        (their parents and tokens written; nodes below ``start`` decided).

        With the compiled helper, each request's matcher decides only the new nodes (one
        accept and one fill each, its ancestors accepted on the way: see
        :func:`portable_spec.native.grow_xgrammar`). Otherwise one compiled walk of each
        request's tree of nodes ``0 .. end - 1``, which refills every earlier node's row."""
        if not self._walked or end <= start:
            return
        if not self._grow_walked(start, end):
            self._walk_whole(start, end)

    def _walk_whole(self, start: int, end: int) -> None:
        """:meth:`_walk` by one compiled walk of the whole tree so far (a node is live when
        accepted and its row is the grammar's: the walk leaves terminated nodes all-allowed,
        and a live all-allowed row, a grammar allowing every token, has nothing to mask nor to
        force)."""
        sub = self._walked
        parents = self._parents[sub, :end]
        next_token, next_sibling = links_from_parents(parents)
        tree = GrammarTree.from_host(next_token, next_sibling, self._tokens[sub, :end])
        try:
            mask, valid = build_host_bitmask(
                [self._grammars[b] for b in sub], tree, self.vocab_size, return_valid=True
            )
        except MatcherError as exc:
            raise MatcherError(sub[exc.request_index], exc.error) from exc.error
        index = np.asarray(sub)
        rows = mask.reshape(len(sub), end, self.words)[:, start:end]
        fresh = valid[:, start:end]
        self._valid[index, start:end] = fresh
        self._live[index, start:end] = fresh & (rows != ALL_ALLOWED).any(axis=2)
        self._rows[index, start:end] = rows

    # -- the verify mask ----------------------------------------------------------------------
    def _selection(self, select: Any) -> np.ndarray:
        """The selected node ids ``[batch, m]`` (validated), all nodes when None."""
        n = self._nodes
        if select is None:
            return np.broadcast_to(np.arange(n, dtype=np.int64), (self.batch, n))
        return check_selection(select, self.batch, self._parents, n, self._backend)

    def verify_mask(
        self, select: Any = None, *, row_capacity: int | None = None, return_valid: bool = False
    ) -> Any:
        """The grammar mask of the verify tree: the drafted tree, or a subtree of it.

        Args:
            select: ``None`` for every drafted node in id order, or int ``[batch, m]`` (host or
                device; ``[m]`` for batch 1): the drafted node at each verify-tree node
                (``select[b, 0] = 0``, the root; -1 for padding), every selected node's parent
                selected too (as EAGLE's re-ranking to ``num_draft_tokens`` keeps them).
            row_capacity: rows of the returned mask (all-allowed padding), as for
                :func:`portable_spec.build_grammar_vocab_mask`.
            return_valid: also return :meth:`valid` of the same selection (checked once).

        Returns:
            int32 ``[batch * m, ceil(vocab_size / 32)]`` on the session's device, row
            ``b * m + j`` = the row of drafted node ``select[b, j]`` (all-allowed for
            padding): bit-identical to :func:`portable_spec.build_grammar_vocab_mask` on the
            verify tree (:meth:`verify_tree`), computed from the rows drafting computed: no
            grammar walk, one gather. ``None`` when no request has a grammar (unless
            ``row_capacity`` is given or the placement spans processes). With
            ``return_valid``: ``(mask, valid)``, ``valid`` as :meth:`valid` returns it.

        Blocks only to compute levels added with ``masks=False`` and, for a device
        ``select``, for its host copy; the upload is started without blocking.
        """
        self._check_open()
        self._flush()
        sel = self._selection(select)
        batch, m = sel.shape
        layout = self._layout(m, row_capacity, draft=False)
        t0 = time.perf_counter()
        index = (np.arange(batch)[:, None] * self._capacity + np.where(sel >= 0, sel, 0)).ravel()
        padding = (sel < 0).ravel()
        flat = self._rows.reshape(batch * self._capacity, self.words)

        def fill(out: np.ndarray) -> None:
            # "clip": the indices are in range by construction, and the default "raise"
            # buffers the whole output (several times slower)
            np.take(flat, index, axis=0, out=out, mode="clip")
            if padding.any():
                out[padding] = ALL_ALLOWED

        self.timings["grammar_s"] += time.perf_counter() - t0
        mask = self._upload(fill, layout, self.words)
        return (mask, self._selected_valid(sel)) if return_valid else mask

    def verify_tree(self, select: Any = None) -> GrammarTree:
        """The verify tree of a selection (see :meth:`verify_mask`) as a host
        :class:`portable_spec.GrammarTree`: children in selection order, draft tokens of the
        selected nodes (0 for padding)."""
        self._check_open()
        self._flush()
        sel = self._selection(select)
        return selection_tree(sel, self._parents, self._tokens)

    def valid(self, select: Any = None) -> np.ndarray:
        """bool ``[batch, m]``: whether the grammar accepts each node's root path (end tokens
        included; the root always; every node of an unconstrained request; never padding)."""
        self._check_open()
        self._flush()
        return self._selected_valid(self._selection(select))

    def _selected_valid(self, sel: np.ndarray) -> np.ndarray:
        chosen = sel >= 0
        return self._valid[self._batch_rows, np.where(chosen, sel, 0)] & chosen

    def tree(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the drafted tree so far: ``(parents, tokens)``, int64 ``[batch, nodes]``
        (parent -1 for the root and padding slots; token 0 for both)."""
        self._check_open()
        self._flush()
        n = self._nodes
        return self._parents[:, :n].copy(), self._tokens[:, :n].copy()

    def forced(self, nodes: Any = None, *, max_tokens: int = 16) -> list[list[int]]:
        """The grammar's forced continuation after a node of each request, as a draft chain.

        Args:
            nodes: ``None`` for the root, or one node id per request (host ints; -1: none).
            max_tokens: the longest chain returned.

        Returns:
            One token list per request: tokens every grammar-valid output continues with
            (xgrammar ``find_jump_forward_tokens``, llguidance ``compute_ff_tokens``,
            outlines-core: tokens that are the only one their state allows, protocol
            matchers: their ``find_jump_forward_tokens()`` if they have one). Empty for
            unconstrained requests, nodes the grammar rejected or that ended it, and where
            nothing is forced. Graft the chain onto a tree with :func:`graft_chain`, or add it
            as levels of width 1.
        """
        self._check_open()
        self._flush()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, Integral) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
        check_not_pending(self._grammars)
        if nodes is None:
            chosen = [0] * self.batch
        else:
            host = host_array("nodes", nodes).reshape(-1)
            if host.dtype.kind not in "iu" or host.shape != (self.batch,):
                raise ValueError(f"nodes must be {self.batch} integer node ids, got {host!r}")
            chosen = [int(v) for v in host]
            for b, v in enumerate(chosen):
                if not -1 <= v < self._nodes:
                    raise ValueError(f"nodes[{b}] = {v} is not a node (0..{self._nodes - 1})")
        out: list[list[int]] = []
        for b, v in enumerate(chosen):
            states = self._states[b]
            if states is None or v < 0 or not self._live[b, v] or max_tokens == 0:
                out.append([])
                continue
            try:
                out.append(
                    states.forced(v, self._parents[b], self._tokens[b], self._rows[b], max_tokens)
                )
            except BaseException as exc:
                raise MatcherError(b, exc) from exc
        return out

    # -- upload ------------------------------------------------------------------------------------
    def _layout(self, nodes: int, row_capacity: int | None, *, draft: bool) -> MaskLayout | None:
        """Check and plan a mask of ``batch * nodes`` rows (None: nothing to upload, no
        request has a grammar). Raises before anything is computed."""
        # a level's layout depends on its width and capacity alone: planned once per session
        key = (nodes, type(row_capacity), row_capacity, draft)
        if key in self._layouts:
            return self._layouts[key]
        vocab = self._draft.size if draft and self._draft is not None else self.vocab_size
        layout: MaskLayout | None = plan(
            self._backend, self._placement, self.batch, nodes, vocab, row_capacity
        )
        if not self._constrained and row_capacity is None and not layout.collective:  # type: ignore[union-attr]
            layout = None
        if len(self._layouts) < 64:
            self._layouts[key] = layout
        return layout

    def _deliver(self, block: np.ndarray, layout: MaskLayout | None, *, draft: bool) -> Any:
        """Upload ``block`` (``[batch, k, words]`` target rows), converted to the draft
        vocabulary when the session has one and ``draft``."""
        batch, k, _ = block.shape
        if draft and self._draft is not None:
            vocab = self._draft

            def fill(out: np.ndarray) -> None:
                vocab.convert(block.reshape(batch * k, self.words), out)

            return self._upload(fill, layout, vocab.words)

        def copy(out: np.ndarray) -> None:
            out.reshape(batch, k, self.words)[...] = block

        return self._upload(copy, layout, self.words)

    def _upload(
        self, fill: Callable[[np.ndarray], None], layout: MaskLayout | None, words: int
    ) -> Any:
        if layout is None:
            return None
        t0 = time.perf_counter()
        constrained = bool(self._constrained)
        built = built_rows(layout)

        def build(host: np.ndarray) -> np.ndarray | None:
            if constrained:
                fill(host[:built])
            return settle_dense(host, layout, constrained, True)

        if self._host_masks and not layout.collective:  # nothing to transfer: carve, wrap
            host = self._carve(layout.host_rows, words)
            uploaded = (
                None if build(host) is None else self._backend.host_mask(host, layout.placement)
            )
        else:
            uploaded, _ = deliver(self._backend, layout, words, build)
        self.timings["upload_s"] += time.perf_counter() - t0
        return uploaded

    def _plain_host(self, layout: MaskLayout | None, rows: int) -> np.ndarray | None:
        """Where a mask of ``rows`` target-vocabulary rows goes when it is the host array
        itself, its rows in order (host masks, no ``d2t``, nothing to arrange): carved, to be
        filled and wrapped by the caller; None when it needs :meth:`_deliver`."""
        if (
            self._host_masks and self._draft is None and layout is not None
            and not layout.collective and layout.host_rows == rows
            and layout.blocks == ((0, rows, 0),) and bool(self._constrained)
        ):  # fmt: skip
            return self._carve(rows, self.words)
        return None

    def _carve(self, rows: int, words: int) -> np.ndarray:
        """The next ``rows`` unused rows (int32 ``[rows, words]``, contents undefined) of this
        session's lent output block of that width; a fresh block, room for the whole tree,
        when the block is full."""
        block, used = self._outbox.get(words, (None, 0))
        if block is None or used + rows > block.shape[0]:
            size = max(rows, self.batch * (self._capacity + 1))
            block, used = _outputs.lend(_outputs.acquire((size, words), np.int32)), 0
        self._outbox[words] = (block, used + rows)
        return block[used : used + rows]


def forced_tokens(
    matchers: Sequence[Any], vocab_size: int, *, max_tokens: int = 16
) -> list[list[int]]:
    """The forced continuation of each request's grammar from its current state (see
    :meth:`DraftSession.forced`); matchers are not moved. Blocks for the host work only."""
    with DraftSession(matchers, vocab_size, max_nodes=1) as session:
        return session.forced(max_tokens=max_tokens)
