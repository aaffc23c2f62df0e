"""The shared host mask builder: one bitmask row per verify-tree node, for a whole batch.

Data flow of one build::

    check               every argument, before any matcher moves (this module)
    tree.resolve()      host int64 links and tokens (waits for the staged copy only), once
    tree.validate()     the links, once
    dispatch            dense (dense.py), compact (compact.py), or reasoning (reasoning.py)
    jobs                one planner over a row sink, run on the thread pool (jobs.py)

The result obeys the row contract documented on :func:`build_host_bitmask`. The modules
below this one never import it: the reasoning build receives it as a callable.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec.builder import small, small_llguidance
from portable_spec.builder.compact import build_compact
from portable_spec.builder.dense import build_dense
from portable_spec.builder.jobs import Build, per_node
from portable_spec.builder.reasoning import build_with_reasoning, check_reasoning
from portable_spec.grammars import LLGUIDANCE, NONE, _kind_by_type, classify_grammars
from portable_spec.masks import (
    check_compact_out,
    check_dense_out,
    check_layout,
    check_vocab_size,
    words_for,
)
from portable_spec.pending import hold_matchers, release_matchers
from portable_spec.tree import GrammarTree

__all__ = ["build_host_bitmask"]


def build_host_bitmask(
    matchers: Sequence[Any],
    tree: GrammarTree,
    vocab_size: int,
    *,
    out: Any = None,
    layout: str = "dense",
    max_rows: int | None = None,
    reasoning: Any = None,
    return_valid: bool = False,
) -> Any:
    """Build the grammar bitmask of every node of every request's verify tree, on the host.

    Args:
        matchers: one entry per request: ``None`` (unconstrained), an
            ``xgrammar.GrammarMatcher``, or an object following
            :class:`portable_spec.GrammarMatcherLike`. Each matcher must be in the state after
            the request's committed tokens (node 0's token included).
        tree: the batch's verify trees (:class:`portable_spec.GrammarTree`).
        vocab_size: the model's vocabulary size (the logits' width); at least each matcher's.
        out: optional C-contiguous int32 ``[batch * nodes, ceil(vocab_size / 32)]`` buffer to
            write into instead of allocating (compact: a :class:`CompactMask` of numpy arrays
            with room for every row the build may list: ``max_rows``, or the rows of the
            constrained requests).
        layout: ``"dense"`` (the default: every row) or ``"compact"``: a
            :class:`portable_spec.CompactMask` listing only the rows of accepted,
            non-terminated nodes of constrained requests (``rows`` int32 ``[K]`` ascending,
            ``bits`` int32 ``[K, words]``); every row not listed is all-allowed, and nothing is
            written for it.
        max_rows: compact only: the mask has exactly this many entries (``K`` real ones, then
            padding entries whose row is ``batch * nodes`` and whose bits are not written), so
            its shape does not change from step to step. ``ValueError`` if the build lists
            more (raised after the walks, every matcher back in its state).
        reasoning: a :class:`portable_spec.Reasoning`: requests still reasoning at the root
            get their grammar only below the node that ends the reasoning, per path (rows
            before it allow everything but the content end tokens the grammar refuses first).
            Dense layout only (``ValueError`` with ``layout="compact"``).
        return_valid: also return which nodes the matchers (and the reasoning rule) accept.

    Returns:
        ``None`` when the batch is empty or no request has a grammar (``out`` untouched).
        Otherwise the int32 ``[batch * nodes, ceil(vocab_size / 32)]`` mask (``out`` itself if
        given). Row ``b * nodes + j`` belongs to node ``j`` of request ``b``; bit ``t % 32`` of
        word ``t // 32`` set means token ``t`` is allowed. Node 0 is accepted; node ``j > 0`` is
        accepted iff its parent is accepted and not terminated, ``0 <= token < vocab_size`` and
        the token's bit is set in the parent's row. An accepted, non-terminated node's row is
        the grammar's mask after its root path (bits past the grammar's vocabulary are 0).
        Every other row is all-allowed (-1): unconstrained requests, rejected nodes and their
        subtrees, terminated nodes, and nodes no link reaches. With ``layout="compact"``, a
        host :class:`CompactMask` of those rows (``None`` as above); expanded with
        ``to_dense()`` it equals the dense mask.

        With ``return_valid=True``: ``(mask, valid)``, ``valid`` a bool ``[batch, nodes]``
        array, True for the accepted nodes by the rule above (terminated ones included; every
        node a link reaches for unconstrained requests; never for unreached padding). An
        engine truncates its drafts to the valid prefix with it (no separate validation pass).
        ``(None, valid)`` when no request has a grammar.

    Raises:
        TypeError, ValueError: malformed tree, matchers, ``vocab_size`` or ``out``; raised
            before any matcher moves.
        MatcherError: a matcher raised during its walk (``request_index`` names it; the
            original exception is chained). Every matcher is back in its starting state.

    Blocks the calling thread until the mask is complete (it waits for the tree's staged copy
    first). Requests are spread over the library's thread pool (:func:`set_num_threads`).
    Every matcher ends in the state it started in.
    """
    if type(tree) is not GrammarTree and not isinstance(tree, GrammarTree):
        raise TypeError(f"tree must be a portable_spec.GrammarTree, got {type(tree).__name__}")
    if reasoning is None and layout == "dense" and max_rows is None:
        # the common small call: one compiled call over the caller's arrays, else small chains
        # in Python (see small.py); None from either when anything is unusual
        done = None
        if tree._inplace is not None:
            llg = type(matchers) in (list, tuple) and matchers and _llguidance(matchers[0])
            quick = small_llguidance.in_place if llg else small.in_place
            done = quick(matchers, tree, vocab_size, out, return_valid)
        if done is None and (tree._chain or tree._packed):
            done = small.small_chains(matchers, tree, vocab_size, out, return_valid)
        if done is not None:
            return done
    vocab_size = check_vocab_size(vocab_size)
    max_rows = check_layout(layout, max_rows)
    batch = tree.batch
    if tree.is_packed and layout != "dense":
        raise ValueError(
            "packed chains (GrammarTree.from_packed_chains) build dense masks only; "
            "use layout='dense'"
        )
    words = words_for(vocab_size)
    thinking: list[int] = []
    if reasoning is not None:
        if layout != "dense":
            raise ValueError("reasoning= builds dense masks only; use layout='dense'")
        if out is not None:
            check_dense_out(out, tree.rows, words)
        checked = check_reasoning(reasoning, batch, vocab_size)
        thinking = [b for b in range(batch) if checked.active[b] and matchers[b] is not None]
    if type(matchers) is list or type(matchers) is tuple:
        # read once: another thread changing the caller's list meanwhile changes nothing
        matchers = list(matchers)
    kinds, infos = classify_grammars(matchers, batch, vocab_size)
    if thinking:  # every check before any matcher moves: the matchers, then the links
        arrays = tree.resolve()
        tree.validate()
        return build_with_reasoning(
            build_host_bitmask, matchers, tree, arrays, vocab_size, words, checked, thinking,
            out, return_valid,
        )  # fmt: skip
    constrained = [b for b, kind in enumerate(kinds) if kind != NONE]
    if not constrained:
        if return_valid:
            tree.validate()
            return None, per_node(tree, tree.topology().reachable)
        return None
    # the matchers this build walks, held until it is done (ValueError if another build holds
    # one: it would walk them at the same time)
    matchers = list(matchers)
    token, held = hold_matchers(matchers)
    try:
        return _build_held(
            matchers, tree, vocab_size, out, layout, max_rows, return_valid, kinds, infos,
            constrained, words,
        )  # fmt: skip
    finally:
        release_matchers(token, held)


def _llguidance(g: Any) -> bool:
    """Whether ``g`` is a matcher whose type the library knows as llguidance's."""
    return _kind_by_type.get(type(g)) == LLGUIDANCE


def _build_held(
    grammars: list[Any],
    tree: GrammarTree,
    vocab_size: int,
    out: Any,
    layout: str,
    max_rows: int | None,
    return_valid: bool,
    kinds: list[int],
    infos: list[Any],
    constrained: list[int],
    words: int,
) -> Any:
    """The rest of :func:`build_host_bitmask` once its arguments are checked and its
    matchers held."""
    if layout == "compact":
        capacity = len(constrained) * tree.nodes if max_rows is None else max_rows
        target = None if out is None else check_compact_out(out, capacity, words)
    else:
        rows = tree.rows
        mask = (
            check_dense_out(out, rows, words)
            if out is not None
            else np.empty((rows, words), np.int32)
        )
    started = perf_counter()
    arrays = tree.resolve()
    resolved = perf_counter()
    tree.validate()
    build = Build(
        grammars, tree, arrays, tree.spans(), vocab_size, kinds, infos, constrained,
        return_valid, (started, resolved),
    )  # fmt: skip
    if layout == "compact":
        return build_compact(build, target, max_rows)
    return build_dense(build, mask)
