"""Section ``forced``: what ``forced_drafts`` costs next to the verify mask build of the same
step, batch 1 to 64.

Workload: the two schema workloads (``portable_spec.testing.SCHEMA_WORKLOADS``: an invoice, a
tool call) compiled by xgrammar as vLLM compiles JSON schemas (any whitespace), on SmolLM2's
vocabulary and tokenizer (``hf_tokenizer``: the model's own segmentation). A pool of requests,
each a matcher advanced to a random position of a valid output (``SCHEMA_EXAMPLES``, the
tokenizer's tokens of it): half propose no drafts (a drafter that found nothing), half the
output's next ``K`` tokens with one refused token in the middle (a drafter that drifted).
Every round draws a random batch of distinct requests.

``forced_drafts``
    ``ps.forced_drafts(matchers, proposals, K, tokenizer=tok)``: the accepted prefix of the
    proposals, then the forced continuation (the warm-up round fills the tokenizer's cache of
    forced texts, as the first steps of a serving engine do).
``verify_build``
    The verify mask of the step these drafts go to: ``ps.build_chain_bitmask`` over the
    drafts ``forced_drafts`` returned, ``K + 1`` rows per request, into a reused buffer.
``serial_fill``
    vLLM's own fill of the same rows (``chains.serial_fill``: fill, accept, ... roll back).

Each timed call starts from cold caches (as after a forward pass). Reported: medians and the
share of the build each costs (``forced / build``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tools.bench.chains import ChainBatch, serial_fill
from tools.bench.timing import (
    Method,
    QuietPolicy,
    RoundPlan,
    cache_evictor,
    measure_quietly,
    median,
    run_rounds,
    usable_cores,
)

__all__ = ["FORCED_METHODS", "ForcedPool", "forced_pool", "run_forced_section"]

FORCED_METHODS = ("forced_drafts", "verify_build", "serial_fill")
VOCAB = 49152


@dataclass
class ForcedPool:
    """Requests at random positions of the schema workloads' outputs."""

    k: int
    matchers: list[Any]
    proposals: list[list[int]]
    tokenizer: Any
    rng: np.random.Generator

    def sample(self, batch: int) -> tuple[list[Any], list[list[int]]]:
        index = self.rng.choice(len(self.matchers), size=batch, replace=False)
        return [self.matchers[i] for i in index], [self.proposals[i] for i in index]


