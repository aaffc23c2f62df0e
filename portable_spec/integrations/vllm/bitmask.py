"""vLLM's ``StructuredOutputManager.grammar_bitmask``, built by the library: the replacement
method, its two modes and its counters.

``on``: each speculative step's rows are written into vLLM's own buffer by the first path that
takes the step: xgrammar's or guidance's short path (the one of vLLM's backend first), else the
checked path; a step the library refuses (or a configuration it leaves alone) runs vLLM's own
fill. ``shadow``: both builds on every step, in alternating order, into separate buffers;
vLLM's rows are returned, every differing row is counted and logged with its request ids, and
both builds' times are kept (``state.STATS``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from portable_spec.integrations.telemetry import LogOnce
from portable_spec.integrations.vllm import internals
from portable_spec.integrations.vllm.checked import checked_rows, plan_step
from portable_spec.integrations.vllm.guidance import guidance_rows
from portable_spec.integrations.vllm.rows import Rows, stride_of
from portable_spec.integrations.vllm.state import INTEGRATION, LOG, LOG_EVERY_ENV_VAR, STATS
from portable_spec.integrations.vllm.xgrammar import fast_rows

__all__ = ["build_or_none", "replacement"]

_STATE = "_portable_spec"  # the plugin's per-manager state, kept on vLLM's manager
#: which path builds what: said once per process (reset_stats() does not say it again)
_ANNOUNCED = LogOnce(internals.logger)


class _ManagerState:
    """Per manager: what :func:`internals.bitmask_setup` said (the tensor it is about, its
    numpy view, K, whether guidance's short path goes first) and shadow mode's scratch
    buffer."""

    __slots__ = ("guidance", "k", "numpy", "scratch", "tensor")

    def __init__(self, tensor: Any, numpy: np.ndarray, k: int, guidance: bool) -> None:
        self.tensor, self.numpy, self.k, self.guidance = tensor, numpy, k, guidance
        self.scratch: np.ndarray | None = None


def replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``grammar_bitmask`` replaced: the rows built by the library (in the
    integration's mode, by the row layout of the release installed), vLLM's ``original`` for
    what the library leaves to it (all of it while the plugin is not installed)."""
    every = int(os.environ.get(LOG_EVERY_ENV_VAR, "1000") or 0)
    announced: list[bool] = []  # the first step says the plugin is on (vLLM's logging is set)

    def grammar_bitmask(
        self: Any,
        requests: dict[str, Any],
        structured_output_request_ids: list[str],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> Any:
        args = (requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        revision = INTEGRATION.revision
        if revision is None:
            return original(self, *args)
        layout = internals.LAYOUTS[revision]
        mode = INTEGRATION.mode
        if not announced:
            announced.append(True)
            internals.logger.info(
                "portable_spec: grammar_bitmask built by portable_spec (%s, %s rows, vLLM %s)",
                mode,
                layout,
                internals.version(),
            )
        n = len(structured_output_request_ids)
        calls = STATS.add("calls")
        if mode == "shadow":
            result = _shadow(self, original, args, calls, layout)
        else:
            start = time.perf_counter()
            built = build_or_none(self, *args, layout=layout)
            elapsed = time.perf_counter() - start
            if built is None:
                if n:
                    STATS.add("fallback_steps")
                result = original(self, *args)
            else:
                STATS.add("built")
                STATS.time("portable_spec", n, elapsed)
                result = built.rows
        if every > 0 and calls % every == 0:
            _log_summary()
        return result

    return grammar_bitmask


def _shadow(self: Any, original: Callable[..., Any], args: tuple, calls: int, layout: str) -> Any:
    """Both builds; vLLM's rows are returned. The order alternates call by call."""
    n = len(args[1])
    ours_first = calls % 2 == 0
    ours: Rows | None = None
    ours_seconds = 0.0
    if ours_first:
        start = time.perf_counter()
        ours = build_or_none(self, *args, layout=layout, copy=True)
        ours_seconds = time.perf_counter() - start
    start = time.perf_counter()
    theirs = original(self, *args)
    theirs_seconds = time.perf_counter() - start
    if not ours_first:
        start = time.perf_counter()
        ours = build_or_none(self, *args, layout=layout, copy=True)
        ours_seconds = time.perf_counter() - start
    if theirs is not None:
        STATS.time("vllm", n, theirs_seconds)
    if ours is None:
        if n:
            STATS.add("fallback_steps")
        return theirs
    STATS.add("built")
    STATS.time("portable_spec", n, ours_seconds)
    rows = ours.rows
    if theirs is None or rows.shape != theirs.shape:
        internals.logger.warning(
            "portable_spec shadow: shapes differ: %s vs vLLM's %s",
            rows.shape,
            None if theirs is None else theirs.shape,
        )
        STATS.add("rows_differing", len(rows))
        return theirs
    rows_differ = (rows != theirs).any(axis=1)
    if ours.unwritten:  # strided rows vLLM leaves as they were: nobody reads them
        rows_differ[ours.unwritten] = False
    differing = np.flatnonzero(rows_differ)
    STATS.add("rows_compared", len(rows) - len(ours.unwritten))
    if len(differing):
        STATS.add("rows_differing", len(differing))
        internals.logger.warning(
            "portable_spec shadow: %d of %d rows differ from vLLM's (rows %s; requests %s)",
            len(differing),
            len(rows),
            differing[:16].tolist(),
            args[1][:16],
        )
    return theirs


def _log_summary() -> None:
    snap = STATS.snapshot()
    mine, theirs = snap["median_us"]["portable_spec"], snap["median_us"]["vllm"]
    parts = [
        f"batch {n}: {mine[n]:.0f} us" + (f" vs vLLM {theirs[n]:.0f} us" if n in theirs else "")
        for n in mine
    ]
    internals.logger.info(
        "portable_spec: %d calls, %d built, %d fallback; rows compared %d, differing %d; "
        "median per call %s",
        snap["calls"],
        snap["built"],
        snap["fallback_steps"],
        snap["rows_compared"],
        snap["rows_differing"],
        "; ".join(parts) or "-",
    )


def _manager_state(manager: Any) -> _ManagerState | None:
    """The manager's state for its current bitmask tensor (made when the tensor changed), or
    None: vLLM's own fill keeps every step (diffusion models, no speculative tokens)."""
    state = getattr(manager, _STATE, None)
    if state is not None and state.tensor is internals.bitmask_tensor(manager):
        return state
    setup = internals.bitmask_setup(manager)
    if isinstance(setup, str):
        if setup:
            LOG.warning(setup, "portable_spec: %s models keep vLLM's own fill", setup)
        return None
    state = _ManagerState(*setup)
    setattr(manager, _STATE, state)
    return state


def build_or_none(
    manager: Any,
    requests: dict[str, Any],
    ids: Sequence[str],
    spec_tokens: dict[str, list[int]],
    layout: str = "packed",
    copy: bool = False,
) -> Rows | None:
    """vLLM's rows for this step built by the library, or None: vLLM's own fill takes it.

    Writes into vLLM's own buffer or, with ``copy``, into a scratch buffer of the same shape
    kept for the manager. ``layout``: ``"packed"`` (vLLM 0.32) or ``"strided"`` (0.33). Blocks
    until the rows are written; every matcher ends where it started.
    """
    if not ids:
        return None
    state = _manager_state(manager)
    if state is None:
        return None
    buffer = state.numpy
    if copy:
        if state.scratch is None:
            state.scratch = np.empty_like(buffer)
        buffer = state.scratch
    stride = stride_of(layout, state.k)
    paths = (guidance_rows, fast_rows) if state.guidance else (fast_rows, guidance_rows)
    for path in paths:
        try:
            rows = path(manager, requests, ids, spec_tokens, stride, buffer)
        except Exception:  # the checked path takes the step and names the problem
            rows = None
        if rows is not None:
            if path is guidance_rows:  # the library's chain build is slower than this fill
                _ANNOUNCED.info(
                    "guidance",
                    "portable_spec: guidance chains written by llguidance's own chain fill "
                    "(unsafe_compute_mask_ptr_with_draft_token, one call per request), vLLM's "
                    "row rule for guidance on top",
                )
            return rows
    try:
        plan = plan_step(manager, requests, ids, spec_tokens, stride - 1 if stride else None)
    except LookupError as exc:
        LOG.warning(f"backend:{exc}", "portable_spec: %s grammars keep vLLM's own fill", exc)
        return None
    try:
        return checked_rows(plan, buffer)
    except (ValueError, TypeError, RuntimeError) as exc:  # refused before any matcher moved
        LOG.warning(
            f"refused:{type(exc).__name__}",
            "portable_spec: build refused (%s): vLLM's own fill for such steps",
            exc,
        )
        return None
