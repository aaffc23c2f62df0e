"""The workload every timing part shares: a synthetic 131072-token vocabulary, the sample JSON
schema and EAGLE-like trees (``portable_spec.bench.workloads``), and real masks built from it."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_spec.bench.apply import build_wide_mask
from portable_spec.bench.workloads import RequestPool, Setup, make_pool

__all__ = ["describe", "json_pool", "tiled_mask"]

GRAMMAR = "json_schema"


def json_pool(setup: Setup, nodes: int, batch: int, *, shape: str = "tree") -> RequestPool:
    """Distinct JSON-schema requests for batches of up to ``batch`` (a quarter more, so that
    each round draws a different batch)."""
    return make_pool(setup, GRAMMAR, shape, nodes, max(16, batch + batch // 4))


def tiled_mask(pool: RequestPool, vocab: int, rows: int) -> np.ndarray:
    """A real ``[rows, ceil(vocab / 32)]`` int32 mask: the library's mask of a batch of the
    pool, repeated down to ``rows`` rows."""
    nodes = pool.next_token.shape[1]
    base_rows = min(rows - rows % nodes or nodes, pool.size * nodes)
    base = build_wide_mask(pool, base_rows, vocab)
    reps = -(-rows // base_rows)
    return np.ascontiguousarray(np.tile(base, (reps, 1))[:rows])


def describe(setup: Setup, pool: RequestPool) -> dict[str, Any]:
    """The workload in words and numbers, for the report."""
    return {
        "vocabulary": f"synthetic, {setup.vocab_size} raw tokens",
        "grammar": GRAMMAR,
        "tree": f"EAGLE-like, {pool.next_token.shape[1]} nodes, topk 4",
        "accepted_nodes_per_request": float(pool.accepted.mean()),
        "mask_words": setup.words,
    }
