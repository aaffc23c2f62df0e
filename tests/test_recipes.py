"""The porting guide's vLLM and TensorRT-LLM recipes against those engines' own row semantics.

The recipes are the code blocks of ``docs/porting.md`` marked ``# recipe: vllm`` and
``# recipe: tensorrt-llm``, executed as they are printed. The engines' behaviour is
``tests/_engine_rows.py``: vLLM's serial fill and worker-side apply, TensorRT-LLM's build,
``token_mask`` and rollback, re-implemented on their own fresh matchers. Both sides mask the
same random logits (draft tokens boosted, so that verification accepts some), on SmolLM2's real
vocabulary, and must agree on the masked logits of every row a verification can sample, on the
tokens a greedy verification emits, and (TensorRT-LLM) on the matchers' states between steps.
Where a convention differs only on rows no verification reaches, the test says so and checks
that it does differ there (so the comparison is not vacuous). The last tests break the recipes
on purpose and check that the comparisons notice.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr
from _cases import allowed_tokens
from _engine_rows import (
    PADDING,
    ReasoningParser,
    TrtGuidedDecoder,
    TrtRequest,
    VllmRequest,
    bit,
    greedy_verify,
    trt_apply,
    vllm_apply,
    vllm_grammar_bitmask,
    vllm_schedule,
)
from _oracle import Request, matcher_state

ROOT = Path(__file__).resolve().parents[1]
K = 4  # drafts per request (vLLM's num_speculative_tokens, TensorRT-LLM's max_draft)
KINDS = ("json_schema", "builtin_json", "ebnf", "regex")
PROBE = [0, 1, 2, 18, 33, 75, 104, 107, 109]
SEEDS = range(12)


def load_recipe(name: str, edits: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Execute the porting guide's ``# recipe: <name>`` block (after ``edits``, each an
    ``(old, new)`` replacement that must apply); return its namespace."""
    text = (ROOT / "docs/porting.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    chosen = [b for b in blocks if b.startswith(f"# recipe: {name} ")]
    assert len(chosen) == 1, f"docs/porting.md needs exactly one '# recipe: {name}' block"
    source = chosen[0]
    for old, new in edits:
        assert old in source, f"the {name} recipe no longer contains {old!r}"
        source = source.replace(old, new)
    namespace: dict[str, Any] = {"__name__": f"porting_recipe_{name.replace('-', '_')}"}
    exec(compile(source, f"docs/porting.md ({name} recipe)", "exec"), namespace)
    return namespace


# -- drawing requests and drafts ---------------------------------------------------------------


def token_id(vocab: Any, text: str) -> int:
    return vocab.tokens.index(text)


def parser_for(vocab: Any) -> ReasoningParser:
    """``<|im_start|>`` stands for ``</think>``; ``{`` and ``x`` are implicit ends (``{`` a
    first token JSON grammars accept, ``x`` one every sample grammar refuses first)."""
    return ReasoningParser(
        frozenset({token_id(vocab, "<|im_start|>")}),
        frozenset({token_id(vocab, "{"), token_id(vocab, "x")}),
    )


def any_token(rng: np.random.Generator, vocab: Any) -> int:
    return int(rng.integers(3, vocab.size))


def grammar_token(rng: np.random.Generator, vocab: Any, matcher: Any) -> int | None:
    """A token the matcher allows (the end token rarely), or None."""
    options = allowed_tokens(matcher, vocab.words, vocab.size)
    if len(options) > 1 and rng.random() < 0.9:
        options = options[options != vocab.eos]
    return int(rng.choice(options)) if len(options) else None


def committed_prefix(
    rng: np.random.Generator, vocab: Any, request: Request, may_end: bool = False
) -> None:
    """Advance ``request`` by a random valid prefix; with ``may_end``, sometimes end it with the
    end token (a finished request: engines stop scheduling it)."""
    matcher = request.fresh()
    for _ in range(int(rng.integers(0, 7))):
        token = grammar_token(rng, vocab, matcher)
        if token is None or token == vocab.eos or matcher.is_terminated():
            break
        assert matcher.accept_token(token)
        request.prefix.append(token)
    if may_end and rng.random() < 0.08 and matcher.fork().accept_token(vocab.eos):
        request.prefix.append(vocab.eos)


def draw_drafts(
    rng: np.random.Generator,
    vocab: Any,
    request: Request | None,
    reasoning: bool,
    parser: ReasoningParser | None,
    k: int,
) -> list[int]:
    """0..k drafts: while reasoning, free tokens and sometimes an end token (explicit or
    implicit); in the grammar, mostly grammar-valid tokens, sometimes the end token or a
    random (mostly invalid) one."""
    drafts: list[int] = []
    matcher = None if request is None or reasoning else request.fresh()
    for _ in range(int(rng.integers(0, k + 1))):
        u = rng.random()
        if reasoning:
            if parser is not None and u < 0.35:
                token = int(rng.choice(sorted(parser.end_ids | parser.implicit_end_ids)))
                reasoning = False
                matcher = request.fresh() if request is not None else None
                if token in parser.implicit_end_ids and matcher is not None:
                    matcher = matcher if matcher.accept_token(token) else None
            else:
                token = any_token(rng, vocab)
        elif matcher is not None and not matcher.is_terminated() and u < 0.75:
            token = grammar_token(rng, vocab, matcher)
            if token is None:
                token = any_token(rng, vocab)
            matcher = matcher if matcher.accept_token(token) else None
        elif u < 0.85:
            token = vocab.eos
            if matcher is not None and not matcher.is_terminated():
                matcher = matcher if matcher.accept_token(token) else None
        else:
            token = any_token(rng, vocab)
            if matcher is not None and not matcher.is_terminated():
                matcher = matcher if matcher.accept_token(token) else None
        drafts.append(token)
    return drafts


def draft_logits(
    rng: np.random.Generator, vocab_size: int, blocks: Sequence[Sequence[int]], width: int
) -> np.ndarray:
    """Random logits, ``width`` rows per block; a block's draft ``i`` gets a large logit at row
    ``i`` most of the time (the target agrees with it)."""
    logits = rng.standard_normal((len(blocks) * width, vocab_size), dtype=np.float32)
    for n, drafts in enumerate(blocks):
        for i, token in enumerate(drafts):
            if token >= 0 and rng.random() < 0.85:
                logits[n * width + i, token] += 30.0
    return logits


# -- vLLM ----------------------------------------------------------------------------------------


@dataclass
class VllmBatch:
    """One scheduler step: the grammar requests, the running batch's order, the grammar list's
    order and each request's drafts as the drafter wrote them (0..K, unpadded)."""

    requests: dict[str, VllmRequest]
    batch_ids: list[str]
    structured_ids: list[str]
    raw: dict[str, list[int]] = field(default_factory=dict)


def draw_vllm_batch(
    rng: np.random.Generator, vocab: Any, parser: ReasoningParser | None
) -> VllmBatch:
    """1..6 requests, some without a grammar, some (with ``parser``) still reasoning; the
    grammar list in another order than the batch."""
    count = int(rng.integers(1, 7))
    batch = VllmBatch({}, [], [])
    for r in range(count):
        req_id = f"req{r}"
        batch.batch_ids.append(req_id)
        kind = rng.choice([None, *KINDS]) if r else str(rng.choice(KINDS))
        if kind is None:
            batch.raw[req_id] = draw_drafts(rng, vocab, None, False, None, K)
            continue
        request = Request(vocab.grammars[str(kind)])
        reasoning = parser is not None and (r == 0 or rng.random() < 0.5)
        if not reasoning:
            committed_prefix(rng, vocab, request)
        batch.requests[req_id] = VllmRequest(request, reasoning_ended=not reasoning)
        batch.raw[req_id] = draw_drafts(rng, vocab, request, reasoning, parser, K)
    batch.structured_ids = [str(i) for i in rng.permutation(list(batch.requests))]
    rng.shuffle(batch.batch_ids)
    return batch


class VllmManager:
    """vLLM's ``StructuredOutputManager`` as far as the recipe reads it, with the recipe's
    ``grammar_bitmask`` as its method."""

    def __init__(
        self, recipe: dict[str, Any], vocab_size: int, k: int, parser: ReasoningParser | None
    ) -> None:
        self._recipe = recipe["grammar_bitmask"]
        self.vllm_config = SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=k),
            scheduler_config=SimpleNamespace(max_num_seqs=8),
        )
        self.backend = SimpleNamespace(
            vocab_size=vocab_size,
            allocate_token_bitmask=lambda rows: xgr.allocate_token_bitmask(rows, vocab_size),
        )
        self.reasoner = None
        if parser is not None:
            self.reasoner = SimpleNamespace(
                end_token_ids=sorted(parser.end_ids),
                implicit_end_token_ids=sorted(parser.implicit_end_ids),
            )
        self._grammar_bitmask = None

    def should_fill_bitmask(self, request: Any) -> bool:
        return self.reasoner is None or request.structured_output_request.reasoning_ended

    def grammar_bitmask(self, *args: Any) -> Any:
        return self._recipe(self, *args)


