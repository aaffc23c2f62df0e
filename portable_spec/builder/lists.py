"""Chain engines' draft lists, read as they are: the route table's first row.

A chain engine (vLLM, MTP, EAGLE's chain mode) holds each request's drafts as a Python list.
:func:`portable_spec.build_chain_bitmask` hands them to the route table
(:mod:`portable_spec.builder.routes`), whose first row is :func:`build_lists`: when every
grammar is an xgrammar matcher the compiled helper can call (the common case), the lists are
read by one compiled call that also writes the rows no grammar walks (unconstrained requests,
padding, the free rows of a request still reasoning), and the chains are walked and repaired
(xgrammar's C++ traversal, GIL released; in parts on the library's pool when the table says
so). Otherwise the table goes on over :func:`chain_tree` of the same lists, with the same
rows, the same checks and the same errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec import stats
from portable_spec.builder import jobs
from portable_spec.builder.reasoning import Reasoning
from portable_spec.errors import MatcherError
from portable_spec.pending import hold_matchers, release_matchers
from portable_spec.stats import note_slow, record_build
from portable_spec.tree import GrammarTree

__all__ = ["build_lists", "chain_tree"]

_NO_ENDS = np.zeros(0, dtype=np.int64)
_end_arrays: dict[frozenset[int], np.ndarray] = {}


def chain_tree(drafts: Any, rows_per_request: int | None = None) -> GrammarTree:
    """The :class:`~portable_spec.GrammarTree` of per-request draft lists (see
    :func:`build_chain_bitmask`): ``from_packed_chains`` when ``rows_per_request`` is None,
    else ``from_linear_chain`` of a ``[batch, rows_per_request]`` array (roots 0, ``-1``
    after each request's drafts). Host arrays; ``TypeError``/``ValueError`` naming the
    request at fault."""
    if rows_per_request is not None and (
        not isinstance(rows_per_request, Integral)
        or isinstance(rows_per_request, bool)
        or rows_per_request < 1
    ):
        raise ValueError(f"rows_per_request must be None or an int >= 1, got {rows_per_request!r}")
    if isinstance(drafts, np.ndarray) and drafts.ndim == 2:
        drafts = list(drafts)
    if isinstance(drafts, (str, bytes)) or not isinstance(drafts, (Sequence, np.ndarray)):
        raise TypeError(
            f"drafts must be a sequence of per-request token lists, got {type(drafts).__name__}"
        )
    chains = [_request_drafts(b, d) for b, d in enumerate(drafts)]
    if rows_per_request is None:
        lengths = [len(c) + 1 for c in chains]
        offsets = np.zeros(len(chains) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.zeros(int(offsets[-1]), dtype=np.int64)
        for b, chain in enumerate(chains):
            tokens[offsets[b] + 1 : offsets[b + 1]] = chain
        return GrammarTree.from_packed_chains(tokens, offsets)
    width = int(rows_per_request)
    padded = np.full((len(chains), width), -1, dtype=np.int64)
    padded[:, 0] = 0
    for b, chain in enumerate(chains):
        if len(chain) >= width:
            raise ValueError(
                f"drafts[{b}] holds {len(chain)} drafts; rows_per_request={width} leaves room "
                f"for {width - 1}"
            )
        padded[b, 1 : 1 + len(chain)] = chain
    return GrammarTree.from_linear_chain(padded)


def _request_drafts(b: int, drafts: Any) -> np.ndarray:
    """Request ``b``'s drafts as int64 ``[k]``; ``TypeError``/``ValueError`` naming it."""
    if isinstance(drafts, (str, bytes)) or not isinstance(drafts, (Sequence, np.ndarray)):
        raise TypeError(
            f"drafts[{b}] must be a sequence of int token ids, got {type(drafts).__name__}"
        )
    if len(drafts) == 0:
        return np.zeros(0, dtype=np.int64)
    if not isinstance(drafts, np.ndarray) and any(isinstance(t, (bool, np.bool_)) for t in drafts):
        raise TypeError(f"drafts[{b}] must hold int token ids, not bools")
    try:
        array = np.asarray(drafts)
    except (ValueError, TypeError):
        raise TypeError(f"drafts[{b}] must be a flat sequence of int token ids") from None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TypeError(
            f"drafts[{b}] must be a 1-D sequence of int token ids, got dtype {array.dtype} "
            f"and shape {array.shape}"
        )
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"drafts[{b}] holds a token id outside int64")
    return array.astype(np.int64, copy=False)


