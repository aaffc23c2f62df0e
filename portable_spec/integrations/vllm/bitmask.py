"""vLLM plugin: vLLM's structured-output bitmask for speculative decoding, built by portable_spec.

Install ``portable-spec[vllm]`` next to vLLM and set ``PORTABLE_SPEC_VLLM``:

* unset, empty, ``0`` or ``off``: nothing changes (installing the package alone never changes
  vLLM's behaviour);
* ``1`` or ``on``: ``StructuredOutputManager.grammar_bitmask`` builds the speculative rows of
  every step with :func:`portable_spec.build_host_bitmask` instead of vLLM's per-token loop;
* ``shadow``: both builds run on every step; vLLM's rows are the ones used, each row that
  differs is logged (``WARNING``), and both builds' per-call times are kept
  (:func:`plugin_stats`).

vLLM loads the plugin in each of its processes through the ``vllm.general_plugins`` entry
point, so the replacement reaches the EngineCore process, where the scheduler builds the mask.
``PORTABLE_SPEC_VLLM_LOG_EVERY`` (default 1000; 0 disables) logs a summary line (median
times, rows compared and differing) every that many calls. The build runs on the scheduler's
thread, as vLLM's own fill does (``PORTABLE_SPEC_NUM_THREADS`` gives it more threads).

What the plugin builds, and what it leaves to vLLM:

* vLLM 0.32 writes ``1 + len(drafts)`` rows per structured request, back to back, in the
  order of ``structured_output_request_ids``; the plugin writes the same rows into vLLM's own
  buffer. Any other vLLM version is refused with one log line and vLLM's own fill runs.
* Requests whose grammar comes from xgrammar, guidance (llguidance) or outlines are built
  with the grammar engine's matcher as vLLM holds it. A step with any other backend
  (lm-format-enforcer), diffusion models (no bonus row), configurations without speculative
  tokens, or a build the library refuses (a matcher in an error state, an outlines guide
  whose rollback window is too short) runs vLLM's own fill for that step.
* The common step (every request an xgrammar grammar the library has seen, no reasoning
  parser, no ``-1`` padding) takes a short path (``_vllm_fast``): the whole step in one
  compiled call (GIL released) that walks every request with xgrammar straight into vLLM's
  buffer and repairs its rows. A step whose requests are all guidance (llguidance) grammars,
  without a reasoning parser, takes guidance's short path (``_vllm_guidance``): one
  llguidance call per request writes its chain, with vLLM's rule for that backend (a draft
  is consumed when llguidance's parser takes it). Anything else goes through the checked
  path below.
* Reasoning models: each request's reasoning bounds come from vLLM's own
  ``_get_constraint_bounds`` (its per-request reasoner), so the rows follow vLLM's rule for
  every parser it has; the library's chain starts where vLLM's grammar starts.
"""

from __future__ import annotations

import bisect
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec.integrations._vllm_fast import fast_rows, may_reason
from portable_spec.integrations._vllm_guidance import guidance_rows

__all__ = [
    "ENV_VAR",
    "LOG_EVERY_ENV_VAR",
    "layout_for",
    "plugin_stats",
    "register",
    "reset_plugin_stats",
    "set_mode",
]

ENV_VAR = "PORTABLE_SPEC_VLLM"
LOG_EVERY_ENV_VAR = "PORTABLE_SPEC_VLLM_LOG_EVERY"
THREADS_ENV_VAR = "PORTABLE_SPEC_NUM_THREADS"  # the library's; the plugin's default is 1

#: vLLM releases whose row layout the plugin writes: "packed" (0.32: ``1 + len(drafts)`` rows
#: per request, back to back) or "strided" (0.33: request ``b``'s rows start at ``b * (K + 1)``;
#: its rows past ``1 + len(drafts)`` are not read, and vLLM leaves them unwritten).
LAYOUTS = {"0.32": "packed", "0.33": "strided"}

# A child of vLLM's logger: its lines come out with vLLM's own format and level.
logger = logging.getLogger("vllm.portable_spec")

