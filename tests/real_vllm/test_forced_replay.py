"""Forced drafts on vLLM's own scheduler code, replayed without an engine.

vLLM's real ``Scheduler.update_draft_token_ids`` (wrapped by the plugin) runs on a scheduler
holding vLLM's real ``StructuredOutputManager`` and real xgrammar wrappers over SmolLM2's
tokenizer (the schema workloads, the grammar compiled as vLLM compiles it), with drafts as a
drafter hands them over. Checked against vLLM itself: the extended drafts start with what
vLLM kept and pass vLLM's own ``validate_tokens`` whole; the budget (``max_tokens``, the
model's context), the requests left alone (prefill chunks, finished, unstructured, terminated
grammars, still reasoning), shadow mode, configurations whose drafts stay vLLM's; every
matcher back in its state.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

from vllm.sampling_params import StructuredOutputsParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402
from vllm.v1.structured_output.request import StructuredOutputRequest  # noqa: E402

from portable_spec.integrations import vllm as plugin  # noqa: E402
from portable_spec.integrations.vllm import internals, state  # noqa: E402
from portable_spec.testing import SCHEMA_EXAMPLES, SCHEMA_WORKLOADS  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.environ.get("PORTABLE_SPEC_VLLM_MODEL", os.path.join(HERE, "..", "..", ".vllm-model"))
K = 4
VOCAB = 49152
END = 1  # the stand-in reasoning end token (<|im_start|>)


class EndTokenReasoner:
    """A reasoning parser whose reasoning ends at token END (vLLM's parser interface)."""

    def __init__(self, tokenizer, **kwargs):
        self.tokenizer = tokenizer

    def is_reasoning_end(self, input_ids):
        return END in input_ids

    def is_reasoning_end_streaming(self, input_ids, delta_ids):
        return END in delta_ids


@pytest.fixture(scope="module")
def world():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.abspath(MODEL))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info)
    grammars = {
        name: compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        for name, (schema, _prompt) in SCHEMA_WORKLOADS.items()
    }
    # as vLLM compiles it with disable_any_whitespace: its start is forced (`{"tool_call_type`)
    strict = json.dumps(SCHEMA_WORKLOADS["tool_call"][0])
    grammars["strict"] = compiler.compile_json_schema(strict, any_whitespace=False)
    outputs = {
        name: tokenizer.encode(json.dumps(SCHEMA_EXAMPLES[name]), add_special_tokens=False)
        for name in SCHEMA_WORKLOADS
    }
    outputs["strict"] = outputs["tool_call"]
    return SimpleNamespace(tokenizer=tokenizer, grammars=grammars, outputs=outputs)


def _wrapper(world, name):
    import xgrammar as xgr

    ctx = world.grammars[name]
    return XgrammarGrammar(
        matcher=xgr.GrammarMatcher(ctx, max_rollback_tokens=K), vocab_size=VOCAB, ctx=ctx
    )


def _config(**spec):
    speculative = SimpleNamespace(method="ngram", rejection_sample_method="standard", **spec)
    return SimpleNamespace(
        num_speculative_tokens=K,
        speculative_config=speculative,
        scheduler_config=SimpleNamespace(async_scheduling=False, max_num_seqs=16),
        model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB, is_diffusion=False),
    )


def _scheduler(world, config=None, reasoning=False, max_model_len=1024):
    manager = object.__new__(StructuredOutputManager)  # vLLM's class and methods
    manager.vllm_config = config or _config()
    manager.enable_in_reasoning = False
    manager.reasoner_cls = EndTokenReasoner if reasoning else None
    manager.tokenizer = world.tokenizer
    scheduler = object.__new__(Scheduler)
    scheduler.requests = {}
    scheduler.structured_output_manager = manager
    scheduler.vllm_config = manager.vllm_config
    scheduler.max_model_len = max_model_len
    return scheduler


class Request(SimpleNamespace):
    def is_finished(self):
        return self.finished

    @property
    def num_output_tokens(self):
        return len(self.output_token_ids)

    @property
    def num_tokens(self):
        return len(self.all_token_ids)

    @property
    def all_token_ids(self):
        return [*self.prompt_token_ids, *self.output_token_ids]


def _request(world, scheduler, req_id, name, at, *, max_tokens=256, reasoning_ended=None, **kw):
    """A request of workload ``name`` that has written the first ``at`` tokens of its output."""
    wrapper = _wrapper(world, name)
    output = world.outputs[name][:at]
    for t in output:
        assert wrapper.accept_tokens(req_id, [t])
    schema = json.dumps(SCHEMA_WORKLOADS["tool_call" if name == "strict" else name][0])
    state = StructuredOutputRequest(params=StructuredOutputsParams(json=schema))
    state.grammar = wrapper
    state.reasoning_ended = reasoning_ended
    request = Request(
        request_id=req_id,
        finished=False,
        is_prefill_chunk=False,
        use_structured_output=True,
        spec_token_ids=[],
        max_tokens=max_tokens,
        prompt_token_ids=[5, 6, 7],
        output_token_ids=list(output),
        structured_output_request=state,
    )
    request.__dict__.update(kw)
    scheduler.requests[req_id] = request
    return request