def vllm_step(
    vocab: Any,
    batch: VllmBatch,
    parser: ReasoningParser | None,
    after_failure: str,
    recipe: dict[str, Any],
    rng: np.random.Generator,
) -> int:
    """Run one step both ways and compare; returns how many rows differ (each one a row no
    verification can reach). vLLM gets its scheduled drafts (validated where it validates,
    ``-1``-padded); the recipe gets the drafts as written (only padded)."""
    size, words = vocab.size, vocab.words
    stops = frozenset({vocab.eos})
    scheduled = {
        rid: vllm_schedule(batch.requests.get(rid), batch.raw[rid], K) for rid in batch.batch_ids
    }
    padded = {rid: vllm_schedule(None, batch.raw[rid], K) for rid in batch.batch_ids}
    theirs = vllm_grammar_bitmask(
        batch.requests, batch.structured_ids, scheduled, K, words, size, parser, after_failure
    )

    manager = VllmManager(recipe, size, K, parser)
    ours_requests = {}
    for rid, request in batch.requests.items():
        grammar = SimpleNamespace(matcher=request.grammar.fresh())
        state = SimpleNamespace(grammar=grammar, reasoning_ended=request.reasoning_ended)
        ours_requests[rid] = SimpleNamespace(structured_output_request=state)
    before = {
        rid: matcher_state(r.structured_output_request.grammar.matcher, PROBE, words)
        for rid, r in ours_requests.items()
    }
    raw = {rid: list(batch.raw[rid]) for rid in batch.batch_ids}
    ours = manager.grammar_bitmask(ours_requests, batch.structured_ids, raw)
    ours = None if ours is None else np.array(ours)
    for rid, r in ours_requests.items():
        assert (
            matcher_state(r.structured_output_request.grammar.matcher, PROBE, words)
            == (before[rid])
        ), f"{rid}: the recipe moved the matcher"
    assert (ours is None) == (theirs is None)
    if theirs is None:
        return 0
    assert ours.shape == theirs.shape == (len(batch.structured_ids) * (K + 1), words)

    logits = draft_logits(rng, size, [padded[rid] for rid in batch.batch_ids], K + 1)
    masked_theirs = vllm_apply(logits, theirs, batch.batch_ids, batch.structured_ids, K)
    masked_ours = vllm_apply(logits, ours, batch.batch_ids, batch.structured_ids, K)
    differing = 0
    for position, rid in enumerate(batch.batch_ids):
        span = slice(position * (K + 1), (position + 1) * (K + 1))
        emitted_theirs = greedy_verify(masked_theirs[span], scheduled[rid], stops)
        emitted_ours = greedy_verify(masked_ours[span], padded[rid], stops)
        assert emitted_ours == emitted_theirs, f"{rid}: verification emits different tokens"
        if rid not in batch.requests:
            np.testing.assert_array_equal(masked_ours[span], logits[span])
            continue
        n = batch.structured_ids.index(rid)
        rows_theirs = theirs[n * (K + 1) : (n + 1) * (K + 1)]
        rows_ours = ours[n * (K + 1) : (n + 1) * (K + 1)]
        accepted, sampled = reachable(rows_theirs, scheduled[rid], stops)
        assert reachable(rows_ours, padded[rid], stops)[1] == sampled, rid
        for i in sampled:
            row = position * (K + 1) + i
            np.testing.assert_array_equal(masked_ours[row], masked_theirs[row], err_msg=rid)
        different = [i for i in range(K + 1) if not np.array_equal(rows_ours[i], rows_theirs[i])]
        assert not set(different) & set(sampled), f"{rid}: sampled rows {different} differ"
        validated = batch.requests[rid].reasoning_ended
        if validated or after_failure == "full":
            assert not different, f"{rid}: rows {different} differ (nothing may, here)"
        differing += len(different)
        if validated:  # the recipe's count is what validate_tokens kept
            kept = sum(1 for t in scheduled[rid] if t != PADDING)
            assert manager.num_acceptable_drafts[n] == kept, rid
            assert accepted <= kept
    return differing


