"""Forced drafts inside vLLM: each structured request's drafts extended by what its grammar
forces (:func:`portable_spec.forced_drafts`), in the model tokenizer's own tokens.

Where drafts pass: after each step the drafter's tokens reach the scheduler's
``update_draft_token_ids``, which cuts every structured request's drafts to their
grammar-valid prefix (``StructuredOutputManager.validate_tokens``) and keeps them as the next
step's drafts. The plugin wraps it: vLLM's own runs first, then each structured request's kept
drafts are extended by the grammar's forced continuation, up to ``num_speculative_tokens``
(fewer when the request's ``max_tokens`` or the model's context leaves less room). The model
verifies them like any draft, so the output is what vLLM writes without them.

Which requests: structured ones that take drafts this step (not finished, not a prefill
chunk), not still reasoning after their drafts (vLLM's own reasoning bounds), whose grammar is
one the library walks (xgrammar, guidance's llguidance, outlines). Which configurations
(:func:`internals.forced_drafts_rule`): synchronous scheduling (under async scheduling the
worker's drafts are in the forward before the scheduler sees them:
``update_draft_token_ids_in_output`` is left alone), standard rejection sampling, and drafters
whose drafts carry no probabilities (n-gram, suffix; model drafters drafting greedily). Where
the model runner keeps draft probabilities, the rejection sampler weighs each draft by them:
a token put in its place would be weighed by another token's probability, so such drafts stay
exactly vLLM's.

``PORTABLE_SPEC_FORCED_DRAFTS`` (:data:`.state.FORCED_ENV_VAR`, read at each install): unset,
``1`` or ``on``: on; ``shadow`` (or the plugin's ``shadow`` mode): the forced tokens are
computed and counted, never scheduled; ``0`` or ``off``: vLLM's drafts untouched. The
counters (``forced_*`` in :data:`.state.COUNTERS`, in ``integration_stats()``): steps that
extended some request's drafts, forced tokens scheduled, of those accepted by the model,
would-be drafts in shadow mode, steps the library refused (vLLM's drafts kept).

The two replacements (rows of ``patches.py``) only wrap: :func:`make_update` and
:func:`make_output` may be called again with another function below them.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from portable_spec.integrations.vllm import internals
from portable_spec.integrations.vllm.state import LOG, STATS, SWITCHES, forced_mode

__all__ = [
    "Lookup",
    "Writings",
    "extend_drafts",
    "forget_writings",
    "make_output",
    "make_update",
]

_STATE = "_portable_spec_drafts"  # per scheduler, kept on vLLM's scheduler


class Writings:
    """What the model wrote where its grammar forced a text: ``(grammar, forced text) -> the
    tokens the model wrote from there`` (at most ``length``), the most recent kept, the least
    recently used dropped past ``size`` entries.

    A forced text is written in the model's own tokens, which are not always the tokenizer's
    segmentation of the text alone (a small model unsure of a key writes it in short pieces,
    then a colon and a quote in one token): the next request, or the next array item, that
    meets the same forced text in the same grammar drafts what the model wrote there last
    time, checked by the grammar like any draft. Observed at the committed positions where a
    forced text starts, closed once ``length`` tokens followed (or dropped with the request).
    """

    def __init__(self, length: int, size: int = 4096) -> None:
        self.length = length
        self.size = size
        self._seen: OrderedDict[tuple[Any, str], tuple[int, ...]] = OrderedDict()
        self._open: dict[str, list[tuple[int, tuple[Any, str]]]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def get(self, key: tuple[Any, str]) -> tuple[int, ...] | None:
        found = self._seen.get(key)
        if found is not None:
            self._seen.move_to_end(key)
        return found

    def watch(self, req_id: str, at: int, key: tuple[Any, str]) -> None:
        """The request's output, from token ``at`` on, is what the model writes after the
        forced text of ``key``."""
        self._open.setdefault(req_id, []).append((at, key))

    def close(self, req_id: str, output: Any) -> None:
        """Keep what the request wrote after the forced texts it met, where enough followed."""
        pending = self._open.get(req_id)
        if not pending:
            return
        n = len(output)
        keep = []
        for at, key in pending:
            if n >= at + self.length:
                self._seen[key] = tuple(output[at : at + self.length])
                self._seen.move_to_end(key)
            else:
                keep.append((at, key))
        if len(self._seen) > self.size:
            for _ in range(len(self._seen) - self.size):
                self._seen.popitem(last=False)
        if keep:
            self._open[req_id] = keep
        else:
            del self._open[req_id]

    def forget_gone(self, live: Any) -> None:
        """Drop what is watched for requests the scheduler no longer holds."""
        for req_id in [r for r in self._open if r not in live]:
            del self._open[req_id]


class _SchedulerState:
    """What stays the same for a scheduler: why its drafts stay vLLM's ("" if they may be
    extended), K, the tokenizer and vocabulary; the drafts extended for the next step
    (request id -> how many of them were vLLM's); what the model wrote at forced texts."""

    __slots__ = (
        "__weakref__",
        "k",
        "keys",
        "lookups",
        "pending",
        "steps",
        "tokenizer",
        "vocab_size",
        "why",
        "writings",
    )

    def __init__(self, scheduler: Any) -> None:
        config = scheduler.vllm_config
        self.why = internals.forced_drafts_rule(config)
        self.k = int(config.num_speculative_tokens or 0)
        manager = internals.scheduler_manager(scheduler)
        self.tokenizer = internals.manager_tokenizer(manager)
        self.vocab_size = int(config.model_config.get_vocab_size())
        self.pending: dict[str, int] = {}
        self.writings = Writings(self.k)
        self.keys: dict[str, Any] = {}  # request id -> its grammar's key
        self.lookups: dict[str, Lookup] = {}
        self.steps = 0
        if self.why:
            LOG.info("rule", "portable_spec: forced drafts off here (%s): vLLM's drafts", self.why)
        else:
            LOG.info(
                "rule",
                "portable_spec: forced drafts on (%s, K=%d): structured requests' drafts "
                "extended by what their grammar forces",
                forced_mode(),
                self.k,
            )


_states: weakref.WeakSet[_SchedulerState] = weakref.WeakSet()


def _state(scheduler: Any) -> _SchedulerState:
    state = getattr(scheduler, _STATE, None)
    if state is None:
        state = _SchedulerState(scheduler)
        setattr(scheduler, _STATE, state)
        _states.add(state)
    return state


def forget_writings() -> None:
    """Forget what the model wrote at forced texts, in every scheduler of this process (the
    next requests start cold)."""
    for state in list(_states):
        state.writings = Writings(state.k)


def extend_drafts(scheduler: Any, draft_token_ids: Any, state: _SchedulerState) -> None:
    """After vLLM kept each request's valid drafts: extend those of the structured requests
    by their grammar's forced continuation (scheduled; in shadow mode only counted)."""
    manager = internals.scheduler_manager(scheduler)
    reasoning = internals.may_reason(manager)
    remember, look = SWITCHES["writings"] == "on", SWITCHES["lookup"] == "on"
    state.steps += 1
    if state.steps % 256 == 0:
        live = internals.live_request_ids(scheduler)
        state.writings.forget_gone(live)
        for table in (state.keys, state.lookups):
            for req_id in [r for r in table if r not in live]:
                del table[req_id]
    entries: list[tuple[str, Any, list[int], int]] = []
    matchers: list[Any] = []
    proposals: list[list[int]] = []
    limits: list[int] = []
    for req_id in internals.draft_ids(draft_token_ids):
        request = internals.draft_request(scheduler, req_id)
        if request is None:
            continue
        own = internals.spec_tokens(request)
        limit = internals.draft_budget(scheduler, request, state.k)
        if limit <= len(own):
            continue
        grammar = internals.request_grammar(request)
        if grammar is None or internals.is_terminated(grammar):
            continue
        try:
            matcher = internals.inner_matcher(grammar)
        except LookupError:  # a backend the library does not walk
            continue
        start = 0
        if reasoning:
            start, _ = internals.constraint_bounds(manager, request, own)
            if start > len(own):  # still reasoning after its drafts: nothing is forced
                continue
        proposal = own[start:]
        if remember and not start:
            proposal = _remembered(state, req_id, request, matcher, proposal)
        entries.append((req_id, request, own, start))
        matchers.append(matcher)
        proposals.append(proposal)
        limits.append(limit - start)
    if not entries:
        return
    began = time.perf_counter()
    drafted = _forced(state, matchers, proposals, limits)
    if drafted is None:
        return
    if look:  # what followed the drafts' last tokens before, then forced again
        again = []
        for n, ((req_id, request, _own, start), tokens) in enumerate(
            zip(entries, drafted, strict=True)
        ):
            room = limits[n] - len(tokens)
            if room <= 0 or start:
                continue
            lookup = state.lookups.get(req_id)
            if lookup is None:
                lookup = state.lookups[req_id] = Lookup()
            lookup.sync(internals.all_tokens(request))
            found = lookup.after(tokens, room)
            if found:
                again.append(n)
                proposals[n] = tokens + found
        if again:
            more = _forced(
                state,
                [matchers[n] for n in again],
                [proposals[n] for n in again],
                [limits[n] for n in again],
            )
            if more is not None:
                for n, tokens in zip(again, more, strict=True):
                    if len(tokens) > len(drafted[n]):
                        drafted[n] = tokens
    STATS.time("forced_drafts", len(entries), time.perf_counter() - began)
    on = forced_mode() == "on"
    added = 0
    for (req_id, request, own, start), tokens in zip(entries, drafted, strict=True):
        drafts = own[:start] + tokens
        if len(drafts) <= len(own) or drafts[: len(own)] != own:
            continue  # nothing forced (or a prefix vLLM's validation kept longer): vLLM's
        added += len(drafts) - len(own)
        if on:
            internals.set_spec_tokens(request, drafts)
            state.pending[req_id] = len(own)
    if added:
        STATS.update({"forced_steps": 1, "forced_drafted" if on else "forced_would_draft": added})


def _forced(
    state: _SchedulerState, matchers: list[Any], proposals: list[list[int]], limits: list[int]
) -> list[list[int]] | None:
    """:func:`portable_spec.forced_drafts` on these requests, or None when it refused them
    (every matcher restored: vLLM's drafts stand)."""
    import portable_spec as ps

    try:
        return ps.forced_drafts(
            matchers, proposals, limits, tokenizer=state.tokenizer, vocab_size=state.vocab_size
        )
    except (TypeError, ValueError, ps.MatcherError) as exc:
        STATS.add("forced_refused_steps")
        LOG.warning(
            f"refused:{type(exc).__name__}",
            "portable_spec: forced drafts refused a step (%s): vLLM's drafts for such steps",
            exc,
        )
        return None


class Lookup:
    """One request's tokens (prompt and output) indexed by their 1- to 3-grams, for a prompt
    lookup that starts from the drafts' last tokens: where the forced tokens end (a key's
    last word), what followed the same tokens before (the colon and quote after the previous
    key, the next field of the previous array item). Kept in step with the request's tokens
    as they grow; per n-gram the positions after its last two occurrences."""

    NGRAMS = (3, 2, 1)

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.after_gram: dict[tuple[int, ...], tuple[int, int]] = {}

    def sync(self, tokens: Any) -> None:
        """Index what the request added since the last call (the list only grows)."""
        have = len(self.tokens)
        if len(tokens) < have:  # not the same request's growth: start over
            self.tokens, self.after_gram, have = [], {}, 0
        new = list(tokens[have:])
        seq = self.tokens
        table = self.after_gram
        for t in new:
            seq.append(t)
            end = len(seq)
            for n in self.NGRAMS:
                if end >= n:
                    gram = tuple(seq[end - n : end])
                    last = table.get(gram)
                    table[gram] = (end, last[0] if last else -1)

    def after(self, drafts: list[int], most: int) -> list[int]:
        """At most ``most`` tokens that followed the longest n-gram ending the request's
        tokens and ``drafts`` last time it occurred (not at the very end)."""
        seq = self.tokens
        tail = (seq[-3:] + drafts)[-3:] if len(drafts) < 3 else drafts[-3:]
        for n in self.NGRAMS:
            if len(tail) < n:
                continue
            found = self.after_gram.get(tuple(tail[-n:]))
            if found is None:
                continue
            at = found[0] if found[0] < len(seq) else found[1]
            if at > 0:
                return seq[at : at + most]
        return []


def _remembered(
    state: _SchedulerState, req_id: str, request: Any, matcher: Any, own: list[int]
) -> list[int]:
    """The request's drafts, or what the model wrote last time after the text its grammar
    forces now when vLLM's drafts start it; the position is watched to learn from it."""
    from portable_spec.drafting import forced_text

    output = internals.output_tokens(request)
    writings = state.writings
    writings.close(req_id, output)
    text = forced_text(matcher)
    if not text:
        return own
    key = state.keys.get(req_id)
    if key is None:
        key = state.keys[req_id] = internals.grammar_key(request)
    where = (key, text)
    writings.watch(req_id, len(output), where)
    written = writings.get(where)
    if written is None or list(written[: len(own)]) != own:
        return own
    return list(written)


def make_update(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scheduler.update_draft_token_ids``: vLLM's own (``original``), then, unless the
    forced drafts are off, the structured requests' drafts extended (:func:`extend_drafts`);
    any failure there leaves vLLM's drafts (one warning per kind)."""

    def update_draft_token_ids(self: Any, draft_token_ids: Any) -> None:
        original(self, draft_token_ids)
        if SWITCHES["forced"] == "off":
            return
        held = _state(self)
        if held.why:
            return
        try:
            extend_drafts(self, draft_token_ids, held)
        except Exception as exc:  # vLLM's drafts stand; the engine never fails for this
            LOG.warning(
                f"failed:{type(exc).__name__}",
                "portable_spec: forced drafts failed (%s: %s): vLLM's drafts",
                type(exc).__name__,
                exc,
            )

    return update_draft_token_ids


def make_output(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scheduler.update_from_output``: the forced tokens the model accepted this step are
    counted, then vLLM's own (``original``) runs."""

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        held = getattr(self, _STATE, None)
        if held is not None and held.pending:
            _count_accepted(held, scheduler_output, model_runner_output)
        return original(self, scheduler_output, model_runner_output)

    return update_from_output


def _count_accepted(state: _SchedulerState, scheduler_output: Any, runner_output: Any) -> None:
    """The forced tokens the model accepted this step: the accepted drafts past vLLM's own."""
    pending, state.pending = state.pending, {}
    accepted = 0
    try:
        for req_id, (drafts, taken) in internals.step_acceptance(
            scheduler_output, runner_output
        ).items():
            own = pending.get(req_id)
            if own is not None:
                accepted += max(0, min(taken, len(drafts)) - own)
    except Exception as exc:  # only a counter
        LOG.warning("count", "portable_spec: forced drafts not counted (%s)", exc)
        return
    if accepted:
        STATS.add("forced_accepted", accepted)
