"""A persistent, process-wide thread pool for per-request traversals.

The builder hands the pool one job per build: "process request indices 0..n-1". The calling
thread works on the job itself and up to ``threads - 1`` pool workers join it, each taking
the next index from a shared counter (cheap dynamic load balancing: requests whose drafts
the grammar accepts cost far more than rejected ones). xgrammar's traversal, called by the
compiled helper, releases the GIL, so the workers really run in parallel.

Several threads may build at once: each job is independent and its caller always makes
progress on it, so no job waits for workers busy with another one.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["WorkItemError", "get_num_threads", "run_indexed", "set_num_threads", "submit"]


class WorkItemError(Exception):
    """Raised by :func:`run_indexed` when ``fn(index)`` raised; wraps the original."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class _Job:
    __slots__ = ("count", "counter", "done", "error", "finished", "fn", "lock")

    def __init__(self, fn: Callable[[int], None], count: int) -> None:
        self.fn = fn
        self.count = count
        self.counter = itertools.count()
        self.lock = threading.Lock()
        self.finished = 0
        self.done = threading.Event()
        self.error: WorkItemError | None = None

    def work(self) -> None:
        """Take indices until none are left; every taken index is counted as finished."""
        fn, count, counter = self.fn, self.count, self.counter
        while True:
            index = next(counter)  # atomic under the GIL
            if index >= count:
                return
            if self.error is None:
                try:
                    fn(index)
                except BaseException as exc:
                    with self.lock:
                        if self.error is None or index < self.error.index:
                            self.error = WorkItemError(index, exc)
            with self.lock:
                self.finished += 1
                if self.finished == count:
                    self.done.set()


class _Pool:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _ensure_workers(self, wanted: int) -> None:
        if len(self._workers) >= wanted:
            return
        with self._lock:
            while len(self._workers) < wanted:
                t = threading.Thread(
                    target=self._loop,
                    name=f"portable_spec-worker-{len(self._workers)}",
                    daemon=True,
                )
                t.start()
                self._workers.append(t)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.work()
            job = None  # what the job references is freed now, not at the next job

    def run(self, fn: Callable[[int], None], count: int, helpers: int) -> None:
        job = _Job(fn, count)
        helpers = min(helpers, self.threads - 1, count - 1)
        if helpers > 0:
            self._ensure_workers(helpers)
            for _ in range(helpers):
                self._queue.put(job)
        job.work()
        job.done.wait()
        if job.error is not None:
            raise job.error from job.error.error

    def shutdown(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for _ in workers:
            self._queue.put(None)
        for t in workers:
            t.join(timeout=5.0)

    def live_workers(self) -> int:
        return sum(t.is_alive() for t in self._workers)


_pool_lock = threading.Lock()
_pool: _Pool | None = None


def _threads_from_env() -> int:
    value = os.environ.get("PORTABLE_SPEC_NUM_THREADS")
    if value:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(
                f"PORTABLE_SPEC_NUM_THREADS must be a positive integer, got {value!r}"
            ) from None
        if n >= 1:
            return n
        raise ValueError(f"PORTABLE_SPEC_NUM_THREADS must be a positive integer, got {value!r}")
    return _usable_cores()


def _get_pool() -> _Pool:
    global _pool
    pool = _pool
    if pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = _Pool(_threads_from_env())
            pool = _pool
    return pool


def set_num_threads(threads: int | None) -> None:
    """Set how many threads (the caller included) traverse requests in parallel.

    ``None`` restores the default: ``$PORTABLE_SPEC_NUM_THREADS`` if set, else the number of
    cores this process may run on. Workers of the previous setting are stopped.
    """
    global _pool
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    with _pool_lock:
        old, _pool = _pool, _Pool(threads if threads is not None else _threads_from_env())
    if old is not None:
        old.shutdown()


def get_num_threads() -> int:
    """How many threads (the caller included) a build may use."""
    return _get_pool().threads


def pool_stats() -> dict[str, int]:
    """``{"threads": configured, "workers": live worker threads}`` (for soak tests)."""
    pool = _get_pool()
    return {"threads": pool.threads, "workers": pool.live_workers()}


def run_indexed(fn: Callable[[int], None], count: int, *, parallel: bool) -> None:
    """Call ``fn(i)`` for ``i in range(count)``, on the pool when ``parallel``.

    Blocks until every call has returned. If calls raise, the one with the smallest index is
    re-raised as :class:`WorkItemError`; indices not yet started when an error is seen are
    skipped. Calls already running always finish.
    """
    if count <= 0:
        return
    pool = _get_pool()
    if not parallel or pool.threads <= 1 or count == 1:
        for index in range(count):
            try:
                fn(index)
            except BaseException as exc:
                raise WorkItemError(index, exc) from exc
        return
    pool.run(fn, count, pool.threads - 1)


# -- the background lane: whole builds started with wait=False -------------------------------
class _Lane:
    """One persistent thread running submitted calls one after the other.

    A build started without waiting runs here as the *caller* of its pool job, so the pool's
    ``threads - 1`` workers join it exactly as they join a blocking build; the engine's
    thread is free meanwhile.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None]) -> threading.Event:
        """Queue ``fn`` (which must not raise); the event is set once it has returned."""
        finished = threading.Event()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="portable_spec-background", daemon=True
                )
                self._thread.start()
            self._queue.put((fn, finished))
        return finished

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, finished = item
            try:
                fn()
            finally:
                finished.set()
                # drop the call before waiting for the next one: what it returns or holds
                # (a dropped handle's mask) must be freed when it ends, not at the next submit
                item = fn = finished = None  # type: ignore[assignment]

    def shutdown(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=5.0)


_lane = _Lane()


def submit(fn: Callable[[], None]) -> threading.Event:
    """Run ``fn()`` on the library's background thread (calls run in submission order; ``fn``
    may use :func:`run_indexed`, whose workers then help it). ``fn`` must catch its own
    exceptions. Returns an event set once ``fn`` has returned."""
    return _lane.submit(fn)


def _shutdown_at_exit() -> None:
    _lane.shutdown()
    pool = _pool
    if pool is not None:
        pool.shutdown()


def _reset_after_fork() -> None:
    # Threads do not survive fork(); the child starts with a fresh, empty pool.
    global _pool, _pool_lock, _lane
    _pool_lock = threading.Lock()
    _lane = _Lane()
    if _pool is not None:
        _pool = _Pool(_pool.threads)


atexit.register(_shutdown_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
