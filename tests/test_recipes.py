"""The porting guide's TensorRT-LLM recipe against that engine's own row semantics.

The recipe is the code block of ``docs/porting/tensorrt-llm.md`` marked ``# recipe: tensorrt-llm``,
executed as it is printed. The engine's behaviour is ``tests/_engine_rows.py``: TensorRT-LLM's
build, ``token_mask`` and rollback, re-implemented on its own fresh matchers. (vLLM is tested
against vLLM itself: tests/real_vllm, through the plugin that replaces the manual recipe.) Both sides mask the
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
from _cases import allowed_tokens
from _engine_rows import (
    PADDING,
    ReasoningParser,
    TrtGuidedDecoder,
    TrtRequest,
    greedy_verify,
    trt_apply,
)
from _oracle import Request, matcher_state

ROOT = Path(__file__).resolve().parents[1]
RECIPE_PAGE = "docs/porting/tensorrt-llm.md"
K = 4  # drafts per request (vLLM's num_speculative_tokens, TensorRT-LLM's max_draft)
KINDS = ("json_schema", "builtin_json", "ebnf", "regex")
PROBE = [0, 1, 2, 18, 33, 75, 104, 107, 109]
SEEDS = range(12)


def load_recipe(name: str, edits: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Execute the porting guide's ``# recipe: <name>`` block (after ``edits``, each an
    ``(old, new)`` replacement that must apply); return its namespace."""
    text = (ROOT / RECIPE_PAGE).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    chosen = [b for b in blocks if b.startswith(f"# recipe: {name} ")]
    assert len(chosen) == 1, f"{RECIPE_PAGE} needs exactly one '# recipe: {name}' block"
    source = chosen[0]
    for old, new in edits:
        assert old in source, f"the {name} recipe no longer contains {old!r}"
        source = source.replace(old, new)
    namespace: dict[str, Any] = {"__name__": f"porting_recipe_{name.replace('-', '_')}"}
    exec(compile(source, f"{RECIPE_PAGE} ({name} recipe)", "exec"), namespace)
    return namespace


# -- drawing requests and drafts ---------------------------------------------------------------


def token_id(vocab: Any, text: str) -> int:
    return vocab.tokens.index(text)


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
