"""The vLLM plugin's guidance path (every request an llguidance grammar, no reasoning parser),
without vLLM: a stand-in manager and ``GuidanceGrammar`` wrapper shaped like vLLM's (its
``ll_matcher``, ``ll_tokenizer`` and ``terminated`` flag), real llguidance matchers over
SmolLM2's vocabulary, and every row checked against a token-by-token replay on a fresh matcher
with vLLM's rule for guidance grammars (fill, take the draft, ... as its wrapper does; the
parser decides, a complete grammar takes any draft without consuming it, the end token ends
the grammar, a refused draft repeats the row before it). Both ways are checked: the whole step
in one compiled call, and the same rules in Python. The same path inside real vLLM, against
vLLM's own fill: tests/real_vllm/test_replay.py."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from portable_spec import native as compiled
from portable_spec import testing as samples
from portable_spec.integrations.vllm import bitmask as plugin
from portable_spec.integrations.vllm import guidance as guidance_path
from portable_spec.pending import hold_matchers, release_matchers

llguidance = pytest.importorskip("llguidance")

K = 4
WORDS = 1536
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class GuidanceGrammar:
    """vLLM's guidance wrapper as the plugin reads it."""

    def __init__(self, matcher, tokenizer, terminated=False):
        self.ll_matcher = matcher
        self.ll_tokenizer = tokenizer
        self.terminated = terminated


class StructuredOutputRequest:
    def __init__(self, grammar):
        self._grammar = grammar

    @property
    def grammar(self):
        return self._grammar


class _Tensor:
    def __init__(self, array):
        self.array = array

    def numpy(self):
        return self.array


def _manager(reasoner=None, words=WORDS):
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            num_speculative_tokens=K,
            model_config=SimpleNamespace(is_diffusion=False),
            scheduler_config=SimpleNamespace(max_num_seqs=12),
        ),
        backend=SimpleNamespace(
            # 7 is no row the build writes: every row a call returns must be written by it
            allocate_token_bitmask=lambda n: _Tensor(np.full((n, words), 7, dtype=np.int32))
        ),
        _grammar_bitmask=None,
        enable_in_reasoning=False,
        reasoner_cls=reasoner,
        _get_constraint_bounds=lambda request, tokens: (0, 0),
    )


@pytest.fixture(scope="module")
def grammars():
    """Two grammars: the JSON schema with and without flexible whitespace (without it,
    llguidance's masks keep to canonical tokens while its parser takes others too)."""
    tight = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    return [samples.llguidance_grammar("json_schema"), tight]


def _fresh(grammar, prefix, tokenizer=None):
    tokenizer = tokenizer or samples.llguidance_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.try_consume_tokens(prefix) == len(prefix)
    return matcher


def _mask(matcher, words=WORDS):
    row = np.zeros(words, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return row


def _allowed(row):
    bits = (row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1)).tolist()


def _expected(grammar, prefix, drafts, eos, terminated, tokenizer=None, words=WORDS):
    """vLLM's rows for one guidance request, token by token on a fresh matcher (a draft past
    the tokenizer's vocabulary is one the matcher does not take)."""
    rows = []
    matcher = _fresh(grammar, prefix, tokenizer)
    if terminated:
        return np.full((len(drafts) + 1, words), -1, dtype=np.int32)
    ended = padded = False
    failed = None
    for i, token in enumerate([*drafts, None]):
        if failed is not None:
            rows.append(rows[failed])
            continue
        rows.append(np.full(words, -1, np.int32) if ended or padded else _mask(matcher, words))
        if token is None or padded:
            continue
        if token == -1:
            padded = True
        elif ended:
            failed = i
        else:
            ended = token == eos
            if not matcher.is_stopped() and matcher.try_consume_tokens([token]) != 1:
                failed = i
    return np.array(rows, dtype=np.int32)


