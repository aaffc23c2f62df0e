"""The workload every timing part shares: a synthetic 131072-token vocabulary, the sample JSON
schema and EAGLE-like trees (``tools.bench.workloads``), and real masks built from it."""

from __future__ import annotations

from typing import Any

import numpy as np

from tools.bench.apply import build_wide_mask
from tools.bench.workloads import RequestPool, Setup, make_pool

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


def staging_timings(
    rec: Any, profile: Any, pool: Any, framework: str, dtype: str, plain: str
) -> None:
    """Time ``from_device`` + ``resolve()`` against a plain blocking read of the same tree
    arrays (``plain``: how that read is named in the check), for every staging batch of the
    profile; record one entry per batch in ``rec``'s ``staging`` section."""
    from tools.bench.staging import device_tree, tree_methods
    from tools.bench.timing import median, run_rounds

    for batch in profile.staging_batches:

        def inputs(_r: int, batch: int = batch) -> Any:
            sample = pool.sample(batch)
            arrays = (sample.next_token, sample.next_sibling, sample.draft_tokens)
            return device_tree(framework, arrays)

        agree: list[bool] = []

        def on_warmup(_data: Any, results: dict[str, Any], agree: list[bool] = agree) -> None:
            ours, theirs = results["from_device+resolve"], results["plain"]
            agree.append(all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)))

        seconds, _ = run_rounds(tree_methods(framework), inputs, profile.plan, on_warmup=on_warmup)
        med = {k: median(v) for k, v in seconds.items()}
        rec.check("staging", f"resolve() equals {plain} (bs {batch})", all(agree))
        rec.add(
            "staging",
            {
                "framework": framework,
                "batch": batch,
                "nodes": profile.nodes,
                "dtype": dtype,
                "rounds": len(seconds["plain"]),
                "seconds": med,
                "plain_over_resolve": med["plain"] / med["from_device+resolve"],
            },
        )
