"""The common small build of llguidance matchers in a few Python lines: a batch of host trees
or chains whose every request is an ``llguidance.LLMatcher`` the library has probed at the
model's width.

llguidance's masks and parser steps are its own Python methods (it exports C functions only
for its own C matcher type): the general build walks each request in a job of its own, and
its planning costs tens of microseconds per call. Here one compiled call
(:func:`portable_spec.native.llguidance_walks`) walks every request with the Python walk's
rules, the matchers' methods called from C, straight into the mask: rows it does not fill
all-allowed, the counts and the valid flags written on the way. Anything unusual returns
``None`` (nothing written, no matcher moved): the general build then checks everything and
raises what it must.
"""

from __future__ import annotations

import sys
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec import stats
from portable_spec.builder import jobs
from portable_spec.builder.small import host_rows
from portable_spec.engines.llguidance import held_facts, llguidance_info
from portable_spec.errors import MatcherError
from portable_spec.grammars import LLGUIDANCE, _kind_by_type
from portable_spec.pending import hold_matchers, release_matchers
from portable_spec.stats import note_slow
from portable_spec.tree import GrammarTree

__all__ = ["in_place"]


def _matcher_type() -> Any:
    """``llguidance.LLMatcher`` (imported by whoever made the matchers), or None."""
    module = sys.modules.get("llguidance")
    return getattr(module, "LLMatcher", None)


def in_place(
    grammars: Any, tree: GrammarTree, vocab_size: Any, out: Any, return_valid: bool
) -> Any:
    """What :func:`portable_spec.build_host_bitmask` returns for a host tree (or chain) of
    llguidance matchers only (``grammars`` a list or tuple), each probed at the width of
    ``vocab_size`` and not in its error state, the batch under the pool's threshold, ``out``
    None or a fitting int32 array; ``None`` otherwise, and when another build walks one of
    the matchers or the links are malformed (the general build then says why). Blocks until
    every row is written; every matcher ends where it started; a matcher that raises is
    named by a :class:`portable_spec.MatcherError`."""
    arrays = tree._inplace
    if arrays is not None and (len(arrays) == 3 or arrays[1] is None):
        # host trees, or chains one per row: read in place, every check in the compiled call
        links = arrays if len(arrays) == 3 else (None, None, arrays[0])
        done = compiled.llguidance_masks(
            grammars, links[0], links[1], links[2], vocab_size, out, return_valid,
            _matcher_type(), held_facts(), stats._threshold or -1.0,
        )  # fmt: skip
        if done is not None:
            mask, valid, failed, error, slow = done
            if failed >= 0:
                raise MatcherError(failed, error) from error
            if slow:
                note_slow(slow)
            return (mask, valid) if return_valid else mask
    batch = tree.batch
    if (
        compiled.native is None
        or type(grammars) not in (list, tuple)
        or len(grammars) != batch
        or batch == 0
        or tree.rows >= jobs.CHAIN_TABLE_PARALLEL_ROWS
        or type(vocab_size) is not int
        or vocab_size <= 0
    ):
        return None
    words = (vocab_size + 31) >> 5
    bounds = []  # each request's tokens bounded by its tokenizer's vocabulary
    for g in grammars:
        if _kind_by_type.get(type(g)) != LLGUIDANCE:
            return None
        info = llguidance_info(g)
        if info is None or info.words != words or g.is_error():
            return None
        bounds.append(min(vocab_size, info.vocab_size))
    if batch > 1 and len({id(g) for g in grammars}) != batch:
        return None
    rows = tree.rows
    mask = host_rows(out, rows, words)
    if mask is None:
        return None
    started = perf_counter()
    next_token, next_sibling, draft = tree.resolve()
    resolved = perf_counter()
    chain = tree._chain or tree._packed
    if not chain and not compiled.links_valid(next_token, next_sibling):
        return None
    width = draft.shape[1]
    if tree._packed:
        table = [(row, b * width, n) for b, (row, n) in enumerate(tree.spans())]
    else:
        table = [(b * width, b * width, width) for b in range(batch)]
    spans = np.array(table, dtype=np.int64)
    counts = np.zeros((batch, 2), dtype=np.int64)
    accepted = np.zeros(rows, dtype=bool) if return_valid else None
    links = (None, None) if chain else (next_token.reshape(-1), next_sibling.reshape(-1))
    matchers = list(grammars)
    try:
        token, held = hold_matchers(matchers)
    except ValueError:  # another build walks one of them: the general build says which
        return None
    try:
        began = perf_counter()
        failed, error = compiled.llguidance_walks(
            mask, links[0], links[1], draft.reshape(-1), spans, matchers,
            np.array(bounds, dtype=np.int64), chain, counts, None, accepted,
        )  # fmt: skip
        seconds = perf_counter() - began
    finally:
        release_matchers(token, held)
    if failed >= 0:
        raise MatcherError(failed, error) from error
    checked, rejected = (int(v) for v in counts.sum(axis=0))
    return jobs.settle(tree, (started, resolved), mask, accepted, [(0, seconds)], checked, rejected)
