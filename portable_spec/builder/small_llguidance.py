"""The common small build of llguidance matchers in a few Python lines: a batch of host trees
or chains whose every request is an ``llguidance.LLMatcher`` the library has probed at the
model's width.

llguidance's masks and parser steps are its own Python methods (it exports C functions only
for its own C matcher type): the general build walks each request in a job of its own, and
its planning costs tens of microseconds per call. Here one compiled call
(``llguidance_masks``) checks the caller's arrays and matchers and walks every request with
the Python walk's rules, the matchers' methods called from C, straight into the mask: rows it
does not fill all-allowed, the counts and the valid flags written on the way. Anything
unusual returns ``None`` (nothing written, no matcher moved): the route table then goes on to
the general build, which checks everything and raises what it must.
"""

from __future__ import annotations

import sys
from typing import Any

from portable_spec import native as compiled
from portable_spec import stats
from portable_spec.engines.llguidance import held_facts
from portable_spec.errors import MatcherError
from portable_spec.stats import note_slow

__all__ = ["in_place"]


def _matcher_type() -> Any:
    """``llguidance.LLMatcher`` (imported by whoever made the matchers), or None."""
    module = sys.modules.get("llguidance")
    return getattr(module, "LLMatcher", None)


def in_place(
    grammars: Any, arrays: tuple[Any, ...], vocab_size: Any, out: Any, return_valid: bool
) -> Any:
    """What :func:`portable_spec.build_host_bitmask` returns for the caller's host trees or
    linear chains (``arrays``: :meth:`GrammarTree.host_inputs`) of llguidance matchers only,
    each probed at the width of ``vocab_size`` and not in its error state, ``out`` None or a
    fitting int32 array, in one compiled call that checks all of it; ``None`` otherwise, and
    when another build walks one of the matchers or the links are malformed (the route table
    then goes on). Blocks until every row is written; every matcher ends where it started; a
    matcher that raises is named by a :class:`portable_spec.MatcherError`."""
    if len(arrays) == 2 and arrays[1] is not None:  # packed chains: the general build
        return None
    links = arrays if len(arrays) == 3 else (None, None, arrays[0])
    done = compiled.llguidance_masks(
        grammars, links[0], links[1], links[2], vocab_size, out, return_valid,
        _matcher_type(), held_facts(), stats._threshold or -1.0,
    )  # fmt: skip
    if done is None:
        return None
    mask, valid, failed, error, slow = done
    if failed >= 0:
        raise MatcherError(failed, error) from error
    if slow:
        note_slow(slow)
    return (mask, valid) if return_valid else mask
