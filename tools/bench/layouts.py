"""Sections ``layout`` and ``async``: the dense and compact mask layouts side by side, and the
caller-thread time of a build started with ``wait=False``.

``layout``: per vocabulary (SmolLM2's 49152 tokens, a synthetic 131072-token one), JSON-schema
requests with EAGLE-like trees (the build section's workload), batch x nodes:

* host build, interleaved rounds: xgrammar's ``traverse_draft_tree`` request by request into
  a reused buffer (``T1``), ``build_host_bitmask(..., out=buffer)`` dense, and the same with
  ``layout="compact"`` into a reused ``CompactMask`` (every method on the same fresh batch);
* mask bytes written on the host (dense: every row; compact: the ``K`` listed rows and their
  int32 indices; the walks write the same grammar rows in both layouts, into the mask for
  dense and into a reused scratch block for compact);
* bytes uploaded: dense, the whole mask; compact, what ``build_grammar_vocab_mask`` put on the
  device (checked on JAX's device: ``bits`` is ``[K, words]`` and ``rows`` ``[K]``);
* apply per layout (numpy in place, torch through xgrammar's kernels, JAX in a donating jit),
  for configurations whose float32 logits fit ``apply_max_bytes``.

``async``: at one batch x nodes, ``build_grammar_vocab_mask`` blocking, the return of the same
call with ``wait=False``, and ``wait=False`` through ``result()``.
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
    measure_quietly,
    median,
    run_rounds,
    usable_cores,
)
from tools.bench.workloads import Batch, RequestPool, Setup, make_pool

__all__ = [
    "LAYOUT_VOCABS",
    "LayoutGrid",
    "async_table",
    "layout_apply_table",
    "layout_setup",
    "layout_table",
    "layout_targets",
    "run_async_section",
    "run_layout_section",
]

LAYOUT_VOCABS = ("smollm2", "131072")
KIND = "json_schema"


@dataclass(frozen=True)
class LayoutGrid:
    """The configurations of the layout section (every combination is run)."""

    vocabs: tuple[str, ...] = LAYOUT_VOCABS
    batches: tuple[int, ...] = (8, 64, 256)
    nodes: tuple[int, ...] = (16, 64)
    layouts: tuple[str, ...] = ("dense", "compact")
    apply_max_bytes: int = 1 << 30
    frameworks: tuple[str, ...] = ("numpy", "torch", "jax")
    topk: int = 4
    on_grammar: float = 0.85
    seed: int = 0


def layout_setup(vocab: str) -> Setup:
    """A vocabulary by name (:func:`tools.bench.workloads.vocab_setup`: ``smollm2``,
    ``tekken``, ``qwen``) or a synthetic one of a given size."""
    from tools.bench.workloads import vocab_setup

    return vocab_setup(vocab, (KIND,))


def _vocab_label(vocab: str, setup: Setup) -> str:
    return setup.label or vocab


# -- host build ----------------------------------------------------------------------------------
def _build_methods(
    setup: Setup, layouts: Sequence[str], nodes: int, batch: int
) -> tuple[list[Method[Batch]], dict[str, Any]]:
    import portable_spec as ps
    from portable_spec.masks import compact_views, index_words
    from tools.bench.build import library_build, xgrammar_loop

    vocab, words, rows = setup.vocab_size, setup.words, batch * nodes
    reused = np.full((rows, words), -1, dtype=np.int32)
    dense_out = np.full((rows, words), -1, dtype=np.int32)
    block = np.full((rows + index_words(rows, words), words), -1, dtype=np.int32)
    compact_out = ps.CompactMask(*compact_views(block, rows), rows)
    buffers = {"dense": dense_out, "compact": compact_out}

    def xgr(data: Batch) -> Callable[[], Any]:
        return xgrammar_loop(data, reused)

    def ours(layout: str) -> Callable[[Batch], Callable[[], Any]]:
        def prepare(data: Batch) -> Callable[[], Any]:
            return library_build(data, vocab, buffers[layout], chain=False, layout=layout)

        return prepare

    methods = [Method("xgr_loop_reused", xgr)]
    methods += [Method(layout, ours(layout)) for layout in layouts]
    return methods, buffers


def _uploaded_compact(setup: Setup, data: Batch) -> tuple[int, int, int] | None:
    """``(bits rows, index entries, bytes)`` of a compact mask put on JAX's default device
    (None without JAX)."""
    try:
        import jax
    except ImportError:  # pragma: no cover - jax is a bench dependency
        return None
    import portable_spec as ps

    links = (data.next_token, data.next_sibling, data.draft_tokens)
    mask = ps.build_grammar_vocab_mask(
        data.matchers,
        ps.GrammarTree.from_host(*links),
        setup.vocab_size,
        device=jax.devices()[0],
        layout="compact",
    )
    if mask is None:
        return 0, 0, 0
    return int(mask.bits.shape[0]), int(mask.rows.shape[0]), mask.bits.nbytes + mask.rows.nbytes


def run_layout_config(
    setup: Setup, vocab: str, pool: RequestPool, batch: int, grid: LayoutGrid, plan: RoundPlan
) -> dict[str, Any]:
    """Time the host build per layout against the xgrammar loop on one configuration, then
    the apply per layout; return the record."""
    nodes = pool.next_token.shape[1]
    rows, words = batch * nodes, setup.words
    methods, _ = _build_methods(setup, grid.layouts, nodes, batch)
    check: dict[str, Any] = {}
    masks: dict[str, Any] = {}

    def on_warmup(data: Batch, results: dict[str, Any]) -> None:
        dense = results.get("dense")
        compact = results.get("compact")
        if dense is not None and compact is not None:
            check["masks_identical"] = bool(np.array_equal(compact.to_dense(), dense))
        if compact is not None:
            check["listed_matches_accepted"] = compact.count == data.accepted
            check["uploaded"] = _uploaded_compact(setup, data)
            masks["compact"] = type(compact)(
                compact.rows.copy(), compact.bits.copy(), compact.num_rows, compact.count
            )
        if dense is not None:
            masks["dense"] = dense.copy()

    seconds, inputs = run_rounds(methods, lambda _r: pool.sample(batch), plan, on_warmup=on_warmup)
    accepted = median([d.accepted for d in inputs])
    med = {name: median(ts) for name, ts in seconds.items()}
    loop = med["xgr_loop_reused"]
    row_bytes = 4 * words
    host_bytes = {"dense": rows * row_bytes, "compact": accepted * (row_bytes + 4)}
    uploaded = check.get("uploaded")
    upload_ok = None
    if uploaded is not None and masks.get("compact") is not None:
        count = masks["compact"].count
        upload_ok = uploaded[:2] == (count, count) and uploaded[2] == count * (row_bytes + 4)
    record: dict[str, Any] = {
        "vocab": _vocab_label(vocab, setup),
        "vocab_size": setup.vocab_size,
        "kind": KIND,
        "shape": pool.shape,
        "nodes": nodes,
        "batch": batch,
        "rounds": len(inputs),
        "cores": usable_cores(),
        "accepted_nodes": accepted,
        "seconds": med,
        "speedup": {k: loop / v for k, v in med.items() if k != "xgr_loop_reused"},
        "host_bytes_written": {k: host_bytes[k] for k in grid.layouts},
        "bytes_uploaded": {k: host_bytes[k] for k in grid.layouts},
        "upload_is_k_rows_plus_index": upload_ok,
        "masks_identical": check.get("masks_identical"),
        "listed_matches_accepted": check.get("listed_matches_accepted"),
    }
    record["apply"] = _apply_per_layout(masks, rows, setup.vocab_size, grid, plan)
    return record


# -- apply per layout ------------------------------------------------------------------------------
def _apply_per_layout(
    masks: dict[str, Any], rows: int, vocab: int, grid: LayoutGrid, plan: RoundPlan
) -> dict[str, Any]:
    """Median seconds per framework and layout over the same float32 logits, or a reason."""
    need = rows * vocab * 4
    if need > grid.apply_max_bytes:
        return {"skipped": f"logits of {need / 2**30:.1f} GiB exceed apply_max_bytes"}
    logits = np.random.default_rng(1).standard_normal((rows, vocab), dtype=np.float32)
    out: dict[str, Any] = {}
    for framework in grid.frameworks:
        methods = _apply_methods(framework, logits, masks)
        if not methods:
            continue
        seconds, _ = run_rounds(methods, lambda _r: None, plan)
        out[framework] = {name: median(ts) for name, ts in seconds.items()}
        del methods
    return out


def _apply_methods(framework: str, logits: np.ndarray, masks: dict[str, Any]) -> list[Method[None]]:
    import portable_spec as ps

    methods: list[Method[None]] = []
    if framework == "numpy":
        for layout, mask in masks.items():
            mine = logits.copy()
            methods.append(
                Method(layout, lambda _, m=mask, x=mine: lambda: ps.apply_vocab_mask(x, m))
            )
    elif framework == "torch":
        import torch

        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()

        for layout, mask in masks.items():
            mine = torch.from_numpy(logits).to(device, copy=True)
            if layout == "compact":
                on = ps.CompactMask(
                    torch.from_numpy(mask.rows).to(device),
                    torch.from_numpy(mask.bits).to(device),
                    mask.num_rows,
                    mask.count,
                )
            else:
                on = torch.from_numpy(mask).to(device)

            def prepare(_: None, x: Any = mine, m: Any = on) -> Callable[[], Any]:
                return lambda: (ps.apply_vocab_mask(x, m), sync())

            methods.append(Method(layout, prepare))
    elif framework == "jax":
        import jax
        import jax.numpy as jnp

        donating = jax.jit(ps.apply_vocab_mask, donate_argnums=0)
        for layout, mask in masks.items():
            if layout == "compact":
                on = ps.CompactMask(
                    jnp.asarray(mask.rows), jnp.asarray(mask.bits), mask.num_rows, mask.count
                )
            else:
                on = jnp.asarray(mask)
            cell = [jnp.asarray(logits)]

            def prepare(_: None, m: Any = on, c: list[Any] = cell) -> Callable[[], Any]:
                def call() -> None:
                    c[0] = donating(c[0], m)
                    c[0].block_until_ready()

                return call

            methods.append(Method(f"{layout} (donating jit)", prepare))
    return methods


def run_layout_section(
    grid: LayoutGrid,
    plan: RoundPlan,
    *,
    threads: int,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every (vocabulary, nodes, batch) configuration of ``grid``."""
    from tools.bench.build import warm_matchers

    policy = policy or QuietPolicy()
    results = []
    biggest = max(grid.batches)
    for vocab in grid.vocabs:
        setup = layout_setup(vocab)
        for nodes in grid.nodes:
            pool = make_pool(
                setup,
                KIND,
                "tree",
                nodes,
                max(16, biggest + biggest // 4),
                topk=grid.topk,
                on_grammar=grid.on_grammar,
                seed=grid.seed,
            )
            warm_matchers(pool, setup.vocab_size)
            for batch in grid.batches:
                record, busy = measure_quietly(
                    functools.partial(run_layout_config, setup, vocab, pool, batch, grid, plan),
                    policy,
                )
                record["threads"] = threads
                record["other_busy_cores"] = busy
                results.append(record)
                if advance is not None:
                    advance(f"layout {vocab} n={nodes} bs={batch}")
            del pool
    return results


# -- wait=False --------------------------------------------------------------------------------
def run_async_config(setup: Setup, pool: RequestPool, batch: int, plan: RoundPlan) -> Any:
    """The three ways of building one configuration, in interleaved rounds: ``(seconds,
    inputs)`` of :func:`run_rounds`. A pending build is always finished (untimed, in the next
    method's preparation) before another method starts."""
    import portable_spec as ps

    size = setup.vocab_size
    pending: list[Any] = []

    def finish_pending() -> None:
        while pending:
            pending.pop().result()

    def start(data: Batch, wait: bool) -> Any:
        links = (data.next_token, data.next_sibling, data.draft_tokens)
        return ps.build_grammar_vocab_mask(
            data.matchers, ps.GrammarTree.from_host(*links), size, wait=wait
        )

    def method(name: str, call: Callable[[Batch], Any]) -> Method[Batch]:
        def prepare(data: Batch) -> Callable[[], Any]:
            finish_pending()
            return lambda: call(data)

        return Method(name, prepare)

    methods = [
        method("blocking", lambda d: start(d, True)),
        method("wait=False (call returns)", lambda d: pending.append(start(d, False))),
        method("wait=False to result()", lambda d: start(d, False).result()),
    ]
    try:
        return run_rounds(methods, lambda _r: pool.sample(batch), plan)
    finally:
        finish_pending()


def run_async_section(
    vocabs: Sequence[str],
    batch: int,
    nodes: int,
    plan: RoundPlan,
    *,
    policy: QuietPolicy | None = None,
    advance: Callable[[str], None] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Per vocabulary: the blocking call, the ``wait=False`` call's return and ``wait=False``
    through ``result()`` (numpy backend: the build is all there is)."""
    from tools.bench.build import warm_matchers

    policy = policy or QuietPolicy()
    results = []
    for vocab in vocabs:
        setup = layout_setup(vocab)
        pool = make_pool(setup, KIND, "tree", nodes, max(16, batch + batch // 4), seed=seed)
        warm_matchers(pool, setup.vocab_size)
        (seconds, _), busy = measure_quietly(
            functools.partial(run_async_config, setup, pool, batch, plan), policy
        )
        med = {name: median(ts) for name, ts in seconds.items()}
        results.append(
            {
                "vocab": _vocab_label(vocab, setup),
                "kind": KIND,
                "batch": batch,
                "nodes": nodes,
                "rounds": len(seconds["blocking"]),
                "seconds": med,
                "call_over_blocking": med["wait=False (call returns)"] / med["blocking"],
                "other_busy_cores": busy,
            }
        )
        if advance is not None:
            advance(f"async {vocab}")
        del pool
    return results


# -- tables and targets ----------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    if seconds is None or not np.isfinite(seconds):
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}" if nbytes < 10 * 2**20 else f"{nbytes / 2**20:.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _bg(record: dict[str, Any]) -> str:
    busy = record.get("other_busy_cores")
    return "?" if busy is None else f"{busy:.2f}"


def layout_table(records: Sequence[dict[str, Any]]) -> str:
    """Host build per layout: medians, speed-ups over the xgrammar loop, bytes."""
    if not records:
        return ""
    layouts = [k for k in ("dense", "compact") if k in records[0]["seconds"]]
    header = ["vocab", "nodes", "batch", "listed K", "xgr reused ms"]
    header += [f"{k} ms" for k in layouts] + [f"{k} vs xgr" for k in layouts]
    header += [f"{k} MiB written" for k in layouts] + [f"{k} MiB uploaded" for k in layouts]
    header += ["upload = K rows + index", "check", "bg"]
    rows = []
    for r in records:
        s, sp = r["seconds"], r["speedup"]
        identical = r.get("masks_identical")
        ok = identical is not False and r.get("listed_matches_accepted") is not False
        upload = r.get("upload_is_k_rows_plus_index")
        rows.append(
            [
                r["vocab"],
                str(r["nodes"]),
                str(r["batch"]),
                f"{r['accepted_nodes']:.0f} of {r['nodes'] * r['batch']}",
                _ms(s["xgr_loop_reused"]),
                *[_ms(s[k]) for k in layouts],
                *[f"{sp[k]:.2f}x" for k in layouts],
                *[_mib(r["host_bytes_written"][k]) for k in layouts],
                *[_mib(r["bytes_uploaded"][k]) for k in layouts],
                "n/a" if upload is None else "yes" if upload else "NO",
                "ok" if ok else "MISMATCH",
                _bg(r),
            ]
        )
    return _table(header, rows)


def layout_apply_table(records: Sequence[dict[str, Any]]) -> str:
    """Apply per framework and layout (float32 logits of the configuration's rows)."""
    rows = []
    for r in records:
        apply = r.get("apply", {})
        if "skipped" in apply:
            continue
        for framework, seconds in apply.items():
            names = list(seconds)
            dense = next((seconds[n] for n in names if n.startswith("dense")), None)
            compact = next((seconds[n] for n in names if n.startswith("compact")), None)
            ratio = compact / dense if dense and compact else float("nan")
            rows.append(
                [
                    r["vocab"],
                    f"{r['batch']} x {r['nodes']}",
                    f"{r['accepted_nodes']:.0f} of {r['nodes'] * r['batch']}",
                    framework,
                    _ms(dense),
                    _ms(compact),
                    "n/a" if not np.isfinite(ratio) else f"{ratio:.2f}",
                ]
            )
    if not rows:
        return ""
    header = ["vocab", "batch x nodes", "listed K", "framework", "dense ms", "compact ms"]
    return _table([*header, "compact / dense"], rows)


def async_table(records: Sequence[dict[str, Any]]) -> str:
    """wait=False against the blocking call."""
    if not records:
        return ""
    header = [
        "vocab",
        "batch x nodes",
        "blocking ms",
        "wait=False call ms",
        "wait=False to result() ms",
        "call / blocking",
        "bg",
    ]
    rows = [
        [
            r["vocab"],
            f"{r['batch']} x {r['nodes']}",
            _ms(r["seconds"]["blocking"]),
            _ms(r["seconds"]["wait=False (call returns)"]),
            _ms(r["seconds"]["wait=False to result()"]),
            f"{100 * r['call_over_blocking']:.2f}%",
            _bg(r),
        ]
        for r in records
    ]
    return _table(header, rows)


def layout_targets(
    layout: Sequence[dict[str, Any]], pending: Sequence[dict[str, Any]]
) -> list[Any]:
    """The compact-layout and ``wait=False`` targets (issue 13), as :class:`report.Target`."""
    from tools.bench.report import Target

    def big(r: dict[str, Any]) -> bool:
        return r["vocab_size"] >= 131072 and r["batch"] == 64 and "compact" in r["speedup"]

    def build_target(nodes: int, bound: float) -> Target:
        ratios = [
            (f"{r['vocab']}/n{r['nodes']}/bs{r['batch']}", r["speedup"]["compact"])
            for r in layout
            if big(r) and r["nodes"] == nodes
        ]
        met = all(v >= bound for _, v in ratios) if ratios else None
        return Target(
            f"compact build bs64, {nodes} nodes, 131072 vocab: / xgrammar loop (reused)",
            f">= {bound}x",
            ratios,
            met,
        )

    uploads = [
        (f"{r['vocab']}/n{r['nodes']}/bs{r['batch']}", 1.0 if r[key] else 0.0)
        for r in layout
        if (key := "upload_is_k_rows_plus_index") in r and r[key] is not None
    ]
    calls = [
        (f"{r['vocab']}/n{r['nodes']}/bs{r['batch']}", r["call_over_blocking"]) for r in pending
    ]
    return [
        build_target(64, 1.8),
        build_target(16, 1.6),
        Target(
            "compact upload: bytes = K rows + index (1 = exactly)",
            ">= 1x",
            uploads,
            all(v == 1.0 for _, v in uploads) if uploads else None,
        ),
        Target(
            "wait=False: call time / blocking build",
            "<= 0.05x",
            calls,
            all(v <= 0.05 for _, v in calls) if calls else None,
        ),
    ]
