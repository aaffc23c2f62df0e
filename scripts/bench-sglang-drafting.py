"""Grammar-aware drafting in sglang 0.5.23 on CPU: tokens per request-step with sglang's own
NGRAM worker and EAGLE v2 draft loop, drafting off and on, on the library's JSON-schema
workloads; and the cost of the EAGLE draft rows against the verify mask of the same step.

Usage: ``.venv-sglang/bin/python scripts/bench-sglang-drafting.py [--backend xgrammar]
[--ngram-nodes 8] [--eagle-shapes chain,tree] [--eagle-steps 30] [--out FILE]``
(run ``bash scripts/setup-sglang.sh`` first).

The requests: six JSON documents, three per workload of ``portable_spec.testing.
SCHEMA_WORKLOADS`` (an invoice, a tool call: long fixed keys, enums, nested objects), each
written by a scripted target model (tests/real_sglang/_draft.py: at every verify node it
prefers the next token of its document, in SmolLM2's own segmentation, over noise that depends
only on the sequence), so that its greedy output is the document whatever was drafted. Every
output is checked against its document: drafting changes how many tokens a step commits,
never which.

* NGRAM: sglang's own ``NGRAMWorker.forward_batch_generation`` (its corpus, its trees, its
  kernels under Triton's interpreter), the six requests in one batch from their first token to
  their end token, ``--ngram-nodes`` draft tokens per tree; the corpus empty, then holding
  four other documents of the same schemas (each after its prompt). Per run: tokens committed
  per request-step (a request's step: one verify), the median host time of the worker's
  ``_prepare_draft_tokens`` per step (the tree lookup; with drafting, the session and the
  forced continuation too), the slots given forced tokens and the forced tokens accepted.
* EAGLE: sglang's own ``EagleDraftWorker`` (``draft``, ``draft_forward``,
  ``select_top_k_tokens``, ``organize_draft_results``, ``build_eagle_verify_input``,
  ``_draft_extend_for_decode``) with a stand-in draft head of random logits, so that it drafts
  at random (drafting off) or at random among the tokens the grammar allows (drafting on), and
  sglang's ``run_eagle_verify``; ``--eagle-steps`` verify steps over the six requests (started
  at spread-out points of their documents, so that keys, enums and free values all occur).
  Per run: accepted tokens per verify (committed per request-step, bonus included) and the
  drafted verify nodes the grammar refuses (drafting off runs in the drafting switch's shadow
  mode: sglang's own drafts, followed and counted by the plugin). With drafting on, per
  step: the host time of the draft rows (the wall time of the session calls that return
  them: opening or restarting it, its root rows, each level's rows for the draft head)
  against the verify mask of the same tree built three ways, in this order at sglang's call
  of the verify build: the library's own build of the tree
  (``portable_spec.build_grammar_vocab_mask``, what the plugin does without drafting: timed
  first, as it runs then, after the step's forward), sglang's ``generate_token_bitmask``, and
  from the draft rows (what the plugin does: the last level's rows, then a gather; the third
  walk of the step's matchers, so with the warmest caches); medians over the steps.

torch runs one thread; the library's pool its default. Tokens per step do not depend on the
machine; the times do (medians of a shared machine: see the load printed).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "real_sglang")
EAGLE_SHAPES = {"chain": (1, 3, 4), "tree": (4, 3, 8), "wide": (8, 5, 64)}  # topk, steps, nodes


def _setup() -> None:
    sys.path.insert(0, TESTS)
    import conftest  # noqa: F401  sglang on CPU: Triton's interpreter, the import stubs
    import torch

    torch.set_num_threads(1)


def _check(writers: list, run: str) -> None:
    for w in writers:
        if w.output_ids != w.document[: len(w.output_ids)]:
            sys.exit(f"{run}: request {w.rid} committed tokens that are not its document's")


def ngram_run(backend: str, corpus: list, drafting: bool, nodes: int, max_steps: int) -> dict:
    import _draft
    import _sgl

    from portable_spec.integrations import sglang as plugin

    writers = _draft.writers(backend, 6)
    plugin.reset_stats()
    prepare_s: list[float] = []
    request_steps = committed = 0
    with _sgl.plugin_on():
        plugin.set_drafting(drafting)
        worker = _draft.ngram_worker(corpus, _sgl.VOCAB)
        prepare = worker._prepare_draft_tokens

        def timed(batch: Any) -> Any:
            started = time.perf_counter()
            try:
                return prepare(batch)
            finally:
                prepare_s.append(time.perf_counter() - started)

        worker._prepare_draft_tokens = timed
        for _ in range(max_steps):
            active = [w for w in writers if not w.finished]
            if not active:
                break
            for w, tokens in zip(active, _draft.ngram_step(worker, active), strict=True):
                committed += len(w.commit(tokens))
            request_steps += len(active)
        stats = plugin.integration_stats()
        plugin.set_drafting(True)
    plugin.reset_stats()
    _check(writers, "NGRAM")
    if not all(w.finished for w in writers):
        sys.exit(f"NGRAM: the documents were not finished in {max_steps} steps")
    return {
        "tokens": committed,
        "request_steps": request_steps,
        "per_step": committed / request_steps,
        "prepare_ms": 1e3 * statistics.median(prepare_s),
        "replaced": stats["ngram_nodes_replaced"],
        "accepted": stats["forced_tokens_accepted"],
        "mismatches": stats["draft_mismatches"],
    }


def eagle_run(backend: str, shape: tuple[int, int, int], drafting: bool, steps: int) -> dict:
    import _draft
    import _sgl
    import numpy as np
    import torch
    from sglang.srt.speculative import eagle_worker_common

    import portable_spec as ps
    from portable_spec.integrations import sglang as plugin
    from portable_spec.integrations.sglang import drafting as drafting_module
    from portable_spec.integrations.sglang.grammars import plan_step

    topk, depth, nodes = shape
    vocab = _sgl.VOCAB
    writers = _draft.writers(backend, 6)
    for w, at in zip(writers, np.linspace(0.0, 0.75, len(writers)), strict=True):
        w.commit(w.document[: int(at * len(w.document))])  # spread over the documents
    worker = _draft.draft_worker(topk, depth, nodes, vocab, seed=5)
    plugin.reset_stats()
    times: dict[str, list[float]] = {"draft": [], "gather": [], "library": [], "sglang": []}
    request_steps = committed = 0
    stage, rows_of = drafting_module.stage, drafting_module.drafted_rows

    # the draft rows' host time: the wall time of the session calls that return them (opening
    # or restarting it, the root rows, each level the draft head runs on), summed per draft,
    # taken when the draft is staged for its verify
    spent = [0.0]
    session_type = ps.DraftSession
    names = ("__init__", "restart", "root_mask", "extend")
    originals = {name: getattr(session_type, name) for name in names if hasattr(session_type, name)}

    def timed(name: str) -> Any:
        original = originals[name]

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if name == "extend" and not kwargs.get("masks", True):
                return original(self, *args, **kwargs)  # the verify's level: not a draft row
            started = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started

        return call

    def staged(step: Any) -> None:
        if step is not None:
            times["draft"].append(spent[0])
        spent[0] = 0.0
        stage(step)

    def gathered(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return rows_of(*args)
        finally:
            times["gather"].append(time.perf_counter() - started)

    build = None

    def spy(*, reqs: Any, tree: Any, sampling_info: Any, device: Any, barrier: Any) -> Any:
        """The library's and sglang's fresh builds of the tree, timed; then the plugin's."""
        host = tree.resolve()
        matchers = plan_step(reqs, vocab).matchers
        arrays = [t.numpy() for t in host]
        # the library's build first: where the plugin runs it without drafting, with the
        # caches as the step's forward left them (a build right after another build of the
        # same tree finds the grammar's caches warm)
        started = time.perf_counter()
        ps.build_grammar_vocab_mask(matchers, ps.GrammarTree.from_host(*arrays), vocab,
                                    device=torch.device("cpu"))  # fmt: skip
        times["library"].append(time.perf_counter() - started)
        started = time.perf_counter()
        _sgl.spec_utils().generate_token_bitmask(reqs, *host, vocab)
        times["sglang"].append(time.perf_counter() - started)
        return build(reqs=reqs, tree=tree, sampling_info=sampling_info, device=device,
                     barrier=barrier)  # fmt: skip

    with _sgl.plugin_on():
        plugin.set_drafting("on" if drafting else "shadow")  # shadow: sglang's drafts, counted
        build = eagle_worker_common.build_grammar_vocab_mask
        eagle_worker_common.build_grammar_vocab_mask = spy
        drafting_module.stage, drafting_module.drafted_rows = staged, gathered
        for name in originals:
            setattr(session_type, name, timed(name))
        try:
            spec = _draft.first_draft_input(worker, writers, vocab)
            for _ in range(steps):
                if any(w.finished for w in writers):
                    break  # the batch stays whole: a request's end is the run's
                _, tokens, spec = _draft.eagle_step(worker, writers, spec, vocab)
                for w, got in zip(writers, tokens, strict=True):
                    committed += len(w.commit(got))
                request_steps += len(writers)
            stats = plugin.integration_stats()
        finally:
            eagle_worker_common.build_grammar_vocab_mask = build
            drafting_module.stage, drafting_module.drafted_rows = stage, rows_of
            for name, original in originals.items():
                setattr(session_type, name, original)
            plugin.set_drafting(True)
    plugin.reset_stats()
    _check(writers, "EAGLE")
    if drafting and stats["draft_verify_masks"] != request_steps // len(writers):
        sys.exit(f"EAGLE: {stats['draft_verify_masks']} verify masks from the draft rows")
    out = {
        "tokens": committed,
        "request_steps": request_steps,
        "per_step": committed / max(request_steps, 1),
        "refused": stats["refused_draft_nodes"],
    }
    for name, values in times.items():
        out[name] = 1e3 * statistics.median(values) if values else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="xgrammar", choices=["xgrammar", "llguidance"])
    parser.add_argument("--ngram-nodes", type=int, default=8)
    parser.add_argument("--ngram-max-steps", type=int, default=400)
    shapes = ", ".join(f"{k} {v}" for k, v in EAGLE_SHAPES.items())
    parser.add_argument("--eagle-shapes", default="chain,tree", help=f"of: {shapes}")
    parser.add_argument("--eagle-steps", type=int, default=30)
    parser.add_argument("--skip-ngram", action="store_true")
    parser.add_argument("--skip-eagle", action="store_true")
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    args = parser.parse_args()
    _setup()
    import _draft
    import _eagle
    import torch

    import portable_spec as ps

    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; torch {torch.__version__} on {torch.get_num_threads()} "
        f"thread; library pool {ps.get_num_threads()} threads; backend {args.backend}; "
        f"1-minute load before: {os.getloadavg()[0]:.1f}",
        "",
    ]
    if not args.skip_ngram:
        lines += [
            f"NGRAM ({args.ngram_nodes} draft tokens a tree), six documents to their end: "
            "tokens per request-step",
            "",
            "| corpus | drafting | request-steps | tokens | tokens / request-step | on / off "
            "| prepare ms (median) | slots given forced tokens | forced tokens accepted |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        corpora = {"empty": [], "4 other documents": _draft.corpus()}
        with _eagle.server_args(
            speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.ngram_nodes,
            speculative_ngram_max_trie_depth=8, speculative_ngram_capacity=100_000,
            disable_overlap_schedule=True, device="cpu",
        ):  # fmt: skip
            for name, corpus in corpora.items():
                runs = {}
                for drafting in (False, True):
                    print(f"NGRAM, corpus {name}, drafting {drafting}", flush=True)
                    runs[drafting] = ngram_run(args.backend, corpus, drafting, args.ngram_nodes,
                                               args.ngram_max_steps)  # fmt: skip
                for drafting in (False, True):
                    r = runs[drafting]
                    ratio = r["per_step"] / runs[False]["per_step"]
                    lines.append(
                        f"| {name} | {'on' if drafting else 'off'} | {r['request_steps']} | "
                        f"{r['tokens']} | {r['per_step']:.2f} | {ratio:.2f}x | "
                        f"{r['prepare_ms']:.2f} | {r['replaced']} | {r['accepted']} |"
                    )
        lines.append("")
    if not args.skip_eagle:
        lines += [
            f"EAGLE v2, stand-in head drafting at random, {args.eagle_steps} verify steps of "
            "six requests: accepted tokens per verify (bonus included); with drafting on, the "
            "draft rows against the same step's verify mask (ms per step, medians)",
            "",
            "| shape (topk, steps, nodes) | drafting | request-steps | tokens / verify | on / off "
            "| refused drafted nodes | draft rows ms | verify mask from them ms | library build "
            "ms | sglang build ms | draft rows / library build |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for shape_name in args.eagle_shapes.split(","):
            shape = EAGLE_SHAPES[shape_name]
            topk, depth, nodes = shape
            runs = {}
            with (
                _eagle.server_args(
                    speculative_algorithm="EAGLE", speculative_num_steps=depth,
                    speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes,
                    device="cpu",
                ),
                _draft.stand_in_preparations(),
            ):  # fmt: skip
                for drafting in (False, True):
                    print(f"EAGLE, {shape_name} {shape}, drafting {drafting}", flush=True)
                    runs[drafting] = eagle_run(args.backend, shape, drafting, args.eagle_steps)
            for drafting in (False, True):
                r = runs[drafting]
                ratio = r["per_step"] / runs[False]["per_step"]
                cost = (
                    f"{r['draft']:.3f} | {r['gather']:.3f} | {r['library']:.3f} | "
                    f"{r['sglang']:.3f} | {r['draft'] / r['library']:.2f}"
                    if drafting
                    else f"- | - | {r['library']:.3f} | {r['sglang']:.3f} | -"
                )
                refused = r["refused"]
                lines.append(
                    f"| {shape_name} {shape} | {'on' if drafting else 'off'} | "
                    f"{r['request_steps']} | {r['per_step']:.2f} | {ratio:.2f}x | {refused} | "
                    f"{cost} |"
                )
        lines.append("")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
