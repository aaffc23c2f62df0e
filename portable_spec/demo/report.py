"""Turn a :class:`~portable_spec.demo.engine.Generation` into the CLI's lines and JSON record."""

from __future__ import annotations

from typing import Any

from portable_spec.demo.engine import Generation, StepReport

__all__ = ["progress_line", "record", "summary_line"]


def progress_line(index: int, step: StepReport, total: int) -> str:
    """One step, for stderr: tokens committed, draft/mask/verify times, mask overlap."""
    hidden = 100.0 * step.hidden_ms / step.mask_build_ms if step.mask_build_ms > 0 else 100.0
    return (
        f"step {index:3d}  +{len(step.tokens)} -> {total:4d} tokens   draft {step.draft_ms:7.1f} ms"
        f"   mask {step.mask_build_ms:6.2f} ms ({hidden:3.0f}% hidden)"
        f"   verify {step.verify_ms:7.1f} ms"
    )


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
    the bonus token); ``mask_hidden_fraction`` is the share of the total mask build time
    during which the verify forward was still running.
    """
    steps = gen.steps
    out: dict[str, Any] = {
        "text": text,
        "tokens": list(gen.tokens),
        "steps": len(steps),
        "accepted_per_step": gen.accepted_per_step,
        "mean_accepted": round(gen.mean_accepted, 4),
        "tokens_per_s": round(gen.tokens_per_s, 3),
        "mask_build_ms": [round(s.mask_build_ms, 4) for s in steps],
        "verify_ms": [round(s.verify_ms, 3) for s in steps],
        "draft_ms": [round(s.draft_ms, 3) for s in steps],
        "mask_hidden_ms": [round(s.hidden_ms, 4) for s in steps],
        "mask_hidden_fraction": round(gen.hidden_fraction, 4),
        "finished": gen.finished,
        "prefill_s": round(gen.prefill_s, 4),
        "decode_s": round(gen.decode_s, 4),
    }
    out.update(extra)
    return out
