"""Turn a :class:`~examples.demo.engine.Generation` into the CLI's lines and JSON record."""

from __future__ import annotations

from typing import Any

from examples.demo.engine import Generation, StepReport

__all__ = ["compare_lines", "progress_line", "record", "summary_line"]


def progress_line(index: int, step: StepReport, total: int) -> str:
    """One step, for stderr: tokens committed, drafted and grammar-valid nodes,
    draft/mask/verify times, mask overlap."""
    hidden = 100.0 * step.hidden_ms / step.mask_build_ms if step.mask_build_ms > 0 else 100.0
    nodes = (
        f"   nodes {step.valid_nodes:2d}/{step.draft_nodes:2d} valid" if step.draft_nodes else ""
    )
    return (
        f"step {index:3d}  +{len(step.tokens)} -> {total:4d} tokens{nodes}"
        f"   draft {step.draft_ms:7.1f} ms"
        f"   mask {step.mask_build_ms:6.2f} ms ({hidden:3.0f}% hidden)"
        f"   verify {step.verify_ms:7.1f} ms"
    )


def compare_lines(runs: list[tuple[str, Generation]]) -> list[str]:
    """``--compare``: one line per mode (tokens/s, tokens per step, drafted and valid nodes per
    step), the first mode being the baseline of the speed-up column."""
    base = runs[0][1].tokens_per_s
    width = max(36, *(len(name) for name, _ in runs))
    lines = [
        f"{'mode':{width}s} {'tokens':>6s} {'steps':>5s} {'tokens/s':>9s} {'tok/step':>8s} "
        f"{'drafted':>7s} {'valid':>6s} {'speed-up':>8s}"
    ]
    for name, gen in runs:
        steps = max(1, len(gen.steps))
        speedup = gen.tokens_per_s / base if base > 0 else float("nan")
        lines.append(
            f"{name:{width}s} {len(gen.tokens):6d} {len(gen.steps):5d} {gen.tokens_per_s:9.2f} "
            f"{gen.mean_accepted:8.2f} {sum(gen.draft_nodes_per_step) / steps:7.2f} "
            f"{sum(gen.valid_nodes_per_step) / steps:6.2f} {speedup:7.2f}x"
        )
    first = runs[0][1].tokens
    if any(gen.tokens != first for _, gen in runs[1:]):
        lines.append("note: the modes' outputs differ (float32 rounding in the tree forward)")
    return lines


def summary_line(gen: Generation) -> str:
    """Throughput, mean accepted length and mask overlap of a whole generation."""
    return (
        f"{len(gen.tokens)} tokens in {len(gen.steps)} steps, {gen.decode_s:.2f} s: "
        f"{gen.tokens_per_s:.1f} tokens/s, {gen.mean_accepted:.2f} tokens/step, "
        f"mask build {sum(s.mask_build_ms for s in gen.steps):.1f} ms "
        f"({100 * gen.hidden_fraction:.0f}% hidden behind verify)"
    )


def record(gen: Generation, text: str, **extra: Any) -> dict[str, Any]:
    """The ``--json`` object: the output, per-step lists (milliseconds) and summary figures.

    ``accepted_per_step`` counts the tokens each step committed (accepted draft tokens plus
    the bonus token); ``draft_nodes_per_step`` the drafted nodes of each step's verify tree and
    ``valid_nodes_per_step`` those whose root path the grammar accepts; ``draft_mask_ms`` the
    host time a grammar-aware drafter spent on grammar rows while drafting;
    ``mask_hidden_fraction`` is the share of the total mask build time during which the
    verify forward was still running.
    """
    steps = gen.steps
    out: dict[str, Any] = {
        "text": text,
        "tokens": list(gen.tokens),
        "steps": len(steps),
        "accepted_per_step": gen.accepted_per_step,
        "draft_nodes_per_step": gen.draft_nodes_per_step,
        "valid_nodes_per_step": gen.valid_nodes_per_step,
        "mean_accepted": round(gen.mean_accepted, 4),
        "tokens_per_s": round(gen.tokens_per_s, 3),
        "mask_build_ms": [round(s.mask_build_ms, 4) for s in steps],
        "verify_ms": [round(s.verify_ms, 3) for s in steps],
        "draft_ms": [round(s.draft_ms, 3) for s in steps],
        "draft_mask_ms": [round(s.draft_mask_ms, 4) for s in steps],
        "mask_hidden_ms": [round(s.hidden_ms, 4) for s in steps],
        "mask_hidden_fraction": round(gen.hidden_fraction, 4),
        "finished": gen.finished,
        "prefill_s": round(gen.prefill_s, 4),
        "decode_s": round(gen.decode_s, 4),
    }
    out.update(extra)
    return out