# The attribute of vLLM's grammar wrapper that holds the grammar engine's matcher.
_MATCHER_ATTRS = {
    "XgrammarGrammar": "matcher",
    "GuidanceGrammar": "ll_matcher",
    "OutlinesGrammar": "guide",
}

_lock = threading.Lock()
# the library's packed chains (older releases of the library: padded rectangles)
_PACKED = hasattr(ps.GrammarTree, "from_packed_chains")
_HISTORY = 4096  # per-call times kept per batch size and build


def _new_stats() -> dict[str, Any]:
    return {
        "calls": 0,
        "built": 0,
        "fallback_steps": 0,
        "rows_compared": 0,
        "rows_differing": 0,
        "times": {"portable_spec": {}, "vllm": {}},
    }


_stats = _new_stats()
_current = {"mode": "off"}  # "off": the patched method calls vLLM's own and nothing else


def reset_plugin_stats() -> None:
    """Forget every counter and timing of this process."""
    global _stats
    with _lock:
        _stats = _new_stats()


def plugin_stats() -> dict[str, Any]:
    """A snapshot of this process's plugin counters (the EngineCore's, where the plugin runs).

    Returns a dict: ``calls`` (``grammar_bitmask`` calls seen), ``built`` (steps the library
    built), ``fallback_steps`` (steps given to vLLM's own fill), ``rows_compared`` and
    ``rows_differing`` (shadow mode), and ``median_us``: ``{build: {batch: median µs}}`` for
    ``build`` in ``"portable_spec"`` and ``"vllm"`` (vLLM's own fill: shadow mode only),
    ``batch`` being the number of structured requests in the call (the last 4096 calls per
    batch size). Never blocks on the engine.
    """
    with _lock:
        snap = {k: v for k, v in _stats.items() if k != "times"}
        snap["median_us"] = {
            name: {n: statistics.median(ts) * 1e6 for n, ts in sorted(per.items()) if ts}
            for name, per in _stats["times"].items()
        }
        snap["samples"] = {
            name: {n: len(ts) for n, ts in sorted(per.items())}
            for name, per in _stats["times"].items()
        }
    return snap


def _record(name: str, batch: int, seconds: float) -> None:
    per = _stats["times"][name]
    if batch not in per:
        per[batch] = deque(maxlen=_HISTORY)
    per[batch].append(seconds)


def _mode() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return None
    if value in ("1", "on", "true", "yes"):
        return "on"
    if value == "shadow":
        return "shadow"
    logger.warning("%s=%r is not one of 1, shadow, 0: the plugin stays off", ENV_VAR, value)
    return None


def layout_for(version: str) -> str | None:
    """The row layout of a vLLM version string (``"0.32.0"`` -> ``"packed"``), or None."""
    parts = version.split(".")
    return LAYOUTS.get(".".join(parts[:2]))


def register() -> None:
    """The ``vllm.general_plugins`` entry point: patch vLLM when ``PORTABLE_SPEC_VLLM`` asks.

    Runs in every vLLM process at start-up; does nothing (imports nothing of vLLM) while the
    variable is unset. Idempotent. With ``on``, tpu-inference's runner is patched too where
    tpu-inference runs (:mod:`portable_spec.integrations.tpu_inference`).
    """
    mode = _mode()
    if mode is None:
        return
    set_mode(mode)
    if mode == "on":
        from portable_spec.integrations import tpu_inference

        tpu_inference.register()


