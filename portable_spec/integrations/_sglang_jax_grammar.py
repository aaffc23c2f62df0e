"""A speculative step's accepted tokens and sglang-jax's grammar objects.

After a speculative step sglang-jax's scheduler hands each request's accepted tokens, a list,
to ``req.grammar.accept_token``, which takes one token (llguidance raises ``TypeError`` on a
list). Here: the list is consumed token by token, exactly as far as verify accepted, and a
grammar that ends inside the accepted path (its end token consumed) ends the request there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from portable_spec.integrations._sglang_jax_masks import active_matcher

__all__ = ["accept_tokens", "grammar_end", "truncate_at_grammar_end"]

logger = logging.getLogger("sgl_jax.portable_spec")

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
