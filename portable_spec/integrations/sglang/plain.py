"""The replacement of sglang's plain batch fill, ``BaseGrammarObject.fill_vocab_mask_batched``.

sglang fills one row per request at every step with a grammar request, speculative or not
(the prefill of a speculative run, every step of plain decoding): for xgrammar a serial loop
of ``fill_vocab_mask``. The library fills the rows of xgrammar grammars over its thread pool
(one root-only tree per request, written in place into sglang's buffer); every other entry
(llguidance's, which sglang fills with llguidance's own parallel fill; outlines'; a reasoner
filtering its reasoning; a terminated matcher) is filled by sglang's own loop. Rows not
listed are left untouched, as sglang's contract says. Shadow mode fills both and compares.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec.integrations.sglang import internals
from portable_spec.integrations.sglang.internals import REASONER, XGRAMMAR, logger
from portable_spec.integrations.sglang.masks import STATS, Active

__all__ = ["MIN_ROWS", "fill_replacement"]

#: below this many xgrammar rows sglang's own loop fills them (one row is as fast that way)
MIN_ROWS = 2

_roots: dict[int, ps.GrammarTree] = {}


def fill_replacement(original: Any) -> Any:
    """``fill_vocab_mask_batched`` through the library (``original``: sglang's own)."""

    def fill_vocab_mask_batched(entries: Any, vocab_mask: Any) -> None:
        _fill(original, entries, vocab_mask)

    return fill_vocab_mask_batched


def _fill(original: Any, entries: Any, vocab_mask: Any) -> None:
    STATS.add("fills")
    if len(entries) < MIN_ROWS or not _plain_buffer(vocab_mask):
        original(entries, vocab_mask)
        return
    words = vocab_mask.shape[1]
    rows: list[int] = []
    matchers: list[Any] = []
    rest = []
    vocab_size = 0
    for entry in entries:
        matcher, size = _xgrammar_matcher(entry.grammar)
        if matcher is None or (size + 31) // 32 != words:
            if matcher is not _SKIP:
                rest.append(entry)
            continue
        rows.append(entry.row)
        matchers.append(matcher)
        vocab_size = max(vocab_size, size)
    if len(matchers) < MIN_ROWS:
        original(entries, vocab_mask)
        return
    if rest:
        original(rest, vocab_mask)
    started = time.perf_counter()
    host = vocab_mask.numpy()
    if Active.mode == "shadow":
        mine = ps.build_host_bitmask(matchers, _root_tree(len(matchers)), vocab_size)
        original([e for e in entries if e not in rest], vocab_mask)
        _compare(host[rows], mine)
        return
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        ps.build_host_bitmask(
            matchers, _root_tree(len(rows)), vocab_size, out=host[first : first + len(rows)]
        )
    else:
        host[rows] = ps.build_host_bitmask(matchers, _root_tree(len(rows)), vocab_size)
    STATS.time("portable_spec_fill", len(rows), time.perf_counter() - started)
    STATS.add("fills_built")


_SKIP = object()  # an entry whose row sglang leaves as it is (a reasoner still reasoning)


def _xgrammar_matcher(grammar: Any) -> tuple[Any, int]:
    """The matcher of an xgrammar grammar whose row is its matcher's mask, with its
    vocabulary; ``(_SKIP, 0)`` for a grammar whose fill writes nothing; ``(None, 0)`` else."""
    kind = internals.kind_of(grammar)
    if kind == REASONER:
        parts = internals.reasoner_parts(grammar)
        if parts["thinking"] and parts["token_filter"]:
            return None, 0
        if parts["grammar_covers_reasoning"] or parts["answering"]:
            grammar = parts["inner"]
            if grammar is None:
                return _SKIP, 0
            kind = internals.kind_of(grammar)
        elif parts["thinking"]:
            return _SKIP, 0
        else:
            return None, 0
    if kind != XGRAMMAR:
        return None, 0
    matcher = internals.xgrammar_matcher(grammar)
    if matcher.is_terminated():
        return None, 0
    return matcher, internals.xgrammar_vocab_size(grammar)


def _plain_buffer(vocab_mask: Any) -> bool:
    import torch

    return (
        isinstance(vocab_mask, torch.Tensor)
        and vocab_mask.device.type == "cpu"
        and vocab_mask.dtype == torch.int32
        and vocab_mask.dim() == 2
        and vocab_mask.is_contiguous()
    )


def _root_tree(batch: int) -> ps.GrammarTree:
    tree = _roots.get(batch)
    if tree is None:
        links = np.full((batch, 1), -1, dtype=np.int64)
        tree = ps.GrammarTree.from_host(links, links, np.zeros((batch, 1), dtype=np.int64))
        if len(_roots) > 256:
            _roots.clear()
        _roots[batch] = tree
    return tree


def _compare(own: np.ndarray, mine: np.ndarray) -> None:
    differing = np.flatnonzero((own != mine).any(axis=1))
    STATS.add("rows_compared", own.shape[0])
    if len(differing):
        STATS.add("rows_differing", len(differing))
        logger.warning(
            "portable_spec shadow: %d of %d plain-fill rows differ from sglang's",
            len(differing),
            own.shape[0],
        )