def set_mode(mode: str) -> bool:
    """Switch this process's plugin to ``"on"``, ``"shadow"`` or ``"off"`` at run time.

    The first switch to ``"on"`` or ``"shadow"`` patches vLLM's
    ``StructuredOutputManager.grammar_bitmask`` (in this process: with vLLM's in-process
    engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, that is the engine's); ``"off"`` makes the
    patched method call vLLM's own and nothing else. Returns whether the patch is in place
    (False on a vLLM version whose rows the plugin does not know). Non-blocking.
    """
    if mode not in ("on", "shadow", "off"):
        raise ValueError(f"mode must be 'on', 'shadow' or 'off', got {mode!r}")
    _current["mode"] = mode
    if mode == "off":
        return _is_patched()
    import vllm
    from vllm.v1.structured_output import StructuredOutputManager

    layout = layout_for(vllm.__version__)
    if layout is None:
        known = ", ".join(f"{v}.x" for v in LAYOUTS)
        logger.warning(
            "portable_spec: vLLM %s is not a version whose bitmask rows the plugin knows "
            "(%s): vLLM's own grammar_bitmask is used",
            vllm.__version__,
            known,
        )
        _current["mode"] = "off"
        return False
    original = StructuredOutputManager.grammar_bitmask
    if getattr(original, "_portable_spec", None) is None:
        StructuredOutputManager.grammar_bitmask = _patched(original, layout)
        if THREADS_ENV_VAR not in os.environ:
            # vLLM's own fill is serial on the scheduler's thread; worker threads would
            # compete with the engine's own (its CPU backend keeps its cores busy).
            ps.set_num_threads(1)
    logger.debug("portable_spec: vLLM %s patched (%s, %s rows)", vllm.__version__, mode, layout)
    return True


def _is_patched() -> bool:
    module = sys.modules.get("vllm.v1.structured_output")
    if module is None:
        return False
    method = module.StructuredOutputManager.grammar_bitmask
    return getattr(method, "_portable_spec", None) is not None


