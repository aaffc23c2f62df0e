"""The replacement of sglang's plain batch fill, ``BaseGrammarObject.fill_vocab_mask_batched``.

sglang fills one row per request at every step with a grammar request, speculative or not
(the prefill of a speculative run, every step of plain decoding): for xgrammar a serial loop
of ``fill_vocab_mask``, a Python call and xgrammar's argument checks per row. The plugin fills
the rows of xgrammar grammars in one call of xgrammar's own batched fill
(``xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask``, the GIL released), in place
in sglang's buffer, on one thread below the library's one-thread threshold
(:data:`portable_spec.builder.routes.ONE_THREAD_WORK`: waking a second core costs more than
it saves at these sizes) and on the library's threads above it. Every other entry
(llguidance's, which sglang fills with llguidance's own parallel fill; outlines'; a reasoner
filtering its reasoning; a terminated matcher) is filled by sglang's own loop, and so is a
fill with fewer than :data:`MIN_ROWS` xgrammar rows. Rows not listed are left untouched, as
sglang's contract says. Shadow mode fills both and compares.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from portable_spec.builder.routes import parts_for
from portable_spec.integrations.sglang import internals
from portable_spec.integrations.sglang.internals import REASONER, XGRAMMAR, logger
from portable_spec.integrations.sglang.state import INTEGRATION, STATS

__all__ = ["MIN_ROWS", "fill_replacement"]

#: below this many entries sglang's own loop fills them: xgrammar's batched call saves about
#: half a microsecond a row, which below this does not pay for sorting the entries (2 cores,
#: SmolLM2's 49k vocabulary, the JSON schema: 0.9x at 4 to 16 rows, 1.0x from 32)
MIN_ROWS = 32

#: xgrammar's batch fillers by thread count (each used under its lock: one fill at a time)
_fillers: dict[int, tuple[Any, threading.Lock]] = {}


def fill_replacement(original: Any) -> Any:
    """``fill_vocab_mask_batched`` with xgrammar rows in one batched call (``original``: sglang's
    own)."""

    def fill_vocab_mask_batched(entries: Any, vocab_mask: Any) -> None:
        if len(entries) < MIN_ROWS:  # sglang's own call, at once (nothing counted)
            original(entries, vocab_mask)
            return
        _fill(original, entries, vocab_mask)

    return fill_vocab_mask_batched


def _fill(original: Any, entries: Any, vocab_mask: Any) -> None:
    STATS.add("fills")
    if not _plain_buffer(vocab_mask):
        original(entries, vocab_mask)
        return
    words = vocab_mask.shape[1]
    rows, matchers, others = internals.xgrammar_rows(entries, words)
    rest = []
    for entry in others:  # reasoners (their inner grammar), and the entries sglang fills
        matcher, size = _xgrammar_matcher(entry.grammar)
        if matcher is None or (size + 31) // 32 != words:
            if matcher is not _SKIP:
                rest.append(entry)
            continue
        rows.append(entry.row)
        matchers.append(matcher)
    if len(matchers) < MIN_ROWS:
        original(entries, vocab_mask)
        return
    if rest:
        original(rest, vocab_mask)
    mine = (
        [e for e in entries if e not in rest] if rest or INTEGRATION.mode == "shadow" else entries
    )
    if INTEGRATION.mode == "shadow":
        original(mine, vocab_mask)  # sglang's rows, the ones used (its errors its own)
        ours = vocab_mask[rows].clone()
        _batch_fill(original, mine, matchers, ours, None, words)
        _compare(vocab_mask[rows].numpy(), ours.numpy())
        return
    _batch_fill(original, mine, matchers, vocab_mask, rows, words)
    STATS.add("fills_built")


def _batch_fill(
    original: Any,
    entries: Any,
    matchers: list[Any],
    mask: Any,
    rows: list[int] | None,
    words: int,
) -> None:
    """xgrammar's batched fill of ``matchers``' rows (``rows``; None: ``0..len-1``) of the
    int32 CPU tensor ``mask``; blocks until written. Where xgrammar refuses (a terminated
    matcher, which sglang's caller leaves out), sglang's own loop fills ``entries`` (the same
    rows): its rows, or its error."""
    threads = parts_for(len(matchers), words)
    filler = _fillers.get(threads)
    if filler is None:
        import xgrammar

        made = (xgrammar.BatchGrammarMatcher(threads), threading.Lock())
        filler = _fillers.setdefault(threads, made)
    batch, lock = filler
    try:
        with lock:
            batch.batch_fill_next_token_bitmask(matchers, mask, rows)
    except RuntimeError:
        if rows is None:  # shadow mode: sglang's own loop has just filled these rows
            raise
        original(entries, mask)


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
        and vocab_mask.is_cpu
        and vocab_mask.dtype == torch.int32
        and vocab_mask.dim() == 2
        and vocab_mask.is_contiguous()
    )


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
