"""Builds started with ``wait=False``, and the table of the matchers builds are walking.

``build_grammar_vocab_mask(..., wait=False)`` checks its arguments, holds the request's
matchers, and queues the build and upload on the library's background thread (whose pool job
the workers join as for a blocking build). The caller gets a :class:`PendingMask` at once.
Until its ``result()`` returns, the build walks the matchers: any other build over one of them
is refused with a ``ValueError`` (a matcher walked by two builds at once would be corrupted),
and the caller must not touch them itself.

Blocking builds hold their matchers too, for as long as they walk them (the compiled builds in
C, the general build here), so that a build started meanwhile on another thread, blocking or
not, is refused instead of walking the same matcher. The table maps ``id(matcher)`` to the
token of the build holding it; an entry is made with one dictionary operation that tests and
enters together (``setdefault`` here, a test and an insert with no Python code in between in
the compiled helper), so two threads can never both take a matcher.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

__all__ = [
    "PendingMask",
    "check_not_pending",
    "held_table",
    "hold_matchers",
    "release_matchers",
    "start_pending",
]

_held: dict[int, Any] = {}  # id(matcher) -> the token of the build walking it
_local = threading.local()  # .own: ids held by the wait=False build the current thread runs


def held_table() -> dict[int, Any]:
    """The table itself (id(matcher) -> holder token), for the compiled builds to hold their
    matchers in (see :func:`portable_spec.native.configure`)."""
    return _held


def _conflict(grammars: Iterable[Any], exempt: frozenset[int] | set[int]) -> int | None:
    for i, g in enumerate(grammars):
        if g is not None and id(g) not in exempt and id(g) in _held:
            return i
    return None


def _refuse(index: int) -> ValueError:
    return ValueError(
        f"matchers[{index}] is being walked by another build that has not finished (one "
        "started with wait=False whose result() was not called yet, or one running on another "
        "thread); wait for it before building over this matcher again (or touching it)"
    )


def check_not_pending(grammars: Sequence[Any]) -> None:
    """Raise ``ValueError`` if a matcher of ``grammars`` is held by another build (other than
    the ``wait=False`` build the current thread runs). Free when no build holds any."""
    if not _held:
        return
    index = _conflict(grammars, getattr(_local, "own", frozenset()))
    if index is not None:
        raise _refuse(index)


def hold_matchers(grammars: Sequence[Any], exempt_own: bool = True) -> tuple[object, list[Any]]:
    """Hold the matchers of ``grammars`` (``None`` entries skipped) for a build: returns its
    ``(token, held)``, ``held`` the matchers entered (references: they cannot be freed, nor
    their ids reused, while held). Raises ``ValueError`` naming the first matcher another
    build holds, nothing held then. With ``exempt_own``, the matchers of the ``wait=False``
    build the current thread runs are taken as held already (not entered again). Pair with
    :func:`release_matchers`."""
    token = object()
    own = getattr(_local, "own", frozenset()) if exempt_own else frozenset()
    held: list[Any] = []
    for i, g in enumerate(grammars):
        if g is None or id(g) in own:
            continue
        if _held.setdefault(id(g), token) is not token:
            release_matchers(token, held)
            raise _refuse(i)
        held.append(g)
    return token, held


def release_matchers(token: object, held: list[Any]) -> None:
    """Release what :func:`hold_matchers` entered under ``token``."""
    for g in held:
        if _held.get(id(g)) is token:
            del _held[id(g)]


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

    Raises ``ValueError`` (nothing queued) if a matcher is held by another build.
    """
    handle = PendingMask()
    token, held = hold_matchers(grammars, exempt_own=False)
    own = frozenset(id(g) for g in held)

    def run() -> None:
        _local.own = own
        try:
            with context():
                handle._value = build()
        except BaseException as exc:  # handed to result()
            handle._error = exc
        finally:
            _local.own = frozenset()
            release_matchers(token, held)
            handle._finished.set()

    try:
        submit(run)
    except BaseException:
        release_matchers(token, held)
        raise
    return handle


def _forget_after_fork() -> None:
    # the threads of the builds do not survive fork(): the child holds no matcher
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
