"""Section ``engines``: the build with each grammar engine against that engine's own best way.

For every engine installed (``--engines``, default: all of xgrammar, llguidance,
outlines-core that import), on the same kind of workload as the build section (SmolLM2's
vocabulary, requests advanced by random valid prefixes, EAGLE-like trees or chains whose
drafts mostly follow the grammar, drawn with that engine's own masks):

``portable_spec``
    ``build_host_bitmask(..., out=buffer)`` after ``from_host`` / ``from_linear_chain``.
``engine_loop``
    The engine's per-request, per-node loop into a reused buffer: xgrammar's
    ``traverse_draft_tree`` request by request; for llguidance and outlines-core an iterative
    depth-first walk (fill the node's mask, test each child's token against it, advance,
    descend, roll back) with the engine's fastest calls (``unsafe_compute_mask_ptr`` /
    ``consume_token`` / ``rollback``; ``write_mask_into`` / ``advance(..,
    return_tokens=False)`` / ``rollback_state``).
``engine_par_chain`` (llguidance, chains only)
    ``llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens`` over the batch on an
    ``LLExecutor`` with the library's thread count: llguidance's own parallel chain fill.

Where an engine's own way beats the library's build on a shape by design (:data:`ENGINE_OWN`),
the report prints that comparison as "engine's own": the integrations give that shape to the
engine's own fill.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tools.bench.build import library_build, xgrammar_loop
from tools.bench.timing import (
    Method,
    QuietPolicy,
    RoundPlan,
    measure_quietly,
    median,
    run_rounds,
    usable_cores,
)
from tools.bench.workloads import Batch, RequestPool, Setup, make_pool

__all__ = ["ENGINES", "available_engines", "engine_pool", "run_engine_config"]

ENGINES = ("xgrammar", "llguidance", "outlines")
#: (engine, shape) -> the method of the engine's own that the integrations use for that shape
#: instead of the library's build. llguidance's chain fill does in Rust exactly the masks a
#: chain needs and leaves the rows after a chain's end untouched; the library's build writes
#: those rows all-allowed and reads back where each chain ended, on top of the same masks:
#: 0.60x to 0.87x of that fill over batches 1 to 256 (2 cores), 1.04x to 1.23x of the
#: per-token loop. The vLLM plugin's guidance path calls llguidance's chain fill itself.
ENGINE_OWN = {("llguidance", "chain"): "engine_par_chain"}
_MODULES = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines": "outlines_core"}
# the sample grammar each engine compiles for a workload kind (None: not expressible)
_KINDS = {
    "llguidance": {"json_schema": "json_schema", "ebnf": "lark", "regex": "regex"},
    "outlines": {"json_schema": "json_schema", "ebnf": None, "regex": "regex"},
}


def available_engines() -> tuple[str, ...]:
    """The engines importable here."""
    return tuple(e for e in ENGINES if importlib.util.find_spec(_MODULES[e]) is not None)


class _LLAdapter:
    """An ``LLMatcher`` behind xgrammar's interface, for drawing workloads (the end token is
    tracked, never consumed)."""

    def __init__(self, matcher: Any, eos: int, words: int) -> None:
        self.inner, self.eos, self.words, self.ended = matcher, eos, words, False

    def fill_next_token_bitmask(self, rows: np.ndarray, index: int) -> None:
        self.inner.unsafe_compute_mask_ptr(rows[index].ctypes.data, 4 * self.words)

    def accept_token(self, token: int) -> bool:
        if token == self.eos:
            row = np.empty((1, self.words), dtype=np.int32)
            self.fill_next_token_bitmask(row, 0)
            self.ended = bool((int(row[0, token >> 5]) >> (token & 31)) & 1)
            return self.ended
        return self.inner.try_consume_tokens([token]) == 1

    def rollback(self, count: int) -> None:
        if self.ended:
            self.ended, count = False, count - 1
        if count:
            self.inner.rollback(count)

    def is_terminated(self) -> bool:
        return self.ended

    def reset(self) -> None:
        self.inner.reset()
        self.ended = False


class _GuideAdapter:
    """An ``outlines_core.Guide`` behind xgrammar's interface, for drawing workloads."""

    def __init__(self, guide: Any, eos: int, words: int) -> None:
        self.inner, self.eos, self.words, self.ended = guide, eos, words, False

    def fill_next_token_bitmask(self, rows: np.ndarray, index: int) -> None:
        self.inner.write_mask_into(rows[index].ctypes.data, self.words, 4)

    def accept_token(self, token: int) -> bool:
        if token == self.eos:
            self.ended = self.inner.is_finished()
            return self.ended
        try:
            self.inner.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, count: int) -> None:
        if self.ended:
            self.ended, count = False, count - 1
        if count:
            self.inner.rollback_state(count)

    def is_terminated(self) -> bool:
        return self.ended

    def reset(self) -> None:
        self.inner.reset()
        self.ended = False


