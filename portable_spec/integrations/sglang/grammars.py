"""What the library is handed for each request of a step: sglang's grammar objects read by
sglang's own rules.

sglang walks a verify tree with its grammar object's ``accept_token`` / ``is_terminated`` /
``fill_vocab_mask`` / ``rollback``. For the objects below the library's walk of the engine's
matcher gives the same rows (tests/real_sglang checks them against sglang's own build):

* ``XGrammarGrammar``: its ``xgrammar.GrammarMatcher``.
* ``GuidanceGrammar``: its ``llguidance.LLMatcher``, or nothing when sglang has ended it
  (``finished``: every row all-allowed). sglang hands an end token to a matcher that has not
  stopped, where the library ends the path; the rows of such nodes are repaired afterwards
  (:mod:`.guidance`).
* ``ReasonerGrammarObject`` (a reasoning parser): answering, its inner grammar as above;
  reasoning with one end token and no strict-thinking filter, the inner grammar starts below
  the node of that token (:class:`portable_spec.Reasoning`); no inner grammar, no rows.

Any other object (outlines' grammars, a custom backend's, a reasoner with a multi-token end
or a token filter while reasoning) is built by sglang's own ``traverse_tree`` for its request;
a step whose first grammar allocates another mask format than int32 bitmask words is built by
sglang's own code as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from portable_spec.integrations.sglang import internals
from portable_spec.integrations.sglang.internals import GUIDANCE, REASONER, XGRAMMAR
from portable_spec.integrations.sglang.state import LOG

__all__ = ["Guided", "Plan", "plan_step"]


@dataclass(slots=True)
class Guided:
    """A request whose matcher is llguidance's: what its row repairs need."""

    index: int
    grammar: Any  # sglang's GuidanceGrammar (the inner one of a reasoner)
    eos: Any  # its end tokens
    reasoning: bool  # still reasoning at the root: the grammar starts below the end token


@dataclass(slots=True)
class Plan:
    """One step's requests as the library takes them."""

    has_grammar: bool = False
    handle: Any = None  # the grammar sglang's GrammarMask holds: the last request's
    first: Any = None  # the first request's grammar (whose allocation sglang fills)
    grammars: list[Any] = field(default_factory=list)  # per request: sglang's grammar object
    matchers: list[Any] = field(default_factory=list)  # per request: library input or None
    thinking: list[bool] = field(default_factory=list)
    end_token: int | None = None
    guided: list[Guided] = field(default_factory=list)
    own: list[int] = field(default_factory=list)  # requests sglang's own walk builds
    whole_step: str = ""  # why sglang's own code builds the whole step ("" if it does not)

    @property
    def reasoning(self) -> bool:
        return self.end_token is not None


def plan_step(reqs: Any, vocab_size: int) -> Plan:
    """Read every request's grammar object (nothing moves)."""
    plan = Plan()
    words = (vocab_size + 31) // 32
    matchers = plan.matchers
    thinking = plan.thinking
    grammars = plan.grammars
    for index, req in enumerate(reqs):
        grammar = req.grammar
        grammars.append(grammar)
        matchers.append(None)
        thinking.append(False)
        if grammar is None:
            continue
        if not plan.has_grammar:
            plan.has_grammar = True
            plan.first = grammar
            why = _format_problem(grammar, words)
            if why:
                plan.whole_step = why
        plan.handle = grammar
        if plan.whole_step:
            continue
        _take(plan, index, grammar)
    return plan


def _format_problem(grammar: Any, words: int) -> str:
    """Why the masks ``grammar`` allocates are not int32 bitmasks of ``words`` words ("" if
    they are)."""
    kind = internals.kind_of(grammar)
    if kind == REASONER:
        inner = internals.reasoner_parts(grammar)["inner"]
        if inner is None:
            return "a reasoning parser without a grammar backend's grammar"
        return _format_problem(inner, words)
    if kind == XGRAMMAR:
        return ""
    if kind == GUIDANCE:
        if internals.guidance_words(grammar) != words:
            return "llguidance's vocabulary differs from the model's"
        return ""
    if internals.allocates_bitmask(grammar, words):  # an object the library does not know
        return ""
    return f"grammar objects of type {type(grammar).__qualname__} (their masks are not bitmasks)"


def _take(plan: Plan, index: int, grammar: Any) -> None:
    kind = internals.kind_of(grammar)
    if kind == XGRAMMAR:
        plan.matchers[index] = internals.xgrammar_matcher(grammar)
    elif kind == GUIDANCE:
        _take_guidance(plan, index, grammar, reasoning=False)
    elif kind == REASONER:
        _take_reasoner(plan, index, grammar)
    else:
        plan.own.append(index)
        name = type(grammar).__qualname__
        LOG.warning(
            f"type:{type(grammar).__module__}.{name}",
            "portable_spec: sglang grammar objects of type %s are not known to the library; "
            "their requests' masks are built by sglang's own code",
            name,
        )


def _take_guidance(plan: Plan, index: int, grammar: Any, *, reasoning: bool) -> None:
    matcher, finished, eos = internals.guidance_parts(grammar)
    if finished:  # sglang's walk ends at the root: every row all-allowed
        return
    plan.matchers[index] = matcher
    plan.guided.append(Guided(index, grammar, eos, reasoning))


def _take_reasoner(plan: Plan, index: int, grammar: Any) -> None:
    parts = internals.reasoner_parts(grammar)
    inner = parts["inner"]
    if parts["grammar_covers_reasoning"] or parts["answering"]:
        if parts["thinking"] and parts["token_filter"]:
            _own(plan, index, "strict-thinking filters")
            return
        _take_inner(plan, index, inner, reasoning=False)
        return
    if not parts["thinking"]:
        _own(plan, index, "a reasoning state the library does not model")
        return
    if parts["token_filter"]:
        _own(plan, index, "strict-thinking filters")
        return
    if inner is None:  # sglang fills nothing while reasoning, and nothing after it either
        return
    ends = parts["end_ids"]
    if len(ends) != 1 or parts["end_matched"]:
        _own(plan, index, "reasoning ends of more than one token")
        return
    if plan.end_token is None:
        plan.end_token = ends[0]
    elif plan.end_token != ends[0]:
        _own(plan, index, "requests of one step ending their reasoning with different tokens")
        return
    if _take_inner(plan, index, inner, reasoning=True):
        plan.thinking[index] = True


def _take_inner(plan: Plan, index: int, inner: Any, *, reasoning: bool) -> bool:
    """A reasoner's inner grammar; whether the library takes it."""
    if inner is None:
        return False
    kind = internals.kind_of(inner)
    if kind == XGRAMMAR:
        plan.matchers[index] = internals.xgrammar_matcher(inner)
        return True
    if kind == GUIDANCE:
        _take_guidance(plan, index, inner, reasoning=reasoning)
        return plan.matchers[index] is not None
    _own(plan, index, f"reasoning over grammar objects of type {type(inner).__qualname__}")
    return False


def _own(plan: Plan, index: int, why: str) -> None:
    plan.own.append(index)
    LOG.warning(
        f"own:{why}",
        "portable_spec: %s: those requests' masks are built by sglang's own code",
        why,
    )