def _random_request(rng, grammars, eos, kind):
    """(grammar, prefix, drafts) of a request in a random state."""
    grammar = rng.choice(grammars)
    probe = _fresh(grammar, [])
    prefix = []
    for _ in range(rng.randrange(12)):
        allowed = [t for t in _allowed(_mask(probe)) if t != eos]
        if not allowed or probe.is_stopped():
            break
        prefix.append(rng.choice(allowed))
        assert probe.try_consume_tokens(prefix[-1:]) == 1
    if kind == "complete":  # the grammar ends: only the end token may follow
        grammar, text = grammars[1], samples.load_tokenizer().encode('{"name":"a","age":1}')
        probe, prefix = _fresh(grammar, text), list(text)
        assert probe.is_stopped()
        return grammar, prefix, rng.choice([[eos], [eos, 5], [5], [5, 6, eos], [5, -1], []])
    drafts = []
    if kind == "outside":  # a draft the mask refuses and the parser takes: '{' for '{"'
        grammar, prefix = grammars[1], []
        probe = _fresh(grammar, prefix)
        brace = samples.load_tokenizer().encode("{")
        assert len(brace) == 1 and brace[0] not in _allowed(_mask(probe))
        assert probe.try_consume_tokens(brace) == 1
        drafts = brace
    for _ in range(rng.randrange(K + 1 - len(drafts))):
        row = _mask(probe)
        allowed = _allowed(row)
        if kind == "eos" and eos in allowed:
            drafts.append(eos)
            break
        allowed = [t for t in allowed if t != eos]
        if kind == "refused" or not allowed:
            candidates = [t for t in rng.sample(range(3, 49152), 400) if t not in set(allowed)]
            if not candidates:  # (inside a string nearly every token is allowed)
                break
            drafts.append(candidates[0])
            if rng.random() < 0.5 and len(drafts) < K:
                drafts.append(rng.randrange(3, 49152))
            break
        drafts.append(rng.choice(allowed))
        assert probe.try_consume_tokens(drafts[-1:]) == 1
    if kind == "padded" and drafts:
        cut = rng.randrange(len(drafts))
        drafts = drafts[:cut] + [-1] * (len(drafts) - cut)
    return grammar, prefix, drafts


KINDS = ("valid", "valid", "refused", "outside", "eos", "padded", "complete", "terminated")


def _step(rng, grammars, batch):
    tokenizer = samples.llguidance_tokenizer()
    eos = tokenizer.eos_token
    requests, spec, expected = {}, {}, []
    for i in range(batch):
        kind = rng.choice(KINDS)
        grammar, prefix, drafts = _random_request(rng, grammars, eos, kind)
        wrapper = GuidanceGrammar(_fresh(grammar, prefix), tokenizer, kind == "terminated")
        rid = f"r{i}"
        requests[rid] = SimpleNamespace(structured_output_request=StructuredOutputRequest(wrapper))
        if drafts or rng.random() < 0.5:
            spec[rid] = drafts
        expected.append(_expected(grammar, prefix, drafts, eos, kind == "terminated"))
    return requests, spec, expected


def _states(requests):
    return [
        (m.is_stopped(), m.stop_reason(), _mask(m).tobytes())
        for m in (r.structured_output_request.grammar.ll_matcher for r in requests.values())
    ]