def reachable(
    rows: np.ndarray, drafts: Sequence[int], stop_ids: frozenset[int]
) -> tuple[int, list[int]]:
    """``(drafts a verification can accept, rows it can sample)`` under these masks: a draft
    is accepted only if its row allows it (``-1`` never), the request ends at a stop token."""
    sampled = [0]
    for i, token in enumerate(drafts):
        if token < 0 or not bit(rows[i], token):
            return i, sampled
        if token in stop_ids:
            return i + 1, sampled
        sampled.append(i + 1)
    return len(drafts), sampled


@pytest.fixture(scope="module")
def vllm_recipe() -> dict[str, Any]:
    return load_recipe("vllm")


@pytest.mark.parametrize("after_failure", ["copy", "full"])
@pytest.mark.parametrize("reasoning", [False, True], ids=["no-reasoning", "reasoning"])
def test_vllm_recipe_matches_vllm(smollm2, vllm_recipe, reasoning, after_failure):
    """Ragged chains, requests absent from the grammar list, validated drafts, reasoning
    requests: identical rows except (reasoning, ``copy``) rows after a refused draft, which no
    verification samples, and which do occur in these draws."""
    parser = parser_for(smollm2) if reasoning else None
    differing = 0
    for seed in SEEDS:
        rng = np.random.default_rng([seed, reasoning, after_failure == "copy"])
        batch = draw_vllm_batch(rng, smollm2, parser)
        differing += vllm_step(smollm2, batch, parser, after_failure, vllm_recipe, rng)
    if reasoning and after_failure == "copy":
        assert differing > 0, "no draw refused a draft on vLLM's unvalidated path"
    else:
        assert differing == 0