def forced_pool(k: int, size: int, *, seed: int = 0) -> ForcedPool:
    """``size`` requests (see the module's docstring), ``k`` drafts at most per request."""
    import xgrammar as xgr

    from portable_spec import testing as T

    tok = T.hf_tokenizer()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB))
    rng = np.random.default_rng([seed, k, 45])
    outputs = {}
    for name, (schema, _prompt) in T.SCHEMA_WORKLOADS.items():
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        ids = tok.encode(json.dumps(T.SCHEMA_EXAMPLES[name]), add_special_tokens=False)
        outputs[name] = (compiled, ids)
    names = sorted(outputs)
    matchers, proposals = [], []
    for i in range(size):
        compiled, ids = outputs[names[i % len(names)]]
        at = int(rng.integers(0, len(ids)))
        matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=k)
        for t in ids[:at]:
            assert matcher.accept_token(t)
        ahead = list(ids[at : at + k])
        if i % 4 >= 2 and ahead:  # a drafter that drifted: a refused token in the middle
            ahead[len(ahead) // 2] = VOCAB + 7
            proposals.append(ahead)
        else:
            proposals.append([])
        matchers.append(matcher)
    return ForcedPool(k, matchers, proposals, tok, rng)


def _methods(pool: ForcedPool, out: np.ndarray, bitmask: Any) -> list[Method[Any]]:
    import portable_spec as ps

    k, tok = pool.k, pool.tokenizer
    evict = cache_evictor()

    def cold(prepare: Callable[[Any], Callable[[], Any]]) -> Callable[[Any], Callable[[], Any]]:
        def prepared(data: Any) -> Callable[[], Any]:
            call = prepare(data)
            evict()
            return call

        return prepared

    def forced(data: Any) -> Callable[[], Any]:
        matchers, proposals, _drafts = data
        return lambda: ps.forced_drafts(matchers, proposals, k, tokenizer=tok)

    def build(data: Any) -> Callable[[], Any]:
        matchers, _proposals, drafts = data
        rows = len(matchers) * (k + 1)
        return lambda: ps.build_chain_bitmask(
            matchers, drafts, VOCAB, rows_per_request=k + 1, out=out[:rows]
        )

    def serial(data: Any) -> Callable[[], Any]:
        matchers, _proposals, drafts = data
        scheduled = [d + [-1] * (k - len(d)) for d in drafts]
        batch = ChainBatch(matchers, drafts, scheduled, [False] * len(matchers), 0)
        return lambda: serial_fill(batch, bitmask, k, frozenset())

    return [
        Method("forced_drafts", cold(forced)),
        Method("verify_build", cold(build)),
        Method("serial_fill", cold(serial)),
    ]


def run_forced_config(pool: ForcedPool, batch: int, plan: RoundPlan) -> dict[str, Any]:
    """Time the three methods at one batch size; return its record."""
    import xgrammar as xgr

    import portable_spec as ps

    k = pool.k
    out = np.full((batch * (k + 1), VOCAB // 32), -1, dtype=np.int32)
    bitmask = xgr.allocate_token_bitmask(batch * (k + 1), VOCAB)
    methods = _methods(pool, out, bitmask)
    check: dict[str, Any] = {}

    def inputs(_round: int) -> Any:
        matchers, proposals = pool.sample(batch)
        drafts = ps.forced_drafts(matchers, proposals, k, tokenizer=pool.tokenizer)
        return matchers, proposals, drafts

    def on_warmup(data: Any, results: dict[str, Any]) -> None:
        check["drafts_identical"] = results["forced_drafts"] == data[2]
        theirs = results["serial_fill"].numpy()
        check["rows_identical"] = bool(np.array_equal(results["verify_build"], theirs))

    for matchers, proposals in (pool.sample(len(pool.matchers)),):  # the cache, once
        ps.forced_drafts(matchers, proposals, k, tokenizer=pool.tokenizer)
    seconds, rounds = run_rounds(methods, inputs, plan, on_warmup=on_warmup)
    med = {name: median(ts) for name, ts in seconds.items()}
    drafted = median([sum(map(len, r[2])) / batch for r in rounds])
    return {
        "k": k,
        "batch": batch,
        "rounds": len(rounds),
        "cores": usable_cores(),
        "drafts_per_request": drafted,
        "seconds": med,
        "share": {
            "of_build": med["forced_drafts"] / med["verify_build"],
            "of_serial_fill": med["forced_drafts"] / med["serial_fill"],
        },
        **check,
    }


def run_forced_section(
    drafts: Sequence[int],
    batches: Sequence[int],
    plan: RoundPlan,
    *,
    seed: int = 0,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every ``(K, batch)``; one pool per ``K`` (a quarter more requests than the largest
    batch)."""
    policy = policy or QuietPolicy()
    size = max(16, max(batches) + max(batches) // 4)
    records = []
    for k in drafts:
        pool = forced_pool(k, size, seed=seed)
        for batch in batches:
            measure = functools.partial(run_forced_config, pool, batch, plan)
            record, busy = measure_quietly(measure, policy)
            record["other_busy_cores"] = busy
            records.append(record)
        if advance is not None:
            advance(f"forced K={k}")
    return records


def forced_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per ``(K, batch)``: medians (µs) and what forced drafting costs next to the
    verify mask's build."""
    if not records:
        return ""
    header = [
        "K",
        "batch",
        "drafts/request",
        "forced_drafts µs",
        "verify build µs",
        "vLLM serial fill µs",
        "forced / build",
        "forced / serial fill",
        "check",
        "bg",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        s, share = r["seconds"], r["share"]
        ok = r.get("drafts_identical") and r.get("rows_identical")
        bg = r.get("other_busy_cores")
        cells = [
            str(r["k"]),
            str(r["batch"]),
            f"{r['drafts_per_request']:.1f}",
            f"{1e6 * s['forced_drafts']:.0f}",
            f"{1e6 * s['verify_build']:.0f}",
            f"{1e6 * s['serial_fill']:.0f}",
            f"{share['of_build']:.2f}",
            f"{share['of_serial_fill']:.2f}",
            "ok" if ok else "MISMATCH",
            "-" if bg is None else f"{bg:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