def engine_pool(
    setup: Setup, engine: str, kind: str, shape: str, nodes: int, size: int, **options: Any
) -> RequestPool | None:
    """A request pool of ``engine``'s own matchers (None: the engine cannot express
    ``kind``). ``options`` go to :func:`~tools.bench.workloads.make_pool`."""
    if engine == "xgrammar":
        return make_pool(setup, kind, shape, nodes, size, **options)
    from portable_spec import testing as ge

    sample = _KINDS[engine][kind]
    if sample is None:
        return None
    words = setup.words
    if engine == "llguidance":

        def new() -> Any:
            return _LLAdapter(ge.llguidance_matcher(sample), setup.eos_id, words)

    else:
        rollback = 2 * nodes + 64  # walks need the tree's depth; prefixes need none back

        def new() -> Any:
            return _GuideAdapter(ge.outlines_guide(sample, rollback), setup.eos_id, words)

    def native(adapter: Any) -> Any:
        return adapter.inner

    return make_pool(setup, kind, shape, nodes, size, new_matcher=new, native=native, **options)


# -- the engines' own loops --------------------------------------------------------------------
def _children(next_token: list[int], next_sibling: list[int], v: int) -> list[int]:
    kids = []
    c = next_token[v]
    while c != -1:
        kids.append(c)
        c = next_sibling[c]
    return kids


def _dfs_loop(
    fill: Callable[[int], None],
    accept: Callable[[int], bool],
    rollback: Callable[[int], Any],
    links: tuple[list[int], list[int], list[int]],
    rows: np.ndarray,
    vocab_size: int,
) -> None:
    """The per-node loop engines write: fill the node's row, test each child's token against
    it, accept, descend, roll back (iterative, so deep chains work)."""
    next_token, next_sibling, draft = links
    base, row_bytes = rows.ctypes.data, rows.strides[0]
    fill(base)
    stack = [(c, 0, 1) for c in reversed(_children(next_token, next_sibling, 0))]
    held = 0
    while stack:
        node, parent, depth = stack.pop()
        token = draft[node]
        if not (0 <= token < vocab_size and (int(rows[parent, token >> 5]) >> (token & 31)) & 1):
            continue
        if held >= depth:
            rollback(held - depth + 1)
            held = depth - 1
        if not accept(token):
            continue
        held = depth
        fill(base + node * row_bytes)
        stack.extend(
            (c, node, depth + 1) for c in reversed(_children(next_token, next_sibling, node))
        )
    if held:
        rollback(held)


def _engine_loop(engine: str, eos: int, words: int, vocab_size: int) -> Callable[..., None]:
    """``loop(matcher, links, rows)`` for one request of ``engine`` (not xgrammar)."""
    if engine == "llguidance":

        def loop(matcher: Any, links: Any, rows: np.ndarray) -> None:
            compute = matcher.unsafe_compute_mask_ptr

            def accept(token: int) -> bool:  # the end token ends the walk below it
                return token != eos and matcher.consume_token(token)

            _dfs_loop(lambda p: compute(p, 4 * words), accept, matcher.rollback, links, rows,
                      vocab_size)  # fmt: skip

        return loop

    def loop(matcher: Any, links: Any, rows: np.ndarray) -> None:
        write, advance = matcher.write_mask_into, matcher.advance

        def accept(token: int) -> bool:
            try:
                advance(token, return_tokens=False)
            except ValueError:
                return False
            return True

        _dfs_loop(lambda p: write(p, words, 4), accept, matcher.rollback_state, links, rows,
                  vocab_size)  # fmt: skip

    return loop


