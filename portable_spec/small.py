"""The most common small build in one function: a few short chains of plain xgrammar matchers.

:func:`build_host_bitmask` tries :func:`small_chains` first for ``from_linear_chain`` trees
without reasoning, dense layout. A batch-1 call in a serving engine starts with cold caches
(the model's forward pass evicts them between steps), so what it costs follows the number of
Python lines and numpy calls it runs: this path checks only what it must (and gives up on
anything unusual, ``None``: the general path then checks everything and raises what it must),
walks each request with xgrammar's C++ traversal and repairs its rows with the compiled helper,
on the calling thread.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.engines.xgrammar import xgrammar_info
from portable_spec.errors import MatcherError
from portable_spec.grammars import XGRAMMAR, _kind_by_type
from portable_spec.pending import pending_builds
from portable_spec.stats import record_build
from portable_spec.tree import GrammarTree

__all__ = ["SMALL_CHAIN_BATCH", "SMALL_CHAIN_NODES", "small_chains"]

# Up to this many chain requests, of up to this many nodes each, take this path.
SMALL_CHAIN_BATCH = 8
SMALL_CHAIN_NODES = 9


def small_chains(
    grammars: Any, tree: GrammarTree, vocab_size: Any, out: Any, return_valid: bool
) -> Any:
    """The most common small call in one function: a few ``from_linear_chain`` requests of
    plain xgrammar matchers already probed at the model's width, nothing pending, a valid
    ``out`` (or none). Walks and repairs each request on the calling thread like
    the builder's inline path, touching as little Python as possible (a batch-1 call is dominated
    by it when the caches are cold). Returns ``None`` whenever anything is unusual: the general
    path then checks everything and raises what it must."""
    native = compiled.native
    batch, nodes = tree.batch, tree.nodes
    if (
        native is None
        or type(grammars) is not list
        or len(grammars) != batch
        or not 0 < batch <= SMALL_CHAIN_BATCH
        or nodes > SMALL_CHAIN_NODES
        or type(vocab_size) is not int
        or vocab_size <= 0
        or pending_builds()
        or (return_valid and not getattr(native, "REPAIR_VALID", 0))
    ):
        return None
    words = (vocab_size + 31) >> 5
    infos = []
    for g in grammars:
        if _kind_by_type.get(type(g)) != XGRAMMAR:
            return None
        info = xgrammar_info(g)
        if info is None or info.words != words:
            return None
        infos.append(info)
    if batch > 1 and len({id(g) for g in grammars}) != batch:
        return None
    rows = batch * nodes
    if out is None:
        mask = np.empty((rows, words), dtype=np.int32)
    elif (
        type(out) is np.ndarray
        and out.dtype == np.int32
        and out.shape == (rows, words)
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        mask = out
    else:
        return None
    started = perf_counter()
    next_token, next_sibling, draft = tree.resolve()
    resolved = perf_counter()
    accepted = np.empty((batch, nodes), dtype=bool) if return_valid else None
    repair = native.repair_rows
    walks = []
    checked = rejected = 0
    began = resolved
    for b, matcher in enumerate(grammars):
        info = infos[b]
        block = mask[b * nodes : (b + 1) * nodes]
        nt, ns, dt = next_token[b], next_sibling[b], draft[b]
        limit = min(vocab_size, info.vocab_size)
        try:
            live = 0
            if not matcher.is_terminated():
                matcher.traverse_draft_tree(nt, ns, dt, block)
                live = 1
            if accepted is None:
                _, c, r = repair(block, nt, ns, dt, limit, info.stop_ids, live)
            else:
                _, c, r = repair(block, nt, ns, dt, limit, info.stop_ids, live, accepted[b])
        except BaseException as exc:
            raise MatcherError(b, exc) from exc
        checked += c
        rejected += r
        ended = perf_counter()
        walks.append((b, ended - began))
        began = ended
    record_build(
        walks,
        rows,
        wait_seconds=resolved - started,
        walk_seconds=perf_counter() - resolved,
        checked_nodes=checked,
        rejected_nodes=rejected,
    )
    return mask if accepted is None else (mask, accepted)
