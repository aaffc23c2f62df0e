"""The benchmark's tables: the JSON payload of :func:`tools.bench.runner.run` as Markdown."""

from __future__ import annotations

from typing import Any

from tools.bench.runner import targets as evaluate_targets

__all__ = ["print_tables"]


def print_tables(payload: dict[str, Any], file: Any) -> None:
    """Print the run's tables (Markdown) to ``file``."""
    from tools.bench import report

    meta = payload["meta"]
    cores = meta["cores"]
    busy = meta.get("other_processes_busy_cores_during_run")

    def out(text: str = "") -> None:
        print(text, file=file)

    out(f"# portable_spec benchmark ({cores} cores)")
    out()
    out(report.meta_lines(meta))
    if busy is not None:
        out(f"- other processes during the run (busy cores): {busy:.2f}")
    quiet = meta.get("quiet_policy")
    if quiet:
        out(
            f"- disturbed configurations (other processes > {quiet['threshold_cores']} cores) "
            f"measured again: {quiet['remeasured_configs']}, waiting {quiet['waited_s']:.0f} s "
            f"of a {quiet['wait_budget_s']:.0f} s budget"
        )
    out()
    out(
        "`bg`: cores other processes kept busy (on average) while that configuration ran; "
        "figures with a high `bg` are disturbed."
    )
    out()
    if payload["build"]:
        out(f"## Host mask build ({cores} cores, {meta['threads']} portable_spec threads)")
        out()
        out("Medians of interleaved rounds; `vs X` = X's median / portable_spec's median.")
        out()
        out(report.build_table(payload["build"]))
        out()
    if payload["targets"]:
        targets = evaluate_targets(payload)
        if any(t.met is not None for t in targets):
            out(f"## Targets ({cores} cores)")
            out()
            out(report.targets_table(targets, cores))
            out()
    if payload["staging"]:
        out(f"## Staging ({cores} cores)")
        out()
        out(report.staging_table(payload["staging"]))
        out()
    if payload["apply"]:
        out(f"## Apply ({cores} cores)")
        out()
        out(report.apply_table(payload["apply"]))
        out()
    if payload["overlap"]:
        out(f"## Overlap ({cores} cores)")
        out()
        out(report.overlap_table(payload["overlap"]))
        out()
    if payload.get("engines"):
        out(f"## Grammar engines ({cores} cores, {meta['threads']} portable_spec threads)")
        out()
        out(
            "Each engine against its own per-request, per-node loop (and llguidance's parallel "
            "chain fill on chains); `vs X` = X's median / portable_spec's median; \"engine's "
            "own\": a shape the integrations give to that fill of the engine's."
        )
        out()
        out(report.engines_table(payload["engines"]))
        out()
    if payload.get("chains"):
        out(f"## vLLM-style chains ({cores} cores, {meta['threads']} portable_spec threads)")
        out()
        out(
            "The strided chain build (K drafts + 1 bonus row per request, part of the batch "
            "still reasoning) against vLLM's serial per-token fill; `vs X` = X's median / "
            "portable_spec's median."
        )
        out()
        out(report.chains_table(payload["chains"]))
        out()
    if payload.get("forced"):
        from tools.bench.forced import forced_table

        out(f"## Forced drafts next to the verify mask's build ({cores} cores)")
        out()
        out(
            "`forced_drafts` on the schema workloads (K drafts at most per request, SmolLM2's "
            "tokenizer) against the build of the verify mask over the drafts it returned (K + 1 "
            "rows per request) and vLLM's serial fill of the same rows; medians of interleaved "
            "rounds, cold caches."
        )
        out()
        out(forced_table(payload["forced"]))
        out()
    if payload.get("layout"):
        from tools.bench.layouts import layout_apply_table, layout_table

        out(f"## Mask layouts: host build, bytes ({cores} cores, {meta['threads']} threads)")
        out()
        out(layout_table(payload["layout"]))
        out()
        applied = layout_apply_table(payload["layout"])
        if applied:
            out(f"## Mask layouts: apply ({cores} cores; float32 logits)")
            out()
            out(applied)
            out()
    if payload.get("async"):
        from tools.bench.layouts import async_table

        out(f"## wait=False ({cores} cores)")
        out()
        out(async_table(payload["async"]))
        out()
    if payload.get("percall"):
        from tools.bench.percall import percall_table

        out(f"## One call, batch 1, K=1 ({cores} cores)")
        out()
        out("Medians of interleaved rounds, microseconds per phase; see `--sections percall`.")
        out()
        out(percall_table(payload["percall"]))
        out()
    if payload.get("thresholds"):
        from tools.bench.thresholds import thresholds_table

        out(f"## Route thresholds: one thread against parts on the pool ({cores} cores)")
        out()
        out(
            "Medians of interleaved rounds, cold caches; `one / parts` above 1: the parts are "
            "faster; work in thousands of rows x (words + ROW_WORDS)."
        )
        out()
        out(thresholds_table(payload["thresholds"]))
        out()
    if payload.get("targets_runs"):
        from tools.bench.percall import issue_targets, percall_table
        from tools.bench.report import targets_table

        runs = payload["targets_runs"]
        out(f"## Per-call targets ({cores} cores, {meta['threads']} portable_spec threads)")
        out()
        out(
            "Every ratio is a peer's median over portable_spec's, measured in this run "
            "(interleaved rounds); fixed costs in microseconds."
        )
        out()
        out(targets_table(issue_targets(runs), cores))
        out()
        if runs.get("percall"):
            out(percall_table(runs["percall"]))
            out()
        if runs.get("chains"):
            out(report.chains_table(runs["chains"]))
            out()