def test_vllm_reasoning_end_anywhere_in_the_window(smollm2, vllm_recipe):
    """The end token at every draft position, explicit and implicit (accepted and refused as
    first content), with a grammar-valid answer after it: row for row as vLLM."""
    parser = parser_for(smollm2)
    end, brace, letter = (token_id(smollm2, t) for t in ("<|im_start|>", "{", "x"))
    quote = token_id(smollm2, '"')
    rng = np.random.default_rng(5)
    for marker in (end, brace, letter):
        for j in range(K):
            drafts = [any_token(rng, smollm2) for _ in range(j)] + [marker]
            answer = [brace, quote] if marker == end else [quote]
            drafts = (drafts + answer)[:K]
            request = Request(smollm2.grammars["json_schema"])
            batch = VllmBatch(
                {"r": VllmRequest(request, reasoning_ended=False)}, ["r"], ["r"], {"r": drafts}
            )
            assert vllm_step(smollm2, batch, parser, "full", vllm_recipe, rng) == 0


# -- TensorRT-LLM ----------------------------------------------------------------------------------


@dataclass
class Live:
    """A request TensorRT-LLM keeps running across steps."""

    slot: int
    grammar: Any | None  # compiled grammar, or None: no guided decoding
    phase: str  # "chunk" (a context chunk, not the last), "context", "generation" or "done"
    tokens: list[int] = field(default_factory=list)  # committed, the newest one last


