"""Which of vLLM's grammar rows masks which logits row of a tpu-inference step (numpy only).

vLLM 0.32 writes ``1 + len(drafts)`` bitmask rows per structured request, back to back, in the
order of ``structured_output_request_ids`` (``-1`` draft padding counted as a draft): row ``j``
of a request is the grammar's mask after its first ``j`` drafts, so it constrains the token
that follows draft ``j``, the target of draft ``j + 1`` (or the bonus token when ``j`` is the
last). tpu-inference lays its logits out per data-parallel rank: rank ``r`` owns the rows
``r * block`` to ``(r + 1) * block``, its requests in batch order, each with ``1 + drafts``
consecutive rows (draft targets first, bonus last; one row without speculation), and padding
rows after the last request. :func:`map_rows` joins the two layouts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["RowMap", "map_rows"]


@dataclass(frozen=True)
class RowMap:
    """Where each logits row of a step takes its grammar row from.

    Attributes:
        index: int32 ``[num_logits]``: for each logits row, the row of the packed mask (the
            rows of the requests in this batch, in vLLM's order) that masks it, or
            ``num_logits`` for rows no grammar constrains (unconstrained requests, padding).
        spans: ``(first vLLM row, first packed row, rows)`` per run of rows to copy from
            vLLM's bitmask into the packed mask (one run when every structured request is in
            the batch).
        rows: how many packed rows the step uses (``<= num_logits``).
        skipped: structured request ids that are not in this batch (their rows are skipped).
    """

    index: np.ndarray
    spans: tuple[tuple[int, int, int], ...]
    rows: int
    skipped: tuple[str, ...]


def map_rows(
    structured_ids: Sequence[str],
    spec_tokens: Mapping[str, Sequence[int]],
    mask_rows: int,
    ranks: Sequence[Sequence[str]],
    drafts: Sequence[Sequence[int]] | None,
    num_logits: int,
) -> RowMap:
    """Join vLLM's packed grammar rows to tpu-inference's logits rows.

    Args:
        structured_ids: ``GrammarOutput.structured_output_request_ids`` (vLLM's row order).
        spec_tokens: ``SchedulerOutput.scheduled_spec_decode_tokens`` (request id -> the
            drafts vLLM built the rows for, ``-1`` padding included).
        mask_rows: rows of vLLM's ``grammar_bitmask``.
        ranks: per data-parallel rank, its request ids in logits order (tpu-inference's
            ``req_ids_dp``).
        drafts: per rank, tpu-inference's draft count of each of its requests (the spec-decode
            metadata's ``draft_lengths_cpu``, split by rank; entries past the rank's requests
            are padding), or None without speculative decoding (one row per request).
        num_logits: rows of the logits (a multiple of ``len(ranks)``).

    Returns:
        A :class:`RowMap`. Pure host work on small integer arrays; never blocks.

    Raises:
        ValueError: before anything is written, when the layouts disagree: vLLM's bitmask
            holds another number of rows than its requests' drafts claim, a request is listed
            twice, tpu-inference holds another number of rows for a request than vLLM wrote,
            or a rank's requests need more logits rows than its block has.
    """
    if len(set(structured_ids)) != len(structured_ids):
        raise ValueError("structured_output_request_ids lists a request twice")
    sizes = [1 + len(spec_tokens.get(req_id) or ()) for req_id in structured_ids]
    claimed = sum(sizes)
    if claimed != mask_rows:
        raise ValueError(
            f"vLLM's grammar bitmask has {mask_rows} rows, but its {len(sizes)} structured "
            f"requests' drafts claim {claimed} (1 + drafts each)"
        )
    if not ranks or num_logits % len(ranks):
        raise ValueError(f"{num_logits} logits rows do not split over {len(ranks)} ranks")
    block = num_logits // len(ranks)
    placed: dict[str, tuple[int, int]] = {}  # request id -> (first logits row, rows)
    for rank, ids in enumerate(ranks):
        n = len(ids)
        if not n:
            continue
        if drafts is None:
            counts = np.ones(n, dtype=np.int64)
        else:
            counts = np.asarray(drafts[rank][:n], dtype=np.int64) + 1
            if len(counts) != n:
                raise ValueError(f"rank {rank}: {n} requests but {len(counts)} draft counts")
        ends = np.cumsum(counts)
        if ends[-1] > block:
            raise ValueError(
                f"rank {rank}'s {n} requests need {int(ends[-1])} logits rows; its block has "
                f"{block}"
            )
        starts = rank * block + ends - counts
        placed.update(zip(ids, zip(starts.tolist(), counts.tolist(), strict=True), strict=True))
    firsts: list[int] = []  # per request kept: its first logits row
    lengths: list[int] = []  # per request kept: its rows
    spans: list[tuple[int, int, int]] = []
    skipped: list[str] = []
    source = packed = 0
    for req_id, size in zip(structured_ids, sizes, strict=True):
        where = placed.get(req_id)
        if where is None:
            skipped.append(req_id)
        else:
            first, held = where
            if held != size:
                raise ValueError(
                    f"request {req_id!r}: vLLM wrote {size} grammar rows (1 + {size - 1} "
                    f"drafts), tpu-inference's logits hold {held} rows for it"
                )
            firsts.append(first)
            lengths.append(size)
            if spans and spans[-1][0] + spans[-1][2] == source:
                start, at, count = spans[-1]
                spans[-1] = (start, at, count + size)
            else:
                spans.append((source, packed, size))
            packed += size
        source += size
    index = np.full(num_logits, num_logits, dtype=np.int32)
    if packed:
        counts = np.asarray(lengths, dtype=np.int64)
        # logits row of every packed row: its request's first row plus its position
        shift = np.asarray(firsts, dtype=np.int64) - (np.cumsum(counts) - counts)
        offset = np.repeat(shift, counts)
        index[offset + np.arange(packed)] = np.arange(packed, dtype=np.int32)
    return RowMap(index, tuple(spans), packed, tuple(skipped))