def _methods(
    engine: str, setup: Setup, shape: str, out: np.ndarray, reused: np.ndarray, threads: int
) -> list[Method[Batch]]:
    vocab_size, words = setup.vocab_size, setup.words

    def ours(batch: Batch) -> Callable[[], Any]:
        return library_build(batch, vocab_size, out, chain=shape == "chain")

    def engine_loop(batch: Batch) -> Callable[[], Any]:
        if engine == "xgrammar":
            return xgrammar_loop(batch, reused)
        n = batch.nodes
        blocks = [reused[b * n : (b + 1) * n] for b in range(batch.batch)]
        loop = _engine_loop(engine, setup.eos_id, words, vocab_size)
        lists = [
            (batch.next_token[b].tolist(), batch.next_sibling[b].tolist(),
             batch.draft_tokens[b].tolist())
            for b in range(batch.batch)
        ]  # fmt: skip

        def call() -> np.ndarray:
            for m, links, rows in zip(batch.matchers, lists, blocks, strict=True):
                loop(m, links, rows)
            return reused

        return call

    methods = [Method("portable_spec", ours), Method("engine_loop", engine_loop)]
    if engine == "llguidance" and shape == "chain":
        import llguidance
        import llguidance.numpy

        executor = llguidance.LLExecutor(num_threads=threads)

        def par_chain(batch: Batch) -> Callable[[], Any]:
            n = batch.nodes
            items = [
                (m, b * n, [int(t) for t in batch.draft_tokens[b, 1:]])
                for b, m in enumerate(batch.matchers)
            ]
            fill = llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens
            return lambda: fill(executor, items, reused)

        methods.append(Method("engine_par_chain", par_chain))
    return methods


def run_engine_config(
    setup: Setup,
    engine: str,
    pool: RequestPool,
    batch: int,
    plan: RoundPlan,
    *,
    threads: int,
) -> dict[str, Any]:
    """Time ``engine``'s methods on one configuration; return its record (median seconds per
    method, ratios of medians against ``portable_spec``, and whether the warm-up round's
    ``portable_spec`` mask equals the engine loop's on the rows that loop writes)."""
    import portable_spec as ps

    nodes = pool.next_token.shape[1]
    rows = batch * nodes
    out = np.full((rows, setup.words), -1, dtype=np.int32)
    reused = np.full((rows, setup.words), -1, dtype=np.int32)
    methods = _methods(engine, setup, pool.shape, out, reused, threads)
    check: dict[str, Any] = {}

    def on_warmup(data: Batch, results: dict[str, Any]) -> None:
        ours = results["portable_spec"]
        theirs = results["engine_loop"]
        live = (ours != -1).any(axis=1)
        check["rows_agree"] = bool(np.array_equal(ours[live], theirs[live]))
        check["live_rows"] = int(live.sum())

    tree = ps.GrammarTree.from_host(pool.next_token, pool.next_sibling, pool.draft_tokens)
    ps.build_host_bitmask(pool.matchers, tree, setup.vocab_size)  # learn each matcher once
    seconds, inputs = run_rounds(methods, lambda _r: pool.sample(batch), plan, on_warmup=on_warmup)
    med = {name: median(ts) for name, ts in seconds.items()}
    ours = med["portable_spec"]
    return {
        "engine": engine,
        "kind": pool.kind,
        "shape": pool.shape,
        "nodes": nodes,
        "batch": batch,
        "rounds": len(inputs),
        "cores": usable_cores(),
        "threads": threads,
        "accepted_nodes": median([d.accepted for d in inputs]),
        "seconds": med,
        "speedup": {name: med[name] / ours for name in med if name != "portable_spec"},
        "engine_own": ENGINE_OWN.get((engine, pool.shape)),
        **check,
    }


def run_engines_section(
    setup: Setup,
    engines: Sequence[str],
    kinds: Sequence[str],
    shapes: Sequence[str],
    nodes_list: Sequence[int],
    batches: Sequence[int],
    plan_for: Callable[[int, int], RoundPlan],
    *,
    threads: int,
    topk: int = 4,
    on_grammar: float = 0.85,
    seed: int = 0,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every (engine, grammar, shape, nodes, batch) configuration the engines can express;
    ``policy`` says what to do when other processes load the machine."""
    policy = policy or QuietPolicy()
    records = []
    size = max(16, max(batches) + max(batches) // 4)
    for engine in engines:
        for kind in kinds:
            for shape in shapes:
                for nodes in nodes_list:
                    pool = engine_pool(
                        setup, engine, kind, shape, nodes, size,
                        topk=topk, on_grammar=on_grammar, seed=seed,
                    )  # fmt: skip
                    if pool is None:
                        continue
                    for batch in batches:
                        plan = plan_for(batch, nodes)
                        measure = functools.partial(
                            run_engine_config, setup, engine, pool, batch, plan, threads=threads
                        )
                        record, busy = measure_quietly(measure, policy)
                        record["other_busy_cores"] = busy
                        records.append(record)
                    if advance is not None:
                        advance(f"engines {engine} {kind} {shape} n={nodes}")
    return records
