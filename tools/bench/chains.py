"""Section ``chains``: the vLLM-style chain fill (K drafts + 1 bonus row per request) against
a loop like vLLM's serial per-token fill, with reasoning on part of the batch.

Workload (SmolLM2's vocabulary, the sample JSON schema): a pool of requests, some in the
answer (their matcher advanced by a random valid prefix, ``K`` chain drafts that mostly follow
the grammar) and a share (``--chain-reasoning``: none, and half, by default) still reasoning
(their matcher at the grammar's start; free-text drafts, and in half of them the reasoning's
end token at a random draft position followed by drafts that follow the grammar from its
start). ``<|im_start|>`` stands for ``</think>``. Every round draws a random batch from the
pool.

``portable_spec``
    A strided chain build (vLLM 0.33's layout, docs/porting/chains.md):
    ``build_chain_bitmask(matchers, drafts, vocab_size, rows_per_request=K + 1, out=buffer,
    reasoning=..., return_valid=True)`` on the per-request draft lists as the drafter wrote
    them, ``Reasoning`` for the requests still reasoning.
``serial_fill``
    vLLM's fill, request after request, on a torch int32 buffer from
    ``xgrammar.allocate_token_bitmask`` (what vLLM allocates): for each position fill the row
    (or the all-allowed row while reasoning, after padding, a refused draft or the end
    token), accept the draft, ... then roll back. Requests in the answer get their drafts
    validated beforehand (untimed, as vLLM's scheduler does it in an earlier pass: a refused
    draft and the rest become ``-1``); reasoning requests get them as written, the end token
    found by a scan. vLLM's grammar-wrapper bookkeeping is left out (a lower bound of its
    cost).
``validate_fill``
    The same plus the validation pass timed (accept the drafts up to the first refused one,
    roll back), which the build's ``return_valid`` replaces.

Every timed call starts from cold caches (a 32 MiB buffer is written untimed right before
it, as an engine's forward pass does between two steps): without it the two serial fills,
which share their code, warm each other up while the build, timed between them, runs cold.

The warm-up round checks that ``portable_spec``'s rows equal ``serial_fill``'s bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
from tools.bench.workloads import Setup, allowed_tokens, make_pool

__all__ = ["CHAIN_METHODS", "ChainBatch", "ChainPool", "chain_pool", "run_chains_section"]

CHAIN_METHODS = ("portable_spec", "serial_fill", "validate_fill")
END_TOKEN = 1  # SmolLM2's <|im_start|>: stands for the reasoning's end token (</think>)
KIND = "json_schema"


@dataclass
class ChainBatch:
    """One round's batch: per request its matcher, its drafts as written (``K`` each), the
    drafts vLLM would schedule (validated and ``-1``-padded; as written while reasoning) and
    whether it is still reasoning."""

    matchers: list[Any]
    drafts: list[list[int]]
    scheduled: list[list[int]]
    reasoning: list[bool]
    ends_in_window: int

    @property
    def size(self) -> int:
        """Requests in the batch."""
        return len(self.matchers)


@dataclass
class ChainPool:
    """Distinct requests for one ``K``: answer requests first, then reasoning ones."""

    k: int
    reasoning_share: float
    matchers: list[Any]
    drafts: list[list[int]]
    scheduled: list[list[int]]
    reasoning: list[bool]
    ends: list[bool]
    rng: np.random.Generator

    def sample(self, batch: int) -> ChainBatch:
        """A random batch of distinct requests."""
        index = self.rng.choice(len(self.matchers), size=batch, replace=False)
        return ChainBatch(
            matchers=[self.matchers[i] for i in index],
            drafts=[self.drafts[i] for i in index],
            scheduled=[self.scheduled[i] for i in index],
            reasoning=[self.reasoning[i] for i in index],
            ends_in_window=sum(self.ends[i] for i in index),
        )


def validate(matcher: Any, drafts: Sequence[int]) -> int:
    """How many leading drafts the matcher accepts (stopping after a token that terminates
    it); the matcher is rolled back."""
    kept = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(int(token)):
            break
        kept += 1
    if kept:
        matcher.rollback(kept)
    return kept


def _reasoning_drafts(
    setup: Setup, matcher: Any, k: int, rng: np.random.Generator, on_grammar: float
) -> tuple[list[int], bool]:
    """Drafts of a request still reasoning: free text, and with probability 1/2 the end token
    at a random position followed by drafts drawn from the grammar's start. The matcher (at
    the grammar's start) is rolled back."""
    ends = bool(rng.random() < 0.5)
    at = int(rng.integers(0, k)) if ends else k
    drafts = [int(t) for t in rng.integers(END_TOKEN + 2, setup.vocab_size, size=at)]
    if not ends:
        return drafts, False
    drafts.append(END_TOKEN)
    advanced = 0
    while len(drafts) < k:
        options = allowed_tokens(matcher, setup.words, setup.vocab_size)
        if len(options) and rng.random() < on_grammar and not matcher.is_terminated():
            token = int(options[int(rng.integers(len(options)))])
        else:
            token = int(rng.integers(END_TOKEN + 2, setup.vocab_size))
        drafts.append(token)
        if not matcher.is_terminated() and matcher.accept_token(token):
            advanced += 1
    if advanced:
        matcher.rollback(advanced)
    return drafts, True