def _print(wrapper):
    m = wrapper.matcher
    return (m.is_terminated(), m.find_jump_forward_string(), wrapper.num_processed_tokens)


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.delenv(state.FORCED_ENV_VAR, raising=False)
    monkeypatch.setenv(state.WRITINGS_ENV_VAR, "0")  # each test states what it uses
    monkeypatch.setenv(state.LOOKUP_ENV_VAR, "0")
    plugin.reset_stats()
    assert plugin.install("on")
    assert state.SWITCHES == {"forced": "on", "writings": "off", "lookup": "off"}
    yield
    plugin.uninstall()
    monkeypatch.undo()
    state.read_switches()


def _step(scheduler, proposals):
    ids = list(proposals)
    Scheduler.update_draft_token_ids(
        scheduler, SimpleNamespace(req_ids=ids, draft_token_ids=[list(proposals[r]) for r in ids])
    )


def test_drafts_are_vllms_kept_drafts_then_what_the_grammar_forces(world, patched):
    scheduler = _scheduler(world)
    names = ["tool_call", "invoice"]
    requests = {}
    for name in names:
        out = world.outputs[name]
        for at in range(0, len(out) - 2, 3):
            requests[f"{name}/{at}"] = _request(world, scheduler, f"{name}/{at}", name, at)
    proposals = {}
    for i, req_id in enumerate(requests):
        name, at = req_id.split("/")
        out = world.outputs[name][int(at) :]
        proposals[req_id] = [out[0], 40000 + i] if i % 3 == 0 else (out[:2] if i % 3 else [])
    before = {r: _print(q.structured_output_request.grammar) for r, q in requests.items()}
    _step(scheduler, proposals)
    extended = 0
    for req_id, request in requests.items():
        wrapper = request.structured_output_request.grammar
        assert _print(wrapper) == before[req_id]  # every matcher back in its state
        kept = wrapper.validate_tokens(list(proposals[req_id]))  # what vLLM keeps
        got = request.spec_token_ids
        assert got[: len(kept)] == kept and len(got) <= K
        assert wrapper.validate_tokens(list(got)) == got  # vLLM's own validation takes all
        extended += len(got) > len(kept)
    assert extended > len(requests) // 3
    stats = plugin.integration_stats()
    assert stats["forced_drafted"] > 0 and stats["forced_steps"] == 1


def test_the_budget_and_the_requests_left_alone(world, patched):
    scheduler = _scheduler(world, max_model_len=3 + 20 + 2)
    name = "tool_call"
    full = _request(world, scheduler, "full", name, 1)  # `{"` written: a key is forced
    short = _request(world, scheduler, "short", name, 1, max_tokens=3)  # 2 left: 1 draft
    room = _request(world, scheduler, "room", name, 20)  # 2 positions left in the context
    chunk = _request(world, scheduler, "chunk", name, 1, is_prefill_chunk=True)
    done = _request(world, scheduler, "done", name, 1, finished=True)
    free = _request(world, scheduler, "free", name, 1, use_structured_output=False)
    _step(scheduler, {r: [] for r in scheduler.requests})
    assert len(full.spec_token_ids) >= 3
    assert len(short.spec_token_ids) == 1 and len(room.spec_token_ids) <= 1
    for request in (chunk, done, free):
        assert request.spec_token_ids == []


def test_nothing_is_forced_while_reasoning(world, patched):
    scheduler = _scheduler(world, reasoning=True)
    name = "strict"  # its start is forced: a request still reasoning must not get it
    thinking = _request(world, scheduler, "thinking", name, 0, reasoning_ended=False)
    ending = _request(world, scheduler, "ending", name, 0, reasoning_ended=False)
    answered = _request(world, scheduler, "answered", name, 0, reasoning_ended=True)
    brace = world.tokenizer.convert_tokens_to_ids('{"')
    _step(scheduler, {"thinking": [300, 301], "ending": [300, END, brace], "answered": [brace]})
    assert thinking.spec_token_ids == [300, 301]  # vLLM's, nothing forced
    assert ending.spec_token_ids[:3] == [300, END, brace] and len(ending.spec_token_ids) == K
    forced = ending.spec_token_ids[3:]  # the grammar from its start after the end token
    assert answered.spec_token_ids[1:2] == forced


