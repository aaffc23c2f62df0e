"""Build counters and the slow-grammar warning.

Every build records where its time went (waiting for the tree's copy, walking the matchers,
starting the upload) and how many draft nodes the grammars refused, and how long each
request's walk took. A request slower than the threshold
is logged on the ``portable_spec`` logger (WARNING) with its index and time, and counted, so
an engine can alert on grammars that make its step time explode (deep recursion in a JSON
schema, huge alternations). Counters are process-wide and thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

import numpy as np

__all__ = [
    "get_slow_grammar_threshold",
    "grammar_stats",
    "reset_grammar_stats",
    "set_slow_grammar_threshold",
]

logger = logging.getLogger("portable_spec")

_lock = threading.Lock()
_COUNTERS = ("builds", "requests", "rows", "slow_requests", "checked_nodes", "rejected_nodes")
_SECONDS = (
    "build_seconds",
    "slowest_seconds",
    "last_slow_seconds",
    "tree_wait_seconds",
    "walk_seconds",
    "upload_seconds",
    "call_seconds",
)
_counters: dict[str, float] = {}
_threshold: float | None = None
# Counters the compiled chain build adds to itself (portable_spec.native's chain_masks), in
# this order; grammar_stats() folds them in. Touched with the GIL held only.
TALLY_FIELDS = (
    "builds",
    "requests",
    "rows",
    "build_seconds",
    "walk_seconds",
    "checked_nodes",
    "rejected_nodes",
    "slowest_seconds",
)
tally = np.zeros(len(TALLY_FIELDS), dtype=np.float64)


def _default_threshold() -> float | None:
    value = os.environ.get("PORTABLE_SPEC_SLOW_GRAMMAR_MS")
    if value is None:
        return 0.1
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(
            f"PORTABLE_SPEC_SLOW_GRAMMAR_MS must be a number of milliseconds, got {value!r}"
        ) from None
    return None if ms <= 0 else ms / 1e3


def reset_grammar_stats() -> None:
    """Zero every counter."""
    with _lock:
        _counters.clear()
        _counters.update(dict.fromkeys(_COUNTERS, 0))
        _counters.update(dict.fromkeys(_SECONDS, 0.0))
        _counters["last_slow_request"] = -1
        tally[:] = 0.0


def grammar_stats() -> dict[str, float]:
    """A snapshot of the counters since start (or the last reset).

    Keys:

    * ``builds`` (calls that built a mask), ``requests`` (constrained requests walked),
      ``rows`` (mask rows produced);
    * ``checked_nodes`` (draft nodes whose token a grammar was asked about: children of
      accepted, non-terminated nodes) and ``rejected_nodes`` (those the grammar refused;
      nodes below a refused one are not counted again): the grammar's share of rejected
      drafts is ``rejected_nodes / checked_nodes``;
    * where a blocking call's time went, wall clock, summed over calls:
      ``tree_wait_seconds`` (waiting for the tree's staged copy, and for whatever the
      device had to finish before it), ``walk_seconds`` (validation, matcher walks and row
      repair), ``upload_seconds`` (starting the mask's upload), ``call_seconds`` (the whole
      of :func:`portable_spec.build_grammar_vocab_mask`, the time its caller was blocked);
    * ``build_seconds`` (summed walk time of all requests, across threads),
      ``slowest_seconds`` (the slowest single walk), ``slow_requests`` (walks over the
      threshold), ``last_slow_request`` / ``last_slow_seconds`` (the latest slow walk's
      index in its batch and time; -1 / 0.0 when none).
    """
    with _lock:
        snapshot = dict(_counters)
        folded = tally.tolist()
    for name, value in zip(TALLY_FIELDS, folded, strict=True):
        if name == "slowest_seconds":
            snapshot[name] = max(snapshot[name], value)
        elif name.endswith("_seconds"):
            snapshot[name] += value
        else:
            snapshot[name] += int(value)
    return snapshot


def set_slow_grammar_threshold(seconds: float | None) -> None:
    """Warn about requests whose walk takes longer than ``seconds`` (None disables).

    The default is 0.1 s, or ``$PORTABLE_SPEC_SLOW_GRAMMAR_MS`` milliseconds when set (0 or
    less disables).
    """
    global _threshold
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0
    ):
        raise ValueError(f"threshold must be a positive number of seconds or None, got {seconds!r}")
    _threshold = seconds


def get_slow_grammar_threshold() -> float | None:
    """The current threshold in seconds (None: disabled)."""
    return _threshold


def record_upload(upload_seconds: float, call_seconds: float) -> None:
    """Account the upload of one built mask and the whole call that built it."""
    with _lock:
        _counters["upload_seconds"] += upload_seconds
        _counters["call_seconds"] += call_seconds


def record_build(
    walks: Iterable[tuple[int, float]],
    rows: int,
    *,
    wait_seconds: float = 0.0,
    walk_seconds: float = 0.0,
    checked_nodes: int = 0,
    rejected_nodes: int = 0,
) -> None:
    """Account one build: ``walks`` holds ``(request index, seconds)`` per constrained request;
    the keywords are the build's phases (wall clock) and its draft-node counts."""
    threshold = _threshold
    slow = []
    total = 0.0
    slowest = 0.0
    count = 0
    for index, seconds in walks:
        count += 1
        total += seconds
        slowest = max(slowest, seconds)
        if threshold is not None and seconds > threshold:
            slow.append((index, seconds))
    with _lock:
        _counters["builds"] += 1
        _counters["requests"] += count
        _counters["rows"] += rows
        _counters["build_seconds"] += total
        _counters["tree_wait_seconds"] += wait_seconds
        _counters["walk_seconds"] += walk_seconds
        _counters["checked_nodes"] += checked_nodes
        _counters["rejected_nodes"] += rejected_nodes
        _counters["slowest_seconds"] = max(_counters["slowest_seconds"], slowest)
    if slow:
        note_slow(slow)


def note_slow(walks: list[tuple[int, float]]) -> None:
    """Count and log the ``(request index, seconds)`` walks over the threshold of one build."""
    threshold = _threshold or 0.0
    with _lock:
        _counters["slow_requests"] += len(walks)
        _counters["last_slow_request"], _counters["last_slow_seconds"] = walks[-1]
    for index, seconds in walks:
        logger.warning(
            "grammar of request %d took %.1f ms to walk its draft tree (threshold %.1f ms)",
            index,
            seconds * 1e3,
            threshold * 1e3,
        )


reset_grammar_stats()
_threshold = _default_threshold()
