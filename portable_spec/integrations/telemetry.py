"""Telemetry every engine integration keeps in one shape: :class:`Stats` (the counters, series
and per-batch timings behind each package's ``integration_stats()``) and :class:`LogOnce` (a
line per kind of event, once per process, in the engine's log). Both are thread-safe and never
block on a device; each package's ``reset_stats()`` resets both.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LogOnce", "Stats"]


class LogOnce:
    """Log each kind of event once per process (until :meth:`reset`): a step an integration
    leaves to the engine's own code says why the first time only. Thread-safe."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, key: str) -> bool:
        """True the first time ``key`` is asked for (since the last :meth:`reset`). Takes no
        lock once ``key`` was seen (a step's hot path may ask every time)."""
        if key in self._seen:
            return False
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    def warning(self, key: str, message: str, *args: Any) -> None:
        """``logger.warning(message, *args)`` the first time ``key`` is seen."""
        if self.first(key):
            self.logger.warning(message, *args)

    def info(self, key: str, message: str, *args: Any) -> None:
        """``logger.info(message, *args)`` the first time ``key`` is seen."""
        if self.first(key):
            self.logger.info(message, *args)

    def reset(self) -> None:
        """Every kind may be logged again."""
        with self._lock:
            self._seen.clear()


class Stats:
    """Thread-safe counters, bounded series and per-batch timings of one integration.

    ``counters``: names counted with :meth:`add`; ``series``: names whose last ``history``
    values :meth:`sample` keeps (seconds waited, rows per step...); :meth:`time` keeps the
    last ``history`` durations per build name and batch size; ``builds``: build names listed
    in every snapshot, timed or not (an integration's own and the engine's, say).
    :meth:`snapshot` never blocks.
    """

    def __init__(
        self,
        counters: Sequence[str],
        series: Sequence[str] = (),
        *,
        builds: Sequence[str] = (),
        history: int = 4096,
    ) -> None:
        self._names = tuple(counters)
        self._series_names = tuple(series)
        self._builds = tuple(builds)
        self._history = history
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._counters = dict.fromkeys(self._names, 0)
            self._series: dict[str, deque[float]] = {
                n: deque(maxlen=self._history) for n in self._series_names
            }
            self._times: dict[str, dict[int, deque[float]]] = {b: {} for b in self._builds}

    def add(self, name: str, n: int = 1) -> int:
        """Add ``n`` to counter ``name``; returns its new value (KeyError for an unknown name)."""
        with self._lock:
            value = self._counters[name] + n
            self._counters[name] = value
            return value

    def sample(self, name: str, value: float) -> None:
        with self._lock:
            self._series[name].append(value)

    def update(self, counts: Mapping[str, int], samples: Mapping[str, float] | None = None) -> None:
        """Several counters (``name: n``) and series values at once, under one lock (a step's
        bookkeeping in one call). Raises KeyError for an unknown name, counting nothing."""
        samples = samples or {}
        with self._lock:
            unknown = (counts.keys() - self._counters) | (samples.keys() - self._series)
            if unknown:
                raise KeyError(f"not counted here: {sorted(unknown)}")
            for name, n in counts.items():
                self._counters[name] += n
            for name, value in samples.items():
                self._series[name].append(value)

    def time(self, build: str, batch: int, seconds: float) -> None:
        with self._lock:
            per = self._times.setdefault(build, {})
            per.setdefault(batch, deque(maxlen=self._history)).append(seconds)

    def snapshot(self) -> dict[str, Any]:
        """``{counter: int, ..., series: [values], ..., "median_us": {build: {batch: µs}},
        "samples": {build: {batch: count}}}``."""
        with self._lock:
            snap: dict[str, Any] = dict(self._counters)
            snap.update({n: list(v) for n, v in self._series.items()})
            times = {b: {n: list(v) for n, v in per.items()} for b, per in self._times.items()}
        snap["median_us"] = {
            b: {n: statistics.median(v) * 1e6 for n, v in sorted(per.items()) if v}
            for b, per in times.items()
        }
        snap["samples"] = {
            b: {n: len(v) for n, v in sorted(per.items())} for b, per in times.items()
        }
        return snap