def trt_requests(
    rng: np.random.Generator, vocab: Any, count: int
) -> tuple[list[Live], dict[int, Any]]:
    """Requests at the first step: contexts (some on an earlier chunk) and generation requests
    already running (a committed prefix whose last token the matcher has not taken yet)."""
    live, existing = [], {}
    for slot in range(count):
        kind = rng.choice([None, *KINDS]) if slot else str(rng.choice(KINDS))
        grammar = None if kind is None else vocab.grammars[str(kind)]
        phase = str(rng.choice(["chunk", "context", "generation", "generation"]))
        request = Live(slot, grammar, phase)
        if phase == "generation":
            if grammar is None:
                request.tokens = [any_token(rng, vocab)]
            else:
                prefix = Request(grammar)
                committed_prefix(rng, vocab, prefix)
                while prefix.prefix and prefix.prefix[-1] == vocab.eos:
                    prefix.prefix.pop()
                new = grammar_token(rng, vocab, prefix.fresh())
                if new is None or new == vocab.eos:  # it could not go on: start it afresh
                    request.phase = "context"
                else:
                    request.tokens = [*prefix.prefix, new]
                    existing[slot] = Request(grammar, list(prefix.prefix))
        live.append(request)
    return live, existing


def engine_views(
    request: Live, drafts: list[int]
) -> tuple[TrtRequest, SimpleNamespace, SimpleNamespace | None]:
    """The same request for the TensorRT-LLM model and for the recipe (an ``LlmRequest``
    stand-in); the third is the recipe's context-request view or None."""
    params = None if request.grammar is None else Request(request.grammar)
    context = request.phase in ("chunk", "context")
    model = TrtRequest(
        request.slot,
        params if request.phase != "chunk" else None,
        context,
        request.tokens[-1] if request.tokens else 0,
        list(drafts),
    )
    view = SimpleNamespace(
        py_request_id=request.slot,
        py_seq_slot=request.slot,
        guided_decoding_params=params,
        is_last_context_chunk=request.phase == "context",
        get_last_tokens=lambda beam, t=model.new_token: t,
        py_draft_tokens=list(drafts),
        py_num_accepted_draft_tokens=0,
    )
    return model, view, view if context else None


def trt_run(vocab: Any, seed: int, recipe: dict[str, Any], steps: int = 3) -> None:
    """A few steps of one batch through TensorRT-LLM's decoder and the recipe: masked logits
    identical on every row, the same greedy tokens, the same matcher states after each step."""
    rng = np.random.default_rng([seed, 77])
    size, words, stops = vocab.size, vocab.words, frozenset({vocab.eos})
    live, existing = trt_requests(rng, vocab, int(rng.integers(1, 6)))
    capacity = 8 * (K + 1)
    engine = TrtGuidedDecoder(K, words, capacity, seed)
    stale = rng.integers(-(2**31), 2**31, size=(capacity, words), dtype=np.int64)
    ours = recipe["PortableGuidedDecoder"](
        lambda params: params.fresh(),
        size,
        K,
        stale.astype(np.int32),
        np.zeros(capacity, dtype=np.int32),
    )
    for slot, request in existing.items():  # running requests: each side its own matcher
        engine.matchers[slot] = request.fresh()
        ours.matchers[slot] = request.fresh()

    for _step in range(steps):
        running = [r for r in live if r.phase != "done"]
        if not running:
            return
        order = [r for r in running if r.phase != "generation"]
        order += [r for r in running if r.phase == "generation"]
        drafts: dict[int, list[int]] = {}
        for r in order:
            if r.phase == "generation":
                state = None if r.grammar is None else Request(r.grammar, list(r.tokens))
                drafts[r.slot] = draw_drafts(rng, vocab, state, False, None, K)
            else:
                drafts[r.slot] = []
        views = [engine_views(r, drafts[r.slot]) for r in order]
        model_bitmask, model_mask = engine.build([v[0] for v in views])
        model_bitmask, model_mask = model_bitmask.copy(), model_mask.copy()
        contexts = [v[1] for v, r in zip(views, order, strict=True) if r.phase != "generation"]
        generations = [v[1] for v, r in zip(views, order, strict=True) if r.phase == "generation"]
        total = ours.build(contexts, generations)
        assert total == len(model_mask)
        blocks = [drafts[r.slot] + [PADDING] * (K - len(drafts[r.slot])) for r in order]
        widths = [1 if r.phase != "generation" else K + 1 for r in order]
        logits = draft_logits(rng, size, blocks, K + 1)
        starts = np.cumsum([0, *widths])
        keep = np.concatenate(
            [np.arange(b * (K + 1), b * (K + 1) + w) for b, w in enumerate(widths)]
        )
        logits = logits[keep]
        masked_model = trt_apply(logits, model_bitmask, model_mask)
        masked_ours = trt_apply(logits, ours.bitmask_host[:total], ours.token_mask_host[:total])
        np.testing.assert_array_equal(masked_ours, masked_model)

        accepted: dict[int, int] = {}
        for b, r in enumerate(order):
            rows = slice(starts[b], starts[b + 1])
            if r.phase == "chunk":
                r.phase = "context"  # its last chunk comes next step
                continue
            if r.phase == "context":
                choice = int(np.argmax(masked_ours[rows][0]))
                assert choice == int(np.argmax(masked_model[rows][0]))
                r.tokens = [choice]
                r.phase = "done" if choice in stops else "generation"
                continue
            count, emitted = greedy_verify(masked_model[rows], drafts[r.slot], stops)
            assert greedy_verify(masked_ours[rows], drafts[r.slot], stops) == (count, emitted)
            accepted[r.slot] = count
            views[b][1].py_num_accepted_draft_tokens = count
            r.tokens += drafts[r.slot][:count]
            if emitted[-1] in stops:
                r.phase = "done"
            else:
                r.tokens.append(emitted[-1])
        engine.rollback_rejected([v[0] for v in views], accepted)
        ours.commit(generations)
        for r in order:
            if r.grammar is None or r.phase in ("chunk", "context"):
                continue
            # both hold every committed token but the newest (taken at the next build)
            committed = r.tokens if r.phase == "done" else r.tokens[:-1]
            want = matcher_state(Request(r.grammar, committed).fresh(), PROBE, words)
            assert matcher_state(engine.matchers[r.slot], PROBE, words) == want
            assert matcher_state(ours.matchers[r.slot], PROBE, words) == want, r.slot


