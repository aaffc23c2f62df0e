"""A speculative step's accepted tokens and sglang-jax's grammar objects.

After a speculative step sglang-jax's scheduler hands each request's accepted tokens, a list,
to ``req.grammar.accept_token``, which takes one token (llguidance raises ``TypeError`` on a
list). Here: the list is consumed token by token, exactly as far as verify accepted, and a
grammar that ends inside the accepted path (its end token consumed) ends the request there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from portable_spec.integrations.sglang_jax.internals import logger
from portable_spec.integrations.sglang_jax.masks import active_matcher

__all__ = ["accept_tokens", "grammar_end", "own_grammar_objects", "truncate_at_grammar_end"]

_ENDED = "EndOfSentence"


def grammar_end(matcher: Any, tokens: Sequence[int]) -> int | None:
    """The index of the token of ``tokens`` that ends the grammar of ``matcher`` (an
    ``llguidance.LLMatcher``), or ``None`` if the grammar does not end inside them (or refuses
    one of them first). The matcher does not move (a ``deep_copy`` is walked).

    The grammar ends on a token when it is the end token after a complete grammar
    (``is_stopped()`` before it, the token allowed) or consuming it stops the grammar with
    ``"EndOfSentence"``.
    """
    if not len(tokens):
        return None
    fork = matcher.deep_copy()
    if fork.stop_reason() == _ENDED:
        return None
    for i, token in enumerate(tokens):
        token = int(token)
        if fork.is_stopped():  # complete: only an end token may follow, consumed untraced
            bits = fork.compute_bitmask()  # little-endian int32 words: bit t in byte t // 8
            allowed = 0 <= token < 8 * len(bits) and (bits[token >> 3] >> (token & 7)) & 1
            return i if allowed else None
        if fork.try_consume_tokens([token]) != 1:
            return None
        if fork.stop_reason() == _ENDED:
            return i
    return None


def accept_tokens(
    grammar: Any, tokens: Sequence[int], accept_one: Callable[[Any, int], Any]
) -> None:
    """Advance an sglang-jax grammar object over a step's accepted ``tokens``, one by one
    through its own ``accept_token`` (``accept_one``), stopping after the token that ends the
    grammar (the rest of the list is not the request's output). Raises what the grammar's own
    ``accept_token`` raises for a token it refuses (sglang-jax aborts that request)."""
    for token in tokens:
        if getattr(grammar, "finished", False):
            return
        accept_one(grammar, int(token))
        matcher = getattr(grammar, "ll_matcher", None)
        if matcher is not None and matcher.stop_reason() == _ENDED:
            grammar.finished = True
            return


def truncate_at_grammar_end(
    reqs: Sequence[tuple[int, Any]],
    tokens: list[list[int]],
    accept_lens: list[int],
    finish: Callable[[Any, int], None],
) -> int:
    """Cut each request's accepted tokens after the token that ends its grammar.

    Args:
        reqs: ``(index into tokens, request)`` for the step's live requests.
        tokens, accept_lens: what sglang-jax resolved for the step (modified in place).
        finish: called as ``finish(request, token)`` for a request whose grammar ended in
            this step (the scheduler then finishes it on this token).

    Returns the number of requests cut short. Never moves a matcher.
    """
    cut = 0
    for i, req in reqs:
        matcher = active_matcher(getattr(req, "grammar", None))
        if matcher is None or i >= len(tokens) or not tokens[i]:
            continue
        try:
            end = grammar_end(matcher, tokens[i])
        except Exception as exc:  # a matcher the walk cannot read: sglang-jax's own path
            logger.warning("portable_spec: request %s: grammar end not checked: %s", req, exc)
            continue
        if end is None:
            continue
        if end + 1 < len(tokens[i]):
            tokens[i] = tokens[i][: end + 1]
            if i < len(accept_lens):
                accept_lens[i] = end + 1
            cut += 1
        finish(req, tokens[i][end])
    return cut


def own_grammar_objects(original: Callable[..., Any], invalid: Any) -> Callable[..., Any]:
    """Wrap sglang-jax's ``BaseGrammarBackend.get_cached_or_future_value`` so that every
    request gets a grammar object of its own.

    sglang-jax hands a cache hit's object itself to the request (every later request with the
    same grammar shares it: the third request with one JSON schema starts where the second
    left its matcher), and the same compile ``Future`` to requests that ask for one grammar
    while it compiles (``future.result()``: one object for all of them). Here a cache hit
    returns ``copy()`` of the cached object (a fresh matcher; sglang-jax's ``invalid``
    marker as it is), and a second request on a compile in flight gets a ``Future`` of its own
    that resolves to a copy of the compile's result.
    """
    from concurrent import futures

    def get_cached_or_future_value(self: Any, key: Any) -> tuple[Any, bool]:
        in_flight = key in self.cache and isinstance(self.cache[key], futures.Future)
        value, cache_hit = original(self, key)
        if cache_hit:
            return (value if value is invalid else value.copy()), True
        if in_flight and isinstance(value, futures.Future):
            return _copy_when_done(value, invalid), False
        return value, False

    get_cached_or_future_value.__wrapped__ = original  # type: ignore[attr-defined]
    return get_cached_or_future_value


def _copy_when_done(compile_future: Any, invalid: Any) -> Any:
    """A new ``Future`` resolved with a copy of ``compile_future``'s grammar (``invalid`` and
    errors passed on as they are)."""
    from concurrent import futures

    own: futures.Future = futures.Future()

    def done(finished: futures.Future) -> None:
        try:
            grammar = finished.result()
            own.set_result(grammar if grammar is invalid else grammar.copy())
        except BaseException as error:  # the compile's error, or the copy's
            own.set_exception(error)

    compile_future.add_done_callback(done)
    return own