def chain_pool(
    setup: Setup,
    k: int,
    size: int,
    *,
    reasoning_share: float = 0.5,
    on_grammar: float = 0.85,
    seed: int = 0,
) -> ChainPool:
    """``size`` requests with ``k`` drafts each: ``round(size * reasoning_share)`` still
    reasoning, the others in the answer (drawn by
    :func:`~tools.bench.workloads.make_pool`)."""
    import xgrammar as xgr

    thinking = round(size * reasoning_share)
    answer = size - thinking
    pool = make_pool(setup, KIND, "chain", k + 1, answer, on_grammar=on_grammar, seed=seed)
    matchers = list(pool.matchers)
    drafts = [[int(t) for t in row[1:]] for row in pool.draft_tokens]
    scheduled = []
    for matcher, row in zip(matchers, drafts, strict=True):
        kept = validate(matcher, row)
        scheduled.append(row[:kept] + [-1] * (k - kept))
    reasoning = [False] * answer
    ends = [False] * answer
    rng = np.random.default_rng([seed, k, 101])
    compiled = setup.compiled[KIND]
    for _ in range(thinking):
        matcher = xgr.GrammarMatcher(compiled)
        row, ended = _reasoning_drafts(setup, matcher, k, rng, on_grammar)
        matchers.append(matcher)
        drafts.append(row)
        scheduled.append(list(row))  # vLLM does not validate a request still reasoning
        reasoning.append(True)
        ends.append(ended)
    return ChainPool(k, reasoning_share, matchers, drafts, scheduled, reasoning, ends, rng)


def serial_fill(batch: ChainBatch, bitmask: Any, k: int, end_ids: frozenset[int]) -> Any:
    """vLLM-style serial fill of ``batch`` into ``bitmask`` (a torch int32 ``[rows, words]``
    tensor): per request, per position, fill or write the all-allowed row, accept the draft;
    roll back at the end."""
    row = 0
    for matcher, drafts, reasoning in zip(
        batch.matchers, batch.scheduled, batch.reasoning, strict=True
    ):
        start = 0
        if reasoning:  # the grammar starts after the end token, if any
            start = k + 1
            for j, token in enumerate(drafts):
                if token in end_ids:
                    start = j + 1
                    break
        advanced = 0
        stopped = False  # padding, a refused draft
        for i in range(k + 1):
            if stopped or i < start or matcher.is_terminated():
                bitmask[row + i].fill_(-1)
            else:
                matcher.fill_next_token_bitmask(bitmask, row + i)
            if i == k:
                break
            token = drafts[i]
            if token < 0:
                stopped = True
            elif i >= start and not stopped and not matcher.is_terminated():
                if matcher.accept_token(token):
                    advanced += 1
                else:
                    stopped = True
        if advanced:
            matcher.rollback(advanced)
        row += k + 1
    return bitmask