def test_shadow_mode_and_configurations_whose_drafts_stay_vllms(world, patched):
    scheduler = _scheduler(world)
    request = _request(world, scheduler, "r", "tool_call", 1)
    assert plugin.install("shadow")  # the plugin's shadow mode: counted, never scheduled
    _step(scheduler, {"r": []})
    assert request.spec_token_ids == []
    assert plugin.integration_stats()["forced_would_draft"] > 0
    assert plugin.install("on")
    rules = {
        "ngram": ("", {}),
        "eagle greedy": ("", {"method": "eagle3", "draft_sample_method": "greedy"}),
        "eagle sampled": (
            "probabilities",
            {"method": "eagle3", "draft_sample_method": "probabilistic"},
        ),
        "synthetic": ("rejection sampling", {"rejection_sample_method": "synthetic"}),
        "ngram_gpu": ("speculative method", {"method": "ngram_gpu"}),
        "async": ("async scheduling", {}),
        "reasoning parser": ("", {}),  # requests still reasoning: the test above
    }
    for label, (why, spec) in rules.items():
        config = _config()
        config.speculative_config.__dict__.update(spec)
        config.scheduler_config.async_scheduling = label == "async"
        if label == "reasoning parser":
            config.structured_outputs_config = SimpleNamespace(
                reasoning_parser="deepseek_r1", enable_in_reasoning=False
            )
        got = internals.forced_drafts_rule(config)
        assert (why in got and got) if why else got == "", (label, got)
        scheduler = _scheduler(world, config)
        request = _request(world, scheduler, "r", "tool_call", 1)
        _step(scheduler, {"r": []})
        assert bool(request.spec_token_ids) == (not why), label


def test_the_model_s_writing_of_a_forced_text_is_drafted_next_time(world, patched, monkeypatch):
    """What the model wrote after a forced text (here: a key in short pieces, then the colon
    and the quote) is drafted for the next request meeting that text, checked by the grammar;
    vLLM's own drafts still come first."""
    monkeypatch.setitem(state.SWITCHES, "writings", "on")
    scheduler = _scheduler(world)
    tok = world.tokenizer
    first = _request(world, scheduler, "first", "tool_call", 1)  # `{"`: `tool_call_type"`
    _step(scheduler, {"first": []})
    assert tok.decode(first.spec_token_ids) == "tool_call_"  # the tokenizer's pieces, K of them
    pieces = [tok.convert_tokens_to_ids(p) for p in ("t", "ool", "_", "call")]
    written = [*pieces, *tok.encode('_type": "', add_special_tokens=False)]
    for t in written:  # the model wrote it its own way
        assert first.structured_output_request.grammar.accept_tokens("first", [t])
    first.output_token_ids += written
    _step(scheduler, {"first": []})  # the step that sees it
    second = _request(world, scheduler, "second", "tool_call", 1)
    _step(scheduler, {"second": []})
    assert second.spec_token_ids == written[:K]
    third = _request(world, scheduler, "third", "tool_call", 1)
    _step(scheduler, {"third": [tok.convert_tokens_to_ids("tool")]})  # vLLM's draft first
    assert third.spec_token_ids[0] == tok.convert_tokens_to_ids("tool")


def test_the_switch(world, patched, monkeypatch):
    """``PORTABLE_SPEC_FORCED_DRAFTS``: ``0`` leaves vLLM's drafts, ``shadow`` counts them,
    a misspelt value stops the install before anything is patched; read at each install."""
    scheduler = _scheduler(world)
    monkeypatch.setenv(state.FORCED_ENV_VAR, "0")
    assert plugin.install("on")
    off = _request(world, scheduler, "off", "tool_call", 1)
    _step(scheduler, {"off": []})
    assert off.spec_token_ids == []
    monkeypatch.setenv(state.FORCED_ENV_VAR, "shadow")
    assert plugin.install("on")
    shadow = _request(world, scheduler, "shadow", "tool_call", 1)
    _step(scheduler, {"shadow": []})
    assert shadow.spec_token_ids == []
    assert plugin.integration_stats()["forced_would_draft"] > 0
    plugin.uninstall()
    monkeypatch.setenv(state.FORCED_ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=state.FORCED_ENV_VAR):
        plugin.install("on")
    assert not plugin.is_installed()
    monkeypatch.setenv(state.FORCED_ENV_VAR, "1")
    assert plugin.install("on")
    on = _request(world, scheduler, "on", "tool_call", 1)
    _step(scheduler, {"on": []})
    assert len(on.spec_token_ids) == K


def test_async_scheduling_keeps_vllms_drafts(world, patched):
    """Under async scheduling the worker's drafts are in the forward before the scheduler sees
    them: ``update_draft_token_ids_in_output`` stays vLLM's own function, and a scheduler
    configured for async scheduling keeps vLLM's drafts in ``update_draft_token_ids`` too."""
    own = Scheduler.update_draft_token_ids_in_output
    assert getattr(own, "__portable_spec_original__", None) is None
    assert getattr(Scheduler.update_draft_token_ids, "__portable_spec_original__", None)
    config = _config()
    config.scheduler_config.async_scheduling = True
    scheduler = _scheduler(world, config)
    request = _request(world, scheduler, "r", "tool_call", 1)
    _step(scheduler, {"r": []})
    assert request.spec_token_ids == []
    assert plugin.integration_stats()["forced_drafted"] == 0