def _spy(monkeypatch, owner, name):
    taken = []
    function = getattr(owner, name)

    def spy(*args):
        result = function(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(owner, name, spy)
    return taken


@pytest.mark.parametrize("way", ["compiled", "python"])
@pytest.mark.parametrize("layout", ["packed", "strided"])
def test_guidance_steps_match_replay(grammars, layout, way, monkeypatch):
    """Every guidance step is written by the guidance path (spied), row for row as the replay
    says, every matcher back in its state; ``compiled``: from the second step on in one
    compiled call (spied); ``python``: the compiled call declines every step."""
    if way == "compiled" and compiled.native is None:
        pytest.skip("the compiled helper is not built")
    if way == "python":
        monkeypatch.setattr(compiled, "vllm_guidance", lambda *args: None)
    taken = _spy(monkeypatch, plugin, "guidance_rows")
    read = _spy(monkeypatch, compiled, "vllm_guidance")
    rng = random.Random(f"guidance/{layout}")
    for step in range(16):
        requests, spec, expected = _step(rng, grammars, rng.randrange(1, 13))
        manager = _manager()
        ids = list(requests)
        for call in ("first", "again"):
            before = _states(requests)
            if manager._grammar_bitmask is not None:
                manager._grammar_bitmask.numpy()[:] = 7
            read.clear()
            built = plugin.build_or_none(manager, requests, ids, spec, layout=layout)
            out = built.rows
            assert taken[-1], f"step {step} left the guidance path"
            if call == "again":  # the wrapper class and tokenizer are known by now
                assert read == [way == "compiled"]
            assert _states(requests) == before
            row, unwritten = 0, []
            for rows in expected:
                np.testing.assert_array_equal(out[row : row + len(rows)], rows)
                row += len(rows)
                if layout == "strided":
                    tail = K + 1 - len(rows)
                    assert (out[row : row + tail] == -1).all()
                    unwritten.extend(range(row, row + tail))
                    row += tail
            assert len(out) == row
            assert built.unwritten == unwritten


@pytest.mark.parametrize("way", ["compiled", "python"])
def test_unusual_guidance_steps_decline_before_any_matcher_moves(grammars, way, monkeypatch):
    """A draft that is neither a token nor ``-1`` padding, a chain longer than the strided
    rows, a reasoning parser, another backend, a matcher another build holds, a matcher in its
    error state: the guidance path returns None, no matcher has moved; the checked path then
    takes the step (or gives it to vLLM)."""
    if way == "compiled" and compiled.native is None:
        pytest.skip("the compiled helper is not built")
    if way == "python":
        monkeypatch.setattr(compiled, "vllm_guidance", lambda *args: None)
    rng = random.Random("guidance/unusual")
    requests, _, _ = _step(rng, grammars, 3)
    for r in requests.values():
        r.structured_output_request.grammar.terminated = False
    spec = {rid: [rng.randrange(3, 49152)] for rid in requests}
    ids = list(requests)
    manager = _manager()
    assert plugin.build_or_none(manager, requests, ids, spec) is not None  # learns
    buffer = manager._grammar_bitmask.numpy()
    before = _states(requests)
    cases = [
        (manager, requests, dict(spec, r1=[-2]), 0),
        (manager, requests, dict(spec, r1=[49152]), 0),
        (manager, requests, dict(spec, r1=[5, 6]), 2),
    ]
    reasoning = _manager(reasoner=object)
    cases.append((reasoning, requests, spec, 0))
    other = dict(requests, r2=SimpleNamespace(structured_output_request=StructuredOutputRequest(
        SimpleNamespace(ll_matcher=None))))  # fmt: skip
    cases.append((manager, other, spec, 0))
    for owner, reqs, drafts, stride in cases:
        assert guidance_path.guidance_rows(owner, reqs, ids, drafts, stride, buffer) is None
        assert _states(requests) == before
    # objects not shaped as vLLM's: declined, not raised (drafts that are not ints, an id
    # with no request, a wrapper without a tokenizer, a mask wider than the tokenizer's)
    bare = SimpleNamespace(ll_matcher=requests["r1"].structured_output_request.grammar.ll_matcher)
    odd = dict(requests, r1=SimpleNamespace(structured_output_request=StructuredOutputRequest(
        GuidanceGrammar(bare.ll_matcher, None))))  # fmt: skip
    wide = np.zeros((buffer.shape[0], WORDS + 1), dtype=np.int32)
    shapes = [
        (requests, ids, dict(spec, r1=[5.0]), buffer),
        (requests, ids, dict(spec, r1=["5"]), buffer),
        (requests, ids, dict(spec, r1=[True]), buffer),
        (requests, ids, dict(spec, r1=5), buffer),
        (requests, [*ids, "gone"], spec, buffer),
        (odd, ids, spec, buffer),
        (requests, ids, spec, wide),
    ]
    for reqs, which, drafts, rows in shapes:
        assert guidance_path.guidance_rows(manager, reqs, which, drafts, 0, rows) is None
        assert _states(requests) == before
    matcher = requests["r0"].structured_output_request.grammar.ll_matcher
    token, held = hold_matchers([matcher])
    try:
        assert guidance_path.guidance_rows(manager, requests, ids, spec, 0, buffer) is None
    finally:
        release_matchers(token, held)
    assert _states(requests) == before
    broken = _fresh(grammars[0], [])
    assert not broken.consume_tokens([5])  # refused: the error state, for good
    wrapper = requests["r1"].structured_output_request.grammar
    wrapper.ll_matcher = broken
    # its chain is cut short (it takes nothing), then the matcher is asked: declined
    assert guidance_path.guidance_rows(manager, requests, ids, spec, 0, buffer) is None
    assert _states({k: v for k, v in requests.items() if k != "r1"}) == [before[0], before[2]]
    # a matcher in its error state with no drafts to walk is asked too
    assert guidance_path.guidance_rows(manager, requests, ids, {}, 0, buffer) is None


# -- drafts past the tokenizer's vocabulary ---------------------------------------------------
PAST_VOCAB = 49157  # SmolLM2's 49152 tokens and five ids of no token
PAST_WORDS = 1537  # its mask: ids 49157..49183 lie inside it, past the vocabulary


@pytest.mark.parametrize("way", ["compiled", "python"])
@pytest.mark.parametrize("layout", ["packed", "strided"])
def test_drafts_past_the_tokenizer_vocabulary_are_refused(grammars, layout, way, monkeypatch):
    """A draft at or past the tokenizer's vocabulary but inside the mask (a padding id of
    logits wider than the tokenizer) is never handed to llguidance, which would take it for an
    error it never leaves: it is a draft the matcher does not take (vLLM's rule repeats the
    row before it; a complete grammar takes it without consuming it), on random steps of
    both layouts, row for row as the replay says, no matcher moved or in its error state."""
    if way == "compiled" and compiled.native is None:
        pytest.skip("the compiled helper is not built")
    if way == "python":
        monkeypatch.setattr(compiled, "vllm_guidance", lambda *args: None)
    taken = _spy(monkeypatch, plugin, "guidance_rows")
    tokenizer = samples.llguidance_tokenizer(PAST_VOCAB)
    eos = tokenizer.eos_token
    rng = random.Random(f"guidance/past/{layout}")
    past_seen = 0
    for step in range(12):
        requests, spec, expected = {}, {}, []
        for i in range(rng.randrange(1, 9)):
            kind = rng.choice(KINDS)
            grammar, prefix, drafts = _random_request(rng, grammars, eos, kind)
            padded = drafts.index(-1) if -1 in drafts else len(drafts)
            if padded and rng.random() < 0.7:  # one draft (or more) past the vocabulary
                for _ in range(rng.choice([1, 1, 2])):
                    drafts[rng.randrange(padded)] = rng.randrange(PAST_VOCAB, 32 * PAST_WORDS)
                past_seen += 1
            elif rng.random() < 0.3:  # one past it before any other
                drafts = [rng.randrange(PAST_VOCAB, 32 * PAST_WORDS), *drafts][:K]
                past_seen += 1
            matcher = _fresh(grammar, prefix, tokenizer)
            wrapper = GuidanceGrammar(matcher, tokenizer, kind == "terminated")
            rid = f"r{i}"
            requests[rid] = SimpleNamespace(
                structured_output_request=StructuredOutputRequest(wrapper)
            )
            spec[rid] = drafts
            expected.append(
                _expected(grammar, prefix, drafts, eos, kind == "terminated", tokenizer, PAST_WORDS)
            )
        matchers = [r.structured_output_request.grammar.ll_matcher for r in requests.values()]
        before = [(m.is_stopped(), _mask(m, PAST_WORDS).tobytes()) for m in matchers]
        manager = _manager(words=PAST_WORDS)
        for _ in ("first", "again"):
            out = plugin.build_or_none(manager, requests, list(requests), spec, layout=layout).rows
            assert taken[-1], f"step {step} left the guidance path"
            assert not any(m.is_error() for m in matchers)
            assert [(m.is_stopped(), _mask(m, PAST_WORDS).tobytes()) for m in matchers] == before
            row = 0
            for rows in expected:
                np.testing.assert_array_equal(out[row : row + len(rows)], rows)
                row += K + 1 if layout == "strided" else len(rows)
    assert past_seen > 10


def test_the_compiled_reader_takes_its_attribute_names_as_a_tuple_of_str(grammars):
    if compiled.native is None:
        pytest.skip("the compiled helper is not built")
    buffer = np.zeros((4, WORDS), dtype=np.int32)
    args = ({}, [], {}, set(), guidance_path._eos, buffer, 0)
    assert compiled.vllm_guidance(*args, guidance_path._NAMES) is None  # an empty step
    for bad in (list(guidance_path._NAMES), guidance_path._NAMES[:4], (*"abcd", 5)):
        with pytest.raises(TypeError, match="tuple of 5 str"):
            compiled.vllm_guidance(*args, bad)