def chain_methods(setup: Setup, k: int, out: np.ndarray, bitmask: Any) -> list[Method[ChainBatch]]:
    """The competitors of :data:`CHAIN_METHODS`, in that order; ``portable_spec`` writes into
    ``out`` (numpy), the serial fills into ``bitmask`` (torch), both ``[batch * (k + 1),
    words]``."""
    import portable_spec as ps

    vocab_size = setup.vocab_size
    end_ids = frozenset({END_TOKEN})
    evict = cache_evictor()

    def cold(prepare: Callable[[ChainBatch], Callable[[], Any]]) -> Callable[..., Any]:
        def prepared(batch: ChainBatch) -> Callable[[], Any]:
            call = prepare(batch)
            evict()
            return call

        return prepared

    def ours(batch: ChainBatch) -> Callable[[], Any]:
        matchers, drafts, reasoning = batch.matchers, batch.drafts, batch.reasoning
        rows = batch.size * (k + 1)

        def call() -> Any:
            # the draft lists as the drafter wrote them: no padded array, no tree
            rule = ps.Reasoning(reasoning, [END_TOKEN]) if any(reasoning) else None
            mask, _valid = ps.build_chain_bitmask(
                matchers, drafts, vocab_size, rows_per_request=k + 1, out=out[:rows],
                reasoning=rule, return_valid=True,
            )  # fmt: skip
            return mask

        return call

    def serial(batch: ChainBatch) -> Callable[[], Any]:
        return lambda: serial_fill(batch, bitmask, k, end_ids)

    def validated(batch: ChainBatch) -> Callable[[], Any]:
        answer = [
            (m, d) for m, d, r in zip(batch.matchers, batch.drafts, batch.reasoning, strict=True)
            if not r
        ]  # fmt: skip

        def call() -> Any:
            for matcher, drafts in answer:
                validate(matcher, drafts)
            return serial_fill(batch, bitmask, k, end_ids)

        return call

    return [
        Method("portable_spec", cold(ours)),
        Method("serial_fill", cold(serial)),
        Method("validate_fill", cold(validated)),
    ]


def run_chain_config(
    setup: Setup, pool: ChainPool, batch: int, plan: RoundPlan, *, threads: int
) -> dict[str, Any]:
    """Time the methods on one ``(K, batch)``; return its record: median seconds, ratios of
    the peers' medians over ours, the share of reasoning requests, and the warm-up check."""
    import xgrammar as xgr

    import portable_spec as ps

    k = pool.k
    rows = batch * (k + 1)
    out = np.full((rows, setup.words), -1, dtype=np.int32)
    bitmask = xgr.allocate_token_bitmask(rows, setup.vocab_size)
    methods = chain_methods(setup, k, out, bitmask)
    check: dict[str, Any] = {}

    def on_warmup(_data: ChainBatch, results: dict[str, Any]) -> None:
        ours, theirs = results["portable_spec"], results["serial_fill"].numpy()
        check["rows_identical"] = bool(ours is not None and np.array_equal(ours, theirs))

    zeros = np.zeros((len(pool.matchers), 1), dtype=np.int64)
    ps.build_host_bitmask(pool.matchers, ps.GrammarTree.from_linear_chain(zeros), setup.vocab_size)
    seconds, inputs = run_rounds(methods, lambda _r: pool.sample(batch), plan, on_warmup=on_warmup)
    med = {name: median(ts) for name, ts in seconds.items()}
    ours = med["portable_spec"]
    return {
        "k": k,
        "batch": batch,
        "pool_reasoning_share": pool.reasoning_share,
        "rounds": len(inputs),
        "cores": usable_cores(),
        "threads": threads,
        "reasoning_share": median([sum(d.reasoning) / d.size for d in inputs]),
        "ends_in_window": median([d.ends_in_window for d in inputs]),
        "seconds": med,
        "speedup": {name: med[name] / ours for name in med if name != "portable_spec"},
        **check,
    }


def run_chains_section(
    setup: Setup,
    drafts: Sequence[int],
    batches: Sequence[int],
    plan_for: Callable[[int, int], RoundPlan],
    *,
    threads: int,
    reasoning_shares: Sequence[float] = (0.0, 0.5),
    on_grammar: float = 0.85,
    seed: int = 0,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every ``(reasoning share, K, batch)``; one pool per share and ``K`` (a quarter more
    requests than the largest batch); ``policy`` says what to do when other processes load
    the machine; ``advance`` is called after each pool's batches."""
    policy = policy or QuietPolicy()
    size = max(16, max(batches) + max(batches) // 4)
    records = []
    for share in reasoning_shares:
        for k in drafts:
            pool = chain_pool(
                setup, k, size, reasoning_share=share, on_grammar=on_grammar, seed=seed
            )
            for batch in batches:
                plan = plan_for(batch, k + 1)
                measure = functools.partial(
                    run_chain_config, setup, pool, batch, plan, threads=threads
                )
                record, busy = measure_quietly(measure, policy)
                record["other_busy_cores"] = busy
                records.append(record)
            if advance is not None:
                advance(f"chains reasoning={share:g} K={k}")
    return records