def _patched(original: Callable[..., Any], layout: str) -> Callable[..., Any]:
    every = int(os.environ.get(LOG_EVERY_ENV_VAR, "1000") or 0)
    announced = []  # the first call says the plugin is on (vLLM's logging is set up by then)

    def grammar_bitmask(
        self: Any,
        requests: dict[str, Any],
        structured_output_request_ids: list[str],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> Any:
        args = (requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        mode = _current["mode"]
        if mode == "off":
            return original(self, *args)
        if not announced:
            announced.append(True)
            logger.info(
                "portable_spec: grammar_bitmask built by portable_spec (%s, %s rows, vLLM %s)",
                mode,
                layout,
                sys.modules["vllm"].__version__,
            )
        n = len(structured_output_request_ids)
        with _lock:
            _stats["calls"] += 1
            calls = _stats["calls"]
        if mode == "shadow":
            result = _shadow(self, original, args, calls, layout)
        else:
            start = time.perf_counter()
            result = _build_or_none(self, *args, layout=layout)
            elapsed = time.perf_counter() - start
            if result is None:
                with _lock:
                    _stats["fallback_steps"] += int(n > 0)
                result = original(self, *args)
            else:
                with _lock:
                    _stats["built"] += 1
                    _record("portable_spec", n, elapsed)
        if every > 0 and calls % every == 0:
            _log_summary()
        return result

    grammar_bitmask._portable_spec = original  # type: ignore[attr-defined]
    grammar_bitmask.__doc__ = original.__doc__
    return grammar_bitmask


def _shadow(self: Any, original: Callable[..., Any], args: tuple, calls: int, layout: str) -> Any:
    """Both builds; vLLM's rows are returned. The order alternates call by call."""
    n = len(args[1])
    ours_first = calls % 2 == 0
    ours: np.ndarray | None = None
    ours_seconds = 0.0
    if ours_first:
        start = time.perf_counter()
        ours = _build_or_none(self, *args, layout=layout, copy=True)
        ours_seconds = time.perf_counter() - start
    start = time.perf_counter()
    theirs = original(self, *args)
    theirs_seconds = time.perf_counter() - start
    if not ours_first:
        start = time.perf_counter()
        ours = _build_or_none(self, *args, layout=layout, copy=True)
        ours_seconds = time.perf_counter() - start
    with _lock:
        if theirs is not None:
            _record("vllm", n, theirs_seconds)
        if ours is None:
            _stats["fallback_steps"] += int(n > 0)
            return theirs
        _stats["built"] += 1
        _record("portable_spec", n, ours_seconds)
    if theirs is None or ours.shape != theirs.shape:
        logger.warning(
            "portable_spec shadow: shapes differ: %s vs vLLM's %s",
            None if ours is None else ours.shape,
            None if theirs is None else theirs.shape,
        )
        with _lock:
            _stats["rows_differing"] += len(ours)
        return theirs
    rows_differ = (ours != theirs).any(axis=1)
    unwritten = getattr(self, "_portable_spec_unwritten", None)
    if unwritten:  # strided rows vLLM leaves as they were: nobody reads them
        rows_differ[unwritten] = False
    differing = np.flatnonzero(rows_differ)
    with _lock:
        _stats["rows_compared"] += len(ours) - len(unwritten or ())
        _stats["rows_differing"] += len(differing)
    if len(differing):
        logger.warning(
            "portable_spec shadow: %d of %d rows differ from vLLM's (rows %s; requests %s)",
            len(differing),
            len(ours),
            differing[:16].tolist(),
            args[1][:16],
        )
    return theirs


def _log_summary() -> None:
    snap = plugin_stats()
    mine, theirs = snap["median_us"]["portable_spec"], snap["median_us"]["vllm"]
    parts = [
        f"batch {n}: {mine[n]:.0f} us" + (f" vs vLLM {theirs[n]:.0f} us" if n in theirs else "")
        for n in mine
    ]
    logger.info(
        "portable_spec: %d calls, %d built, %d fallback; rows compared %d, differing %d; "
        "median per call %s",
        snap["calls"],
        snap["built"],
        snap["fallback_steps"],
        snap["rows_compared"],
        snap["rows_differing"],
        "; ".join(parts) or "-",
    )


def _inner_matcher(grammar: Any) -> Any:
    """The grammar engine's matcher inside vLLM's wrapper, or raise LookupError."""
    attr = _MATCHER_ATTRS.get(type(grammar).__name__)
    if attr is None:
        raise LookupError(type(grammar).__name__)
    return getattr(grammar, attr)


_warned: set[str] = set()
_announced: set[str] = set()  # the short paths whose use was logged


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _build_or_none(
    self: Any,
    requests: dict[str, Any],
    ids: Sequence[str],
    spec_tokens: dict[str, list[int]],
    layout: str = "packed",
    copy: bool = False,
) -> np.ndarray | None:
    """vLLM 0.32's rows for this step, built by the library; None: give the step to vLLM.

    Writes into vLLM's own buffer (``self._grammar_bitmask``), or with ``copy`` into a
    scratch buffer of the same shape, and returns the int32 ``[rows, words]`` view written.
    """
    if not ids:
        return None
    setup = getattr(self, "_portable_spec_setup", None)
    if setup is None or setup[0] is not self._grammar_bitmask:
        setup = _setup(self)
        if setup is None:
            return None
    _, buffer, k, guidance = setup
    if copy:  # shadow mode: a buffer of the same size, kept on the manager
        scratch = getattr(self, "_portable_spec_scratch", None)
        if scratch is None or scratch.shape != buffer.shape:
            scratch = self._portable_spec_scratch = np.empty_like(buffer)
        buffer = scratch
    stride_k = k if layout == "strided" else None
    out = _short_path(self, requests, ids, spec_tokens, stride_k, buffer, guidance)
    if out is not None:
        return out
    try:
        plan = _plan(self, requests, ids, spec_tokens, stride_k)
    except LookupError as exc:
        _warn_once(f"backend:{exc}", "portable_spec: %s grammars keep vLLM's own fill", exc)
        return None
    out = buffer[: plan.total]
    self._portable_spec_unwritten = plan.unwritten
    try:
        _fill(plan, out)
    except (ValueError, TypeError, RuntimeError) as exc:  # refused before any matcher moved
        _warn_once(
            f"refused:{type(exc).__name__}",
            "portable_spec: build refused (%s): vLLM's own fill for such steps",
            exc,
        )
        return None
    return out


def _short_path(
    self: Any,
    requests: dict[str, Any],
    ids: Sequence[str],
    spec_tokens: dict[str, list[int]],
    stride_k: int | None,
    buffer: np.ndarray,
    guidance: bool,
) -> np.ndarray | None:
    """The common step's rows by the short path of its backend (xgrammar's, or guidance's,
    tried first when vLLM's backend is guidance), or None: the checked path takes the step
    (and names what went wrong)."""
    for path in (_guidance, fast_rows) if guidance else (fast_rows, _guidance):
        try:
            out = path(self, requests, ids, spec_tokens, stride_k, buffer)
        except Exception:  # the checked path takes the step and names the problem
            out = None
        if out is not None:
            return out
    return None


def _guidance(
    self: Any,
    requests: dict[str, Any],
    ids: Sequence[str],
    spec_tokens: dict[str, list[int]],
    stride_k: int | None,
    buffer: np.ndarray,
) -> np.ndarray | None:
    got = guidance_rows(self, requests, ids, spec_tokens, stride_k, buffer)
    if got is None:
        return None
    if "guidance" not in _announced:  # the library's chain build is slower than this fill
        _announced.add("guidance")
        logger.info(
            "portable_spec: guidance chains written by llguidance's own chain fill "
            "(unsafe_compute_mask_ptr_with_draft_token, one call per request), vLLM's row "
            "rule for guidance on top"
        )
    out, self._portable_spec_unwritten = got
    return out


def _setup(self: Any) -> tuple[Any, np.ndarray, int, bool] | None:
    """What stays the same for the engine's life, read once per manager: vLLM's bitmask
    buffer (allocated as vLLM does when missing), its numpy view, the number of speculative
    tokens and whether vLLM's backend is guidance (its short path then tried first). None:
    vLLM's own fill (a diffusion model, or no speculative tokens)."""
    config = self.vllm_config
    if config.model_config.is_diffusion:
        _warn_once("diffusion", "portable_spec: diffusion models keep vLLM's own fill")
        return None
    k = config.num_speculative_tokens
    if not k:
        return None  # no speculative rows: vLLM's own (parallel) fill
    tensor = self._grammar_bitmask
    if tensor is None:  # vLLM's own buffer, allocated as vLLM does
        tensor = self._grammar_bitmask = self.backend.allocate_token_bitmask(
            config.scheduler_config.max_num_seqs * (1 + k)
        )
    guidance = type(getattr(self, "backend", None)).__name__ == "GuidanceBackend"
    setup = (tensor, tensor.numpy(), k, guidance)
    self._portable_spec_setup = setup
    return setup


class _Plan:
    """One step's chains: segments back to back, a segment per grammar span or free span."""

    __slots__ = (
        "ends",
        "forced",
        "grammar_segments",
        "masked",
        "matchers",
        "offsets",
        "tokens",
        "total",
        "unwritten",
        "xgrammar_only",
    )

    def __init__(self) -> None:
        self.matchers: list[Any] = []  # one per segment; None: all-allowed rows
        self.tokens: list[int] = []  # segment chains back to back, root first
        self.offsets: list[int] = [0]  # first row of each segment, then the total
        self.ends: list[int] = []  # per segment: one past the request's last row
        self.forced: list[int] = []  # rows vLLM leaves all-allowed inside a grammar segment
        self.masked: list[tuple[int, int, tuple[int, ...]]] = []  # reasoning rows, banned ids
        self.unwritten: list[int] = []  # strided: rows past a request's chain
        self.grammar_segments: list[int] = []  # segments with a matcher and drafts
        self.xgrammar_only = True  # every matcher an xgrammar one (the build flags the nodes)
        self.total = 0

    def add(self, matcher: Any, chain: Sequence[int], end: int) -> None:
        if matcher is not None and len(chain) > 1:
            self.grammar_segments.append(len(self.matchers))
        self.matchers.append(matcher)
        self.tokens.extend(chain)
        self.total += len(chain)
        self.offsets.append(self.total)
        self.ends.append(end)


def _plan(
    self: Any, requests: dict[str, Any], ids: Sequence[str], spec: dict, stride_k: int | None
) -> _Plan:
    """vLLM's row rule per request, as chain segments for the library's packed build.

    Per request with ``m`` scheduled tokens (``-1`` padding included) vLLM writes ``m + 1``
    rows; with ``p`` the first padding position (or ``m``) and ``(g, c)`` its constraint
    bounds, the grammar consumes tokens ``g .. p-1`` and fills rows ``c .. p`` (``c`` is ``g``
    or ``g + 1``); every other row is all-allowed. So: a free segment of ``g`` rows, a
    grammar chain rooted at row ``g`` over tokens ``g .. p-1`` (row ``g`` forced all-allowed
    when ``c > g``), a free segment for the rows after ``p``. With ``stride_k`` (0.33's
    strided layout) each request's block is ``stride_k + 1`` rows (the rows past ``m`` are
    free and listed as unwritten), and its reasoning rows (``i < c``, ``i <= p``) ban the
    implicit reasoning ends vLLM's ``_masked_reasoning_ends`` names.

    Without a reasoner (vLLM's bounds are then ``(0, 0)`` for every request) and without
    padding, a request is one chain rooted at its first row: no bounds call, no splitting.
    """
    plan = _Plan()
    bounds = self._get_constraint_bounds
    reasoning = may_reason(self)
    for req_id in ids:
        request = requests[req_id]
        grammar = request.structured_output_request.grammar
        matcher = _inner_matcher(grammar)
        tokens = spec.get(req_id) or []
        m = len(tokens)
        start = plan.total
        end = start + m + 1
        if not reasoning and (not m or min(tokens) >= 0):  # the common case
            if grammar.is_terminated():
                plan.add(None, [0] * (m + 1), end)
            else:
                plan.add(matcher, [0, *tokens], end)
                plan.xgrammar_only &= type(grammar).__name__ == "XgrammarGrammar"
            if stride_k is not None:
                _finish_request(self, plan, request, start, m, m, 0, stride_k)
            continue
        p = next((i for i, t in enumerate(tokens) if t < 0), m)
        g, c = bounds(request, tokens[:p])
        if grammar.is_terminated() or g > p or c > p:
            plan.add(None, [0] * (m + 1), end)
            _finish_request(self, plan, request, start, m, p, c, stride_k)
            continue
        if g > 0:
            plan.add(None, [0] * g, end)
        if c > g:
            plan.forced.append(start + g)
        plan.add(matcher, [0, *tokens[g:p]], end)
        plan.xgrammar_only &= type(grammar).__name__ == "XgrammarGrammar"
        if p < m:
            plan.add(None, [0] * (m - p), end)
        _finish_request(self, plan, request, start, m, p, c, stride_k)
    return plan


def _finish_request(
    self: Any, plan: _Plan, request: Any, start: int, m: int, p: int, c: int, stride_k: int | None
) -> None:
    """Strided layout: reasoning-row bans and the block's unread tail."""
    if stride_k is None:
        return
    if c > 0:
        banned = self._masked_reasoning_ends(request)
        if banned:
            plan.masked.append((start, start + min(c, p + 1), tuple(banned)))
    tail = stride_k - m
    if tail > 0:
        plan.unwritten.extend(range(start + m + 1, start + m + 1 + tail))
        plan.add(None, [0] * tail, start + m + 1 + tail)


def _fill(plan: _Plan, out: np.ndarray) -> None:
    """Write the plan's rows into ``out`` ([plan.total, words] int32)."""
    vocab = out.shape[1] * 32
    # xgrammar builds flag their refused nodes themselves (the compiled repair writes them):
    # no pass over the rows to find the refused drafts
    flag = plan.xgrammar_only and bool(plan.grammar_segments)
    valid = _build_rows(plan.matchers, plan.tokens, plan.offsets, vocab, out, flag)
    for row in plan.forced:
        out[row] = -1
    if plan.masked:
        bits = out.view(np.uint32)
        for lo, hi, banned in plan.masked:
            ids = np.asarray(banned, dtype=np.int64)
            bits[lo:hi, ids >> 5] &= ~(np.uint32(1) << (ids & 31).astype(np.uint32))
    if not plan.grammar_segments:
        return
    if valid is None:
        _repeat_after_refused(plan, out)
    elif not valid.all():
        _repeat_after_invalid(plan, out, valid)


def _repeat_after_invalid(plan: _Plan, out: np.ndarray, valid: np.ndarray) -> None:
    """:func:`_repeat_after_refused` from the build's node flags (``valid``: bool
    ``[plan.total]``): a grammar segment's first node the build did not accept is its first
    refused draft (or a draft after a terminated node, whose rows are all-allowed either way);
    free segments' nodes are all accepted."""
    offsets, done = plan.offsets, set()
    for row in np.flatnonzero(~valid).tolist():
        s = bisect.bisect_right(offsets, row) - 1
        if s in done or plan.matchers[s] is None or row == offsets[s]:
            continue
        done.add(s)
        out[row : plan.ends[s]] = out[row - 1]


def _repeat_after_refused(plan: _Plan, out: np.ndarray) -> None:
    """vLLM repeats the row before a refused draft on every later row of the request (its
    own loop stops advancing there); the library leaves them all-allowed. A draft is refused
    where its bit is clear in its parent's final row (rows all-allowed after a terminated or
    refused node let every token through, and there vLLM's repeated row is all-allowed too).
    """
    offsets, tokens = plan.offsets, plan.tokens
    rows, drafts = [], []
    for s in plan.grammar_segments:
        lo, hi = offsets[s], offsets[s + 1]
        rows.extend(range(lo, hi - 1))
        drafts.extend(tokens[lo + 1 : hi])
    parent = np.asarray(rows, dtype=np.int64)
    token = np.asarray(drafts, dtype=np.int64)
    words = out.shape[1]
    inside = token < words * 32
    word = out.view(np.uint32)[parent, np.where(inside, token >> 5, 0)]
    allowed = inside & ((word >> (token & 31).astype(np.uint32)) & 1).astype(bool)
    if allowed.all():
        return
    refused = set(np.flatnonzero(~allowed).tolist())
    i = 0
    for s in plan.grammar_segments:
        lo, hi = offsets[s], offsets[s + 1]
        for j in range(hi - lo - 1):
            if i + j in refused:
                first = lo + 1 + j
                out[first : plan.ends[s]] = out[first - 1]
                break
        i += hi - lo - 1


def _build_rows(
    matchers: list[Any],
    tokens: list[int],
    offsets: list[int],
    vocab: int,
    out: np.ndarray,
    flag: bool = False,
) -> np.ndarray | None:
    """Packed chains (segment ``s``: ``tokens[offsets[s]:offsets[s+1]]``, root first) ->
    their rows written into ``out``; with ``flag``, returns the build's accepted nodes (bool
    ``[offsets[-1]]``), else None.

    With the library's packed chains (``GrammarTree.from_packed_chains``) the rows are
    written in place; otherwise the chains go in as a ``[segments, width]`` rectangle: in
    place when every chain is as long, else padded with ``-1`` and the rows gathered.
    """
    flat = np.array(tokens, dtype=np.int64)
    segments = len(matchers)
    if _PACKED:
        tree = ps.GrammarTree.from_packed_chains(flat, np.array(offsets, dtype=np.int64))
        if not flag:
            if ps.build_host_bitmask(matchers, tree, vocab, out=out) is None:
                out[:] = -1
            return None
        mask, valid = ps.build_host_bitmask(matchers, tree, vocab, out=out, return_valid=True)
        if mask is None:
            out[:] = -1
        return valid
    lengths = np.diff(offsets)
    width = int(lengths.max())
    if width * segments == len(flat):  # every chain as long: the rows are already packed
        tree = ps.GrammarTree.from_linear_chain(flat.reshape(segments, width))
        if ps.build_host_bitmask(matchers, tree, vocab, out=out) is None:
            out[:] = -1
        return
    chains = np.full((segments, width), -1, dtype=np.int64)
    seg = np.repeat(np.arange(segments), lengths)
    pos = np.arange(len(flat)) - np.repeat(np.asarray(offsets[:-1]), lengths)
    chains[seg, pos] = flat
    mask = ps.build_host_bitmask(matchers, ps.GrammarTree.from_linear_chain(chains), vocab)
    if mask is None:
        out[:] = -1
        return
    out[:] = mask.reshape(segments, width, -1)[seg, pos]
