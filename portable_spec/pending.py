"""Builds started with ``wait=False``: the handle, and the matchers such a build holds.

``build_grammar_vocab_mask(..., wait=False)`` checks its arguments, marks the request's matchers
as held, and queues the build and upload on the library's background thread (whose pool job the
workers join as for a blocking build). The caller gets a :class:`PendingMask` at once. Until
its ``result()`` returns, the build walks the matchers: any other build over one of them is
refused with a ``ValueError`` (a matcher walked by two builds at once would be corrupted), and
the caller must not touch them itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["PendingMask", "check_not_pending", "start_pending"]

_lock = threading.Lock()
_held: dict[int, Any] = {}  # id(matcher) -> matcher, while a pending build walks it
_local = threading.local()  # .own: ids held by the build the current thread runs


def _conflict(grammars: Iterable[Any], exempt: frozenset[int] | set[int]) -> int | None:
    for i, g in enumerate(grammars):
        if g is not None and id(g) not in exempt and _held.get(id(g)) is g:
            return i
    return None


def _refuse(index: int) -> ValueError:
    return ValueError(
        f"grammars[{index}] is being walked by a build started with wait=False that has not "
        "finished; call its result() before building over this matcher again (or touching it)"
    )


def pending_builds() -> bool:
    """Whether any ``wait=False`` build holds matchers right now."""
    return bool(_held)


def check_not_pending(grammars: Sequence[Any]) -> None:
    """Raise ``ValueError`` if a matcher of ``grammars`` is held by a pending build (other than
    the one the current thread runs). Free when no build is pending."""
    if not _held:
        return
    own = getattr(_local, "own", frozenset())
    with _lock:
        index = _conflict(grammars, own)
    if index is not None:
        raise _refuse(index)


class PendingMask:
    """A mask being built and uploaded in the background.

    Returned by :func:`portable_spec.build_grammar_vocab_mask` with ``wait=False``. The build
    owns the request's matchers until :meth:`result` returns: do not advance, roll back or fill
    them meanwhile, and do not pass them to another build (refused with ``ValueError``).
    """

    __slots__ = ("_error", "_finished", "_value")

    def __init__(self) -> None:
        self._finished = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the build and the start of its upload have finished (never blocks)."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the build; return what a blocking call would have returned (the backend's
        mask, a ``CompactMask``, or ``None``), or raise what it would have raised.

        Blocks the calling thread until the build is done, at most ``timeout`` seconds
        (``TimeoutError`` after that; the build goes on). Errors keep their type
        (``TypeError``/``ValueError`` for bad grammars or trees, ``MatcherError`` for a
        matcher that raised); every matcher is then back in its state. Once it returns, the
        matchers are the caller's again.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the mask build did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<portable_spec.PendingMask {state}>"


def start_pending(
    grammars: Sequence[Any],
    build: Callable[[], Any],
    context: Callable[[], AbstractContextManager[Any]],
    submit: Callable[[Callable[[], None]], Any],
) -> PendingMask:
    """Hold ``grammars``' matchers, then ``submit`` a call of ``build()`` inside ``context()``
    (the caller's CUDA stream, JAX default device, ...) that stores its outcome in the handle
    and releases the matchers before the handle reports done.

    Raises ``ValueError`` (nothing queued) if a matcher is held by another pending build.
    """
    handle = PendingMask()
    mine = {id(g): g for g in grammars if g is not None}
    with _lock:
        index = _conflict(grammars, frozenset())
        if index is not None:
            raise _refuse(index)
        _held.update(mine)
    own = frozenset(mine)

    def run() -> None:
        _local.own = own
        try:
            with context():
                handle._value = build()
        except BaseException as exc:  # handed to result()
            handle._error = exc
        finally:
            _local.own = frozenset()
            with _lock:
                for key, matcher in mine.items():
                    if _held.get(key) is matcher:
                        del _held[key]
            handle._finished.set()

    try:
        submit(run)
    except BaseException:
        with _lock:
            for key in mine:
                _held.pop(key, None)
        raise
    return handle


def _forget_after_fork() -> None:
    # the threads of pending builds do not survive fork(): the child holds no matcher
    global _lock
    _lock = threading.Lock()
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