@pytest.fixture(scope="module")
def trt_recipe() -> dict[str, Any]:
    return load_recipe("tensorrt-llm")


@pytest.mark.parametrize("seed", range(8))
def test_tensorrt_llm_recipe_matches_tensorrt_llm(smollm2, trt_recipe, seed):
    """Contexts and generation requests in one batch, unguided ones, ragged drafts, over
    three steps: identical masked logits, tokens and matcher states."""
    trt_run(smollm2, seed, trt_recipe)


# -- the comparisons can fail --------------------------------------------------------------------

VLLM_BREAKS = {
    "drafts shifted onto node 0": ("chains[b, 1 : 1 + len(drafts)]", "chains[b, : len(drafts)]"),
    "grammar list order ignored": (
        "for b, req_id in enumerate(structured_output_request_ids):",
        "for b, req_id in enumerate(reversed(structured_output_request_ids)):",
    ),
    "no reasoning rule": ("reasoning=ends,", "reasoning=None,"),
    "reasoning from the root everywhere": (
        "reasoning[b] = not self.should_fill_bitmask(request)",
        "reasoning[b] = True",
    ),
}


@pytest.mark.parametrize("broken", sorted(VLLM_BREAKS))
def test_a_broken_vllm_recipe_is_caught(smollm2, broken):
    recipe = load_recipe("vllm", [VLLM_BREAKS[broken]])
    parser = parser_for(smollm2)
    with pytest.raises(AssertionError):
        for seed in SEEDS:
            rng = np.random.default_rng([seed, 1, 1])
            batch = draw_vllm_batch(rng, smollm2, parser)
            vllm_step(smollm2, batch, parser, "full", recipe, rng)


TRT_BREAKS = {
    "new token not taken": ("not matcher.accept_token(new_token)", "False"),
    "no commit": ("if matcher.is_terminated():\n                    break", "break"),
    "token mask cleared": ("guided if built is not None else 0", "0"),
    "context rows after the generations": ("slice(0, n), 1)", "slice(total - n, total), 1)"),
}


@pytest.mark.parametrize("broken", sorted(TRT_BREAKS))
def test_a_broken_tensorrt_llm_recipe_is_caught(smollm2, broken):
    recipe = load_recipe("tensorrt-llm", [TRT_BREAKS[broken]])
    with pytest.raises(AssertionError):
        for seed in range(8):
            trt_run(smollm2, seed, recipe)
