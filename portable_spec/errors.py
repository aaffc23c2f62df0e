"""Exceptions raised by the builder besides ``TypeError``/``ValueError`` for bad input."""

from __future__ import annotations

__all__ = ["MatcherError"]


class MatcherError(RuntimeError):
    """A request's grammar matcher raised while its rows were being built.

    Attributes:
        request_index: the index into ``matchers`` of the matcher that raised.
        error: the original exception (also chained as ``__cause__``).

    When this is raised every matcher, the failing one included, has been rolled back to the
    state it started in, and the pool is ready for the next build. The output buffer's
    contents are undefined.
    """

    def __init__(self, request_index: int, error: BaseException) -> None:
        super().__init__(
            f"matchers[{request_index}] raised {type(error).__name__}: {error} "
            "(every matcher was restored to its starting state)"
        )
        self.request_index = request_index
        self.error = error