def build_lists(
    grammars: Any,
    drafts: Any,
    vocab_size: Any,
    rows_per_request: Any,
    out: Any,
    reasoning: Any,
    return_valid: bool,
    parts_from: int,
    parts: int,
) -> Any:
    """:func:`portable_spec.build_chain_bitmask` through the compiled helper when every
    grammar is an xgrammar matcher it can call (already probed at the model's width, sharing
    stop tokens), the lists plain Python ints and ``out`` valid; ``None`` otherwise (nothing
    written, no matcher moved).

    One compiled call (``chain_masks``) checks the batch (declining while a ``wait=False`` build
    holds matchers), reads each matcher's facts from
    :data:`~portable_spec.engines.xgrammar.chain_facts`, allocates the outputs, packs, walks,
    repairs and counts: the Python around it is a few lines, which is what a call costs with
    cold caches. Batches of ``parts_from`` rows or more (0: never) come back packed and are
    walked in ``parts`` parts on the pool, the matchers held once for all of them.
    """
    ends, active = _NO_ENDS, None
    if reasoning is not None:
        if type(grammars) is not list and type(grammars) is not tuple:
            return None
        rule = _plain_reasoning(reasoning, len(grammars), vocab_size)
        if rule is None:
            return None
        active, ends = rule
    threshold = stats._threshold or -1.0  # the slow-walk warning's (seconds; -1: none)
    args = (rows_per_request, vocab_size, ends, active, out, return_valid, parts_from, threshold)
    done = compiled.chain_masks(grammars, drafts, *args)
    if done is None:  # not a common call, or numpy drafts the compiled call reads as lists
        lists = None if compiled.native is None else _as_lists(drafts)
        if lists is None:
            return None
        done = compiled.chain_masks(grammars, lists, *args)
        if done is None:
            return None
    mask, valid, failed, message, extra = done
    if failed >= 0:
        raise MatcherError(failed, RuntimeError(message))
    if failed == -2:  # packed: walked in parts on the pool
        _walk_parts(mask, valid, parts, *extra)
    elif extra:
        note_slow(extra)
    return (mask, valid) if return_valid else mask


def _as_lists(drafts: Any) -> list[Any] | None:
    """Integer numpy drafts (a ``[batch, K]`` array, or per-request 1-D arrays) as the lists
    the compiled call reads, or None when there is nothing to convert."""
    if type(drafts) is np.ndarray:
        if drafts.ndim == 2 and drafts.dtype.kind in "iu":
            return drafts.tolist()  # type: ignore[no-any-return]
        return None
    if type(drafts) not in (list, tuple) or not any(type(d) is np.ndarray for d in drafts):
        return None
    return [
        d.tolist() if type(d) is np.ndarray and d.ndim == 1 and d.dtype.kind in "iu" else d
        for d in drafts
    ]


def _walk_parts(
    mask: np.ndarray,
    valid: np.ndarray | None,
    parts: int,
    packed: tuple[bytes, bytes, bytes, int, list[Any]],
    limit: int,
    stops: bytes,
) -> None:
    """Walk the chains ``chain_masks`` packed (too many rows for one thread) in ``parts``
    parts on the pool, the matchers held once for all of them, and account the build.
    ``packed``: the tokens, the (first row, first token, nodes) of each chain, its request,
    the rows walked and its matcher."""
    began = perf_counter()
    tokens, table, owners, _walked, matchers = packed
    walks: list[tuple[int, float]] = []
    checked = rejected = 0
    if table:
        who = np.frombuffer(owners, dtype=np.int64).tolist()
        try:
            token, held = hold_matchers(matchers)
        except ValueError:  # another build took one after the compiled call packed them
            raise ValueError(
                "a matcher of this build is being walked by another build that has not "
                "finished (one started with wait=False, or one running on another thread)"
            ) from None
        try:
            checked, rejected, walks = jobs.walk_chain_table(
                mask,
                np.frombuffer(tokens, dtype=np.int64),
                np.frombuffer(table, dtype=np.int64).reshape(-1, 3),
                matchers,
                limit,
                np.frombuffer(stops, dtype=np.int64),
                None if valid is None else valid.reshape(-1),
                parts,
            )
        except MatcherError as exc:
            raise MatcherError(who[exc.request_index], exc.error) from exc.error
        finally:
            release_matchers(token, held)
        walks = [(who[c], t) for c, t in walks]
    record_build(
        walks,
        len(mask),
        walk_seconds=perf_counter() - began,
        checked_nodes=checked,
        rejected_nodes=rejected,
    )


def _plain_reasoning(reasoning: Any, batch: int, vocab_size: int) -> Any:
    """``(active list of bools, int64 end tokens)`` of a :class:`Reasoning` the compiled
    helper follows (no content end tokens, plain ints and bools), else ``None``."""
    if type(reasoning) is not Reasoning:
        return None
    content = reasoning.content_end_token_ids
    if type(content) not in (tuple, list, frozenset, set) or content:
        return None
    active = reasoning.active
    if type(active) is np.ndarray and active.dtype == np.bool_ and active.ndim == 1:
        active = active.tolist()
    elif type(active) is tuple:
        active = list(active)
    if type(active) is not list or len(active) != batch:
        return None
    ends = reasoning.end_token_ids
    if type(ends) is int:
        ends = (ends,)
    if type(ends) not in (tuple, list, frozenset, set) or not ends:
        return None
    if not all(type(t) is int for t in ends):  # bools and numpy ints: the general checks
        return None
    ids = frozenset(ends)
    array = _end_arrays.get(ids)
    if array is None:
        if not all(0 <= t < vocab_size for t in ids):
            return None
        array = np.array(sorted(ids), dtype=np.int64)
        if len(_end_arrays) < 64:
            _end_arrays[ids] = array
    elif int(array[-1]) >= vocab_size:
        return None
    return active, array
