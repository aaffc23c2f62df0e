"""The plugin's rows against vLLM's own ``StructuredOutputManager.grammar_bitmask``, replayed.

No engine: vLLM's real method runs on a manager holding vLLM's real grammar wrappers
(xgrammar, guidance, outlines) over SmolLM2's tokenizer, on random steps (requests advanced
into random grammar states; drafts the grammar accepts, refuses, ends with EOS or pads with
-1; reasoning requests whose end token falls anywhere in the window), and the plugin's build
must write the same rows: vLLM 0.32's packed layout with 0.32's method, and 0.33's strided
layout with 0.33's method where its source is at hand (scripts/setup-vllm.sh fetches it).
Every matcher must be back in its state after both builds.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.structured_output import StructuredOutputManager as Manager032  # noqa: E402
from vllm.v1.structured_output.backend_guidance import GuidanceGrammar  # noqa: E402
from vllm.v1.structured_output.backend_outlines import OutlinesGrammar  # noqa: E402
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402
from vllm.v1.structured_output.request import StructuredOutputRequest  # noqa: E402

from portable_spec import native as compiled  # noqa: E402
from portable_spec.integrations import vllm as plugin  # noqa: E402
from portable_spec.integrations.vllm import bitmask, internals, state  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODEL = os.environ.get("PORTABLE_SPEC_VLLM_MODEL", os.path.join(ROOT, ".vllm-model"))
V033 = os.environ.get(
    "PORTABLE_SPEC_VLLM033_SOURCE",
    os.path.join(ROOT, ".venv-vllm", "vllm-0.33.0", "structured_output.py"),
)
K = 4
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        },
        "required": ["ok", "tags"],
        "additionalProperties": False,
    },
]


def _manager_033():
    if not os.path.exists(V033):
        pytest.skip(f"vLLM 0.33's structured_output/__init__.py not at {V033}")
    spec = importlib.util.spec_from_file_location("vllm033_structured_output", V033)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StructuredOutputManager


@pytest.fixture(scope="module")
def tokenizer():
    if not os.path.exists(os.path.join(MODEL, "tokenizer.json")):
        pytest.skip(f"no model directory at {MODEL}: run scripts/setup-vllm.sh")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


VOCAB = 49152


@pytest.fixture(scope="module")
def factories(tokenizer):
    """backend name -> (make a fresh wrapper for schema i, allocate rows)."""
    return make_factories(tokenizer)


def make_factories(tokenizer):
    """backend name -> (make a fresh wrapper for schema i, allocate rows)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import outlines_core as oc
    import xgrammar as xgr
    from vllm.v1.structured_output.utils import get_outlines_vocabulary

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info)
    compiled = [compiler.compile_json_schema(s, any_whitespace=False) for s in SCHEMAS]

    def xgrammar_wrapper(i):
        return XgrammarGrammar(
            vocab_size=VOCAB, matcher=xgr.GrammarMatcher(compiled[i]), ctx=compiled[i]
        )

    ll_tok = llguidance.hf.from_tokenizer(tokenizer)
    ll_grammars = [llguidance.LLMatcher.grammar_from_json_schema(s) for s in SCHEMAS]

    def guidance_wrapper(i):
        return GuidanceGrammar(
            ll_matcher=llguidance.LLMatcher(ll_tok, ll_grammars[i]),
            ll_tokenizer=ll_tok,
            vocab_size=VOCAB,
        )

    vocabulary = get_outlines_vocabulary(tokenizer)
    import json

    indexes = [
        oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(s)), vocabulary.inner)
        for s in SCHEMAS
    ]

    def outlines_wrapper(i):
        return OutlinesGrammar(
            vocab_size=VOCAB,
            eos_token_id=vocabulary.inner.get_eos_token_id(),
            guide=oc.Guide(indexes[i], max_rollback=K),
        )

    return {
        "xgrammar": (xgrammar_wrapper, lambda n: xgr.allocate_token_bitmask(n, VOCAB)),
        "guidance": (
            guidance_wrapper,
            lambda n: llguidance.torch.allocate_token_bitmask(n, ll_tok.vocab_size),
        ),
        "outlines": (
            outlines_wrapper,
            lambda n: torch.full((n, (VOCAB + 31) // 32), -1, dtype=torch.int32),
        ),
    }


END = 1  # the stand-in reasoning end token


class EndTokenReasoner:
    """A reasoning parser whose reasoning ends at token END (vLLM's parser interface)."""

    def __init__(self, tokenizer, **kwargs):
        self.tokenizer = tokenizer

    def is_reasoning_end(self, input_ids):
        return END in input_ids

    def is_reasoning_end_streaming(self, input_ids, delta_ids):
        return END in delta_ids


def _manager(cls, allocate, reasoning):
    manager = object.__new__(cls)  # vLLM's class and methods; the fields its fill reads
    manager.vllm_config = SimpleNamespace(
        num_speculative_tokens=K,
        model_config=SimpleNamespace(is_diffusion=False),
        scheduler_config=SimpleNamespace(max_num_seqs=16),
    )
    manager.backend = SimpleNamespace(allocate_token_bitmask=allocate)
    manager._grammar_bitmask = None
    manager._full_mask = torch.tensor(-1, dtype=torch.int32)
    manager.fill_bitmask_parallel_threshold = 128
    manager.enable_in_reasoning = False
    manager.reasoner_cls = EndTokenReasoner if reasoning else None
    manager.tokenizer = None
    return manager


def _allowed(wrapper, scratch):
    wrapper.fill_bitmask(scratch, 0)
    bits = scratch[0].numpy().view(np.uint32)
    ids = np.flatnonzero((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
    return ids[ids < VOCAB]


def _random_request(
    rng, make, scratch, reasoning, kinds=("valid", "valid", "refused", "padded", "eos")
):
    """A request in a random grammar state, with its drafts (the wrapper back in that state)."""
    wrapper = make(rng.randrange(len(SCHEMAS)))
    eos = 0  # SmolLM2's <|endoftext|>
    for _ in range(rng.randrange(12)):  # committed answer tokens
        allowed = [t for t in _allowed(wrapper, scratch).tolist() if t != eos]
        if not allowed or wrapper.is_terminated():
            break
        assert wrapper.accept_tokens("r", [rng.choice(allowed)])
    drafts, advanced = [], 0
    kind = rng.choice(kinds)
    length = rng.randrange(K + 1)
    while len(drafts) < length and not wrapper.is_terminated():  # (a stop token ends it too)
        allowed = _allowed(wrapper, scratch).tolist()
        if kind == "eos" and eos in allowed:
            drafts.append(eos)
            break
        allowed = [t for t in allowed if t != eos]
        if not allowed:
            break
        if kind == "refused" and len(drafts) == length - 1:
            taken = set(allowed)
            refused = [t for t in rng.sample(range(2, VOCAB), 256) if t not in taken]
            if refused:
                drafts.append(refused[0])
                break
        token = rng.choice(allowed)
        assert wrapper.accept_tokens("r", [token])
        drafts.append(token)
        advanced += 1
    if advanced:
        wrapper.rollback(advanced)
    if kind == "padded" and drafts:
        cut = rng.randrange(len(drafts))
        drafts = drafts[:cut] + [-1] * (len(drafts) - cut)
    # vLLM's own per-request record (the grammar behind its property), with 0.33's field too
    state = StructuredOutputRequest(params=None)
    state.grammar = wrapper
    state.masked_reasoning_end_ids = None
    prompt = [5, 6, 7]
    if reasoning and rng.random() < 0.6:  # still reasoning: the end token somewhere, or not
        state.reasoning_ended = False
        if drafts and rng.random() < 0.7:
            at = rng.randrange(len(drafts))
            drafts = [*[rng.randrange(2, 100) for _ in range(at)], END, *drafts[: K - at - 1]]
        else:
            drafts = [rng.randrange(2, 100) for _ in range(len(drafts))]
    elif reasoning:
        state.reasoning_ended = True
    request = SimpleNamespace(
        request_id=str(id(wrapper)),
        structured_output_request=state,
        prompt_token_ids=prompt,
        all_token_ids=[*prompt, 9, 9],
        use_structured_output=True,
    )
    return request, drafts


def _root_rows(requests, scratch):
    rows = []
    for request in requests.values():
        wrapper = request.structured_output_request.grammar
        wrapper.fill_bitmask(scratch, 0)
        rows.append((wrapper.is_terminated(), scratch[0].clone()))
    return rows


@pytest.mark.parametrize("backend", ["xgrammar", "guidance", "outlines"])
@pytest.mark.parametrize("version", ["0.32", "0.33"])
@pytest.mark.parametrize("reasoning", [False, True])
def test_rows_match_vllms_own_fill(factories, backend, version, reasoning):
    cls = Manager032 if version == "0.32" else _manager_033()
    layout = plugin.LAYOUTS[version]
    make, allocate = factories[backend]
    rng = random.Random(f"{backend}/{version}/{reasoning}")
    scratch = allocate(1)
    manager = _manager(cls, allocate, reasoning)
    compared = refused = 0
    for _step in range(25):
        batch = rng.randrange(1, 9)
        pairs = [_random_request(rng, make, scratch, reasoning) for _ in range(batch)]
        requests = {r.request_id: r for r, _ in pairs}
        spec = {r.request_id: d for r, d in pairs if d or rng.random() < 0.5}
        ids = list(requests)
        before = _root_rows(requests, scratch)
        built = bitmask.build_or_none(manager, requests, ids, spec, layout=layout, copy=True)
        assert built is not None
        ours, unwritten = built
        after = _root_rows(requests, scratch)  # the plugin's walk left every matcher as it was
        for (t0, r0), (t1, r1) in zip(before, after, strict=True):
            assert t0 == t1 and torch.equal(r0, r1)
        # (vLLM's own fill may not: a refused draft puts an llguidance matcher in its error
        # state; such steps come last in a request's life here, fresh requests each step.)
        theirs = cls.grammar_bitmask(manager, requests, ids, spec)
        assert ours.shape == theirs.shape
        keep = np.ones(len(ours), dtype=bool)
        keep[unwritten] = False
        differing = np.flatnonzero((ours != theirs).any(axis=1) & keep)
        assert differing.size == 0, f"rows {differing.tolist()} differ (step {_step})"
        compared += int(keep.sum())
        refused += sum(1 for _, d in pairs if d and d[-1] not in (-1, 0))
    assert compared > 100


def _spy_taken(monkeypatch, owner, name):
    """Wrap ``owner.name`` for the test; the list returned gets, per call, whether it took
    the step (returned anything but None)."""
    taken = []
    function = getattr(owner, name)

    def spy(*args):
        result = function(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(owner, name, spy)
    return taken


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_common_steps_take_the_fast_path(factories, version, monkeypatch):
    """Steps whose requests are all xgrammar ones, without padding or a reasoning parser, are
    written by the plugin's one-function path (spied): a grammar's first step by its Python
    path, the next by the compiled read of vLLM's own objects where the helper can call
    xgrammar (spied too); every row equal to vLLM's own fill, every matcher back in its
    state."""
    cls = Manager032 if version == "0.32" else _manager_033()
    layout = plugin.LAYOUTS[version]
    make, allocate = factories["xgrammar"]
    rng = random.Random(f"fast/{version}")
    scratch = allocate(1)
    manager = _manager(cls, allocate, False)
    taken = _spy_taken(monkeypatch, bitmask, "fast_rows")
    read = _spy_taken(monkeypatch, compiled, "vllm_chains")
    compared = 0
    for _step in range(25):
        batch = rng.randrange(1, 9)
        pairs = [
            _random_request(rng, make, scratch, False, ("valid", "refused", "eos"))
            for _ in range(batch)
        ]
        requests = {r.request_id: r for r, _ in pairs}
        spec = {r.request_id: d for r, d in pairs if d or rng.random() < 0.5}
        ids = list(requests)
        bitmask.build_or_none(manager, requests, ids, spec, layout=layout)  # learns facts
        assert taken[-1], f"step {_step} left the fast path"
        read.clear()
        before = _root_rows(requests, scratch)
        ours, unwritten = bitmask.build_or_none(
            manager, requests, ids, spec, layout=layout, copy=True
        )
        assert taken[-1], f"step {_step} left the fast path"
        if compiled.walks_xgrammar():
            assert read == [True], f"step {_step} was not read in compiled code"
        after = _root_rows(requests, scratch)
        for (t0, r0), (t1, r1) in zip(before, after, strict=True):
            assert t0 == t1 and torch.equal(r0, r1)
        theirs = cls.grammar_bitmask(manager, requests, ids, spec)
        assert ours.shape == theirs.shape
        keep = np.ones(len(ours), dtype=bool)
        keep[unwritten] = False
        differing = np.flatnonzero((ours != theirs).any(axis=1) & keep)
        assert differing.size == 0, f"rows {differing.tolist()} differ (step {_step})"
        compared += int(keep.sum())
    assert compared > 100


def _complete_request(tokenizer, make, scratch, tail):
    """A request whose grammar is complete (``{"name":"a","age":1}`` consumed: llguidance
    stopped, only the end token may follow), with drafts ``tail``."""
    wrapper = make(0)
    for token in tokenizer.encode('{"name":"a","age":1}'):
        assert wrapper.accept_tokens("r", [token])
    assert wrapper.ll_matcher.is_stopped() and not wrapper.is_terminated()
    state = StructuredOutputRequest(params=None)
    state.grammar = wrapper
    state.masked_reasoning_end_ids = None
    request = SimpleNamespace(
        request_id=f"done{id(wrapper)}",
        structured_output_request=state,
        prompt_token_ids=[5],
        all_token_ids=[5, 9],
        use_structured_output=True,
    )
    return request, list(tail)


def _outside_request(tokenizer, rng):
    """A request at the start of a JSON schema without flexible whitespace, its first draft
    ``{``: llguidance's mask allows only ``{"`` there, its parser takes ``{`` too (vLLM
    consumes it and fills the next rows from there)."""
    import llguidance
    import llguidance.hf

    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMAS[0], defaults={"whitespace_flexible": False}
    )
    ll_tok = llguidance.hf.from_tokenizer(tokenizer)
    wrapper = GuidanceGrammar(
        ll_matcher=llguidance.LLMatcher(ll_tok, grammar), ll_tokenizer=ll_tok, vocab_size=VOCAB
    )
    brace = tokenizer.convert_tokens_to_ids("{")
    row = torch.zeros((1, VOCAB // 32), dtype=torch.int32)
    wrapper.fill_bitmask(row, 0)
    assert not (int(row[0, brace >> 5]) >> (brace & 31)) & 1  # outside the mask
    state = StructuredOutputRequest(params=None)
    state.grammar = wrapper
    state.masked_reasoning_end_ids = None
    request = SimpleNamespace(
        request_id=f"brace{id(wrapper)}",
        structured_output_request=state,
        prompt_token_ids=[5],
        all_token_ids=[5, 9],
        use_structured_output=True,
    )
    return request, [brace, *tokenizer.encode('"name"')][: rng.randrange(1, K + 1)]


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_guidance_steps_take_the_fast_path(tokenizer, factories, version, monkeypatch):
    """Steps whose requests are all guidance ones, without a reasoning parser, are written by
    the plugin's guidance path (spied; one llguidance call per chain), read by the compiled
    call from the step after a wrapper class and tokenizer were first seen (spied too):
    drafts accepted, refused by the parser, outside the parent's mask, padded, ending in the
    end token, after a complete grammar (the end token or another), and terminated wrappers;
    every row equal to vLLM's own fill, every matcher back in its state."""
    cls = Manager032 if version == "0.32" else _manager_033()
    layout = plugin.LAYOUTS[version]
    make, allocate = factories["guidance"]
    rng = random.Random(f"guidance/{version}")
    scratch = allocate(1)
    manager = _manager(cls, allocate, False)
    taken = _spy_taken(monkeypatch, bitmask, "guidance_rows")
    read = _spy_taken(monkeypatch, compiled, "vllm_guidance")
    compared = 0
    for _step in range(30):
        batch = rng.randrange(1, 9)
        pairs = [_random_request(rng, make, scratch, False) for _ in range(batch)]
        if _step % 3 == 0:  # a complete grammar offered the end token, or anything else
            eos = 2  # the wrappers' end token (<|im_end|>)
            tail = rng.choice([[eos], [eos, 5], [5], [5, 6, eos], [5, -1, -1], [-1, -1], []])
            pairs.append(_complete_request(tokenizer, make, scratch, tail))
        if _step % 3 == 1:  # a draft outside its parent's mask that the parser takes
            pairs.append(_outside_request(tokenizer, rng))
        if _step % 4 == 1:  # a wrapper vLLM marked terminated
            request, drafts = _random_request(rng, make, scratch, False)
            request.structured_output_request.grammar.terminated = True
            pairs.append((request, drafts))
        requests = {r.request_id: r for r, _ in pairs}
        spec = {r.request_id: d for r, d in pairs if d or rng.random() < 0.5}
        ids = list(requests)
        bitmask.build_or_none(manager, requests, ids, spec, layout=layout)  # learns facts
        read.clear()
        before = _root_rows(requests, scratch)
        ours, unwritten = bitmask.build_or_none(
            manager, requests, ids, spec, layout=layout, copy=True
        )
        assert taken[-1], f"step {_step} left the guidance path"
        if compiled.native is not None:
            assert read == [True], f"step {_step} was not read in compiled code"
        after = _root_rows(requests, scratch)
        for (t0, r0), (t1, r1) in zip(before, after, strict=True):
            assert t0 == t1 and torch.equal(r0, r1)
        theirs = cls.grammar_bitmask(manager, requests, ids, spec)
        assert ours.shape == theirs.shape
        keep = np.ones(len(ours), dtype=bool)
        keep[unwritten] = False
        differing = np.flatnonzero((ours != theirs).any(axis=1) & keep)
        assert differing.size == 0, f"rows {differing.tolist()} differ (step {_step})"
        compared += int(keep.sum())
    assert compared > 100


def test_off_by_default(monkeypatch):
    """Installed and registered, the plugin changes nothing until PORTABLE_SPEC_VLLM asks."""
    from portable_spec.integrations.entry_points import vllm_general_plugins

    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    before = Manager032.grammar_bitmask
    vllm_general_plugins()
    assert Manager032.grammar_bitmask is before and not plugin.is_installed()
    monkeypatch.setenv(plugin.ENV_VAR, "0")
    vllm_general_plugins()
    assert Manager032.grammar_bitmask is before and not plugin.is_installed()


def test_install_and_uninstall(monkeypatch):
    """install() patches this vLLM (0.32, recognised by its source) in either mode, switches
    modes in place, and uninstall() gives vLLM its method back; the entry point installs it
    when PORTABLE_SPEC_VLLM asks."""
    from portable_spec.integrations.entry_points import vllm_general_plugins

    before = Manager032.grammar_bitmask
    try:
        assert plugin.install("shadow") and plugin.is_installed()
        patched = Manager032.grammar_bitmask
        assert patched is not before and state.INTEGRATION.mode == "shadow"
        assert plugin.install() and Manager032.grammar_bitmask is patched
        assert state.INTEGRATION.mode == "on" and state.INTEGRATION.revision == "0.32"
        plugin.uninstall()
        assert Manager032.grammar_bitmask is before and not plugin.is_installed()
        monkeypatch.setenv(plugin.ENV_VAR, "shadow")
        vllm_general_plugins()
        assert plugin.is_installed() and state.INTEGRATION.mode == "shadow"
        monkeypatch.setenv(plugin.ENV_VAR, "yes")
        with pytest.raises(ValueError, match=plugin.ENV_VAR):
            vllm_general_plugins()
    finally:
        plugin.uninstall()
    assert Manager032.grammar_bitmask is before


def test_unknown_version_keeps_vllms_fill(monkeypatch, caplog):
    from portable_spec.integrations.entry_points import vllm_general_plugins

    plugin.reset_stats()  # the warning is said once per process
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setattr(internals, "version", lambda: "0.99.0")
    before = Manager032.grammar_bitmask
    with caplog.at_level("WARNING", logger="vllm.portable_spec"):
        vllm_general_plugins()
    assert Manager032.grammar_bitmask is before and not plugin.is_installed()
    warnings = [r.getMessage() for r in caplog.records if r.name == "vllm.portable_spec"]
    assert len(warnings) == 1 and "0.99.0" in warnings[0]
    assert plugin.layout_for("0.99.0") is None
    assert plugin.layout_for("0.32.0") == "packed" and plugin.layout_for("0.33.1") == "strided"


def test_a_source_that_differs_keeps_vllms_fill(monkeypatch, caplog):
    """A vLLM 0.32 whose xgrammar wrapper is not the one the plugin reads (another class of
    that name): not patched, one warning naming it."""
    from vllm.v1.structured_output import backend_xgrammar

    class XgrammarGrammar:  # fields the plugin would misread
        pass

    plugin.reset_stats()
    monkeypatch.setattr(backend_xgrammar, "XgrammarGrammar", XgrammarGrammar)
    before = Manager032.grammar_bitmask
    with caplog.at_level("WARNING", logger="vllm.portable_spec"):
        assert not plugin.install()
    assert Manager032.grammar_bitmask is before and not plugin.is_installed()
    warnings = [r.getMessage() for r in caplog.records if r.name == "vllm.portable_spec"]
    assert len(warnings) == 1 and "backend_xgrammar:XgrammarGrammar" in warnings[0]


def test_the_release_table_holds_this_vllms_source():
    """The 0.32 row of the table is the installed vLLM's source (what install() checks)."""
    sources = state.INTEGRATION.new_patch_set().sources()
    assert internals.REVISIONS["0.32"].sources == {
        target: digest for target, digest in sources.items() if digest is not None
    }
    bans = "vllm.v1.structured_output:StructuredOutputManager._masked_reasoning_ends"
    assert sources[bans] is None  # 0.33's


def _text_source_hash(path: str, qualname: str) -> str:
    """SHA-256 of a definition's source read from a file without importing it."""
    import ast
    import hashlib

    with open(path) as f:
        text = f.read()
    node: ast.AST = ast.parse(text)
    for part in qualname.split("."):
        node = next(
            n
            for n in ast.iter_child_nodes(node)
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == part
        )
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    lines = text.splitlines(keepends=True)[first - 1 : node.end_lineno]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def test_the_release_table_holds_vllm_033s_source(monkeypatch):
    """The 0.33 row is vLLM 0.33's source (its structured-output modules as shipped, each
    loaded from scripts/setup-vllm.sh's copy on top of 0.32's package; its scheduler and
    request modules, which do not import on 0.32, read as text: the definition's lines, from
    its first decorator, as ``inspect.getsource`` gives them)."""
    folder = os.path.join(os.path.dirname(V033), "structured_output")
    if not os.path.isdir(folder):
        pytest.skip(f"vLLM 0.33's structured_output/ not at {folder}")
    from portable_spec.integrations.patching import source_hash

    as_text = {
        "vllm.v1.core.sched.scheduler": os.path.join(
            os.path.dirname(V033), "core/sched/scheduler.py"
        ),
        "vllm.v1.request": os.path.join(os.path.dirname(V033), "request.py"),
    }
    modules: dict = {}
    found = {}
    for target in internals.REVISIONS["0.33"].sources:
        module_name, qualname = target.split(":")
        if module_name in as_text:
            found[target] = _text_source_hash(as_text[module_name], qualname)
            continue
        if module_name not in modules:
            tail = module_name.rsplit(".", 1)[-1]
            path = os.path.join(
                folder, "__init__.py" if tail == "structured_output" else f"{tail}.py"
            )
            spec = importlib.util.spec_from_file_location(f"vllm033_{tail}", path)
            module = importlib.util.module_from_spec(spec)
            monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look it up)
            spec.loader.exec_module(module)
            modules[module_name] = module
        value = modules[module_name]
        for part in qualname.split("."):
            value = getattr(value, part)
        found[target] = source_hash(value)
    assert found == dict(internals.REVISIONS["0.33"].sources)
