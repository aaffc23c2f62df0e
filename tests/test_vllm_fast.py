"""The vLLM plugin's one-function path for common steps (every request an xgrammar grammar,
no reasoning parser, no padding), without vLLM: a stand-in manager and grammar wrapper
shaped like vLLM's, real xgrammar matchers over SmolLM2's vocabulary, and every row checked
against a per-node replay on fresh matchers with vLLM's row rule on top (a refused draft
repeats the row before it on every later row of its request). Both ways of walking are
checked: the whole step in one compiled call (xgrammar's methods called through tvm-ffi's C
ABI) and, when a matcher has no handle for that, each request through xgrammar's Python
binding. The same path inside real vLLM, against vLLM's own fill:
tests/real_vllm/test_replay.py."""

from __future__ import annotations

import random
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
from _oracle import Request, expected_rows_and_live, fill_row

import portable_spec as ps
from portable_spec import native as compiled
from portable_spec.engines import xgrammar as xgrammar_engine
from portable_spec.engines.base import MatcherInfo
from portable_spec.integrations.vllm import bitmask as plugin
from portable_spec.integrations.vllm import xgrammar as fast_path

K = 4


class XgrammarGrammar:
    """vLLM's xgrammar wrapper as the plugin reads it: ``matcher`` and ``is_terminated()``."""

    def __init__(self, matcher):
        self.matcher = matcher

    def is_terminated(self):
        return self.matcher.is_terminated()


class StructuredOutputRequest:
    """vLLM's per-request structured-output state as the plugin reads it: the grammar in
    ``_grammar``, behind a ``grammar`` property (vLLM's resolves a pending compilation)."""

    def __init__(self, grammar):
        self._grammar = grammar

    @property
    def grammar(self):
        return self._grammar


def _held(grammar):
    """A request as vLLM's scheduler holds it, with ``grammar``."""
    return SimpleNamespace(structured_output_request=StructuredOutputRequest(grammar))


class _Tensor:
    """vLLM's bitmask tensor as the plugin reads it (``numpy()``)."""

    def __init__(self, array):
        self.array = array

    def numpy(self):
        return self.array


def _manager(words, reasoner=None):
    manager = SimpleNamespace(
        vllm_config=SimpleNamespace(
            num_speculative_tokens=K,
            model_config=SimpleNamespace(is_diffusion=False),
            scheduler_config=SimpleNamespace(max_num_seqs=8),
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
    return manager


def _random_request(rng, vocab, kind):
    """(oracle request, drafts): a JSON-schema request in a random state with its drafts."""
    compiled = vocab.grammars["json_schema"]
    probe = Request(compiled).fresh()
    prefix = []
    for _ in range(rng.randrange(10)):
        row = fill_row(probe, vocab.words, vocab.words * 32)
        allowed = [t for t in np.flatnonzero(_bits(row)).tolist() if t != vocab.eos]
        if not allowed:
            break
        t = rng.choice(allowed)
        assert probe.accept_token(t)
        prefix.append(t)
    drafts = []
    length = rng.randrange(K + 1)
    while len(drafts) < length and not probe.is_terminated():
        row = fill_row(probe, vocab.words, vocab.words * 32)
        allowed = np.flatnonzero(_bits(row)).tolist()
        if kind == "eos" and vocab.eos in allowed:
            drafts.append(vocab.eos)
            break
        allowed = [t for t in allowed if t != vocab.eos]
        if (kind == "refused" and len(drafts) == length - 1) or not allowed:
            refused = np.flatnonzero(_bits(row)[: vocab.size] == 0).tolist()
            if not refused:
                break
            drafts.append(rng.choice(refused))
            if rng.random() < 0.5 and len(drafts) < K:  # a draft after the refused one
                drafts.append(rng.randrange(vocab.size))
            break
        t = rng.choice(allowed)
        assert probe.accept_token(t)
        drafts.append(t)
    return Request(compiled, prefix), drafts


def _bits(row):
    return (row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)).reshape(-1) & 1


def _expected(request, drafts, vocab):
    """vLLM's rows of one request by fresh-matcher replay: the library's contract per node,
    then the row before the first refused draft repeated on every later row."""
    n = len(drafts) + 1
    next_token = [*range(1, n), -1]
    rows, live = expected_rows_and_live(
        request.fresh, next_token, [-1] * n, [0, *drafts], vocab.words * 32, vocab.words
    )
    for j in range(1, n):
        if live[j - 1] and not live[j]:
            m, refused = request.fresh(), True
            for t in drafts[:j]:
                m.accept_token(t)
            refused = not m.is_terminated()  # a stop token's child is not a refusal
            if refused:
                rows[j:] = rows[j - 1]
            break
    return rows


def _step(rng, vocab, batch, kinds=("valid", "valid", "refused", "eos", "done")):
    requests, spec, expected = {}, {}, []
    for i in range(batch):
        kind = rng.choice(kinds)
        oracle, drafts = _random_request(rng, vocab, kind)
        matcher = oracle.fresh()
        if kind == "done":  # a request whose grammar has ended
            matcher = Request(vocab.compiler.compile_grammar('root ::= "a"')).fresh()
            assert matcher.accept_token(vocab.tokens.index("a"))
            assert matcher.accept_token(vocab.eos) and matcher.is_terminated()
            oracle = None
        rid = f"r{i}"
        requests[rid] = _held(XgrammarGrammar(matcher))
        if drafts or rng.random() < 0.5:
            spec[rid] = drafts
        n = len(drafts) + 1
        if oracle is None:
            expected.append(np.full((n, vocab.words), -1, dtype=np.int32))
        else:
            expected.append(_expected(oracle, drafts, vocab))
    return requests, spec, expected


def _state(requests, vocab):
    out = []
    for r in requests.values():
        m = r.structured_output_request.grammar.matcher
        done = m.is_terminated()
        out.append((done, None if done else fill_row(m, vocab.words, vocab.words * 32)))
    return out


def _walks(monkeypatch, direct):
    """Count the compiled one-call walks; with ``direct`` False, every matcher's handle is 0
    (as when the compiled helper cannot call xgrammar itself) and the per-request walk runs."""
    if compiled.native is None:
        pytest.skip("the compiled helper is not built")
    fast_path.forget_grammars()
    calls = []
    walk = compiled.walk_chains
    pack = compiled.pack_chains

    def spy(*args):
        calls.append(len(args[2]))
        return walk(*args)

    def pack_spy(*args):  # a pack that walks (a limit given): one call over every request
        if len(args) > 8:
            calls.append(len(args[0]))
        return pack(*args)

    read = compiled.vllm_chains

    def read_spy(*args):  # vLLM's objects read and walked in one call (when it takes the step)
        result = read(*args)
        if result is not None:
            calls.append(("read", len(args[1])))
        return result

    monkeypatch.setattr(compiled, "walk_chains", spy)
    monkeypatch.setattr(compiled, "pack_chains", pack_spy)
    monkeypatch.setattr(compiled, "vllm_chains", read_spy)
    if not direct:
        monkeypatch.setattr(compiled, "xgrammar_handle", lambda matcher: 0)
    elif not compiled.xgrammar_handle(Request(xgr_any_grammar()).fresh()):
        pytest.skip("xgrammar's methods cannot be called through tvm-ffi's C ABI here")
    return calls


def xgr_any_grammar():
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b"])).compile_grammar('root ::= "a"')


@pytest.mark.parametrize("walk", ["one_call", "per_request"])
@pytest.mark.parametrize("layout", ["packed", "strided"])
def test_common_steps_match_replay(smollm2, layout, walk, monkeypatch):
    """Every common step is written by the one-function path (spied), row for row as the
    replay says, every matcher back in its state; the rows past a strided request's chain
    are all-allowed and listed as unwritten. ``one_call``: the step is exactly one compiled
    walk over every request; ``per_request``: no matcher has a handle for the compiled
    helper, so no compiled walk runs and xgrammar's Python binding walks each request."""
    vocab = smollm2
    rng = random.Random(f"fast/{layout}")
    taken = []
    fast = plugin.fast_rows
    walks = _walks(monkeypatch, walk == "one_call")

    def spy(*args):
        result = fast(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(plugin, "fast_rows", spy)
    for _ in range(12):
        batch = rng.randrange(1, 9)
        requests, spec, expected = _step(rng, vocab, batch)
        manager = _manager(vocab.words)
        ids = list(requests)
        # the first call learns each matcher's facts (its width probed); the next ones read
        # vLLM's objects in compiled code
        for step in ("learns", "steady", "steady"):
            before = _state(requests, vocab)
            if manager._grammar_bitmask is not None:
                manager._grammar_bitmask.numpy()[:] = 7  # every row must be written again
            walks.clear()
            built = plugin.build_or_none(manager, requests, ids, spec, layout=layout)
            out = built.rows
            assert taken[-1]
            if walk == "per_request":
                assert walks == []
            elif step == "learns":
                # one call, one chain per request (it asks each matcher whether it has ended)
                assert walks == [batch]
            else:
                assert walks == [("read", batch)]
            after = _state(requests, vocab)
            for (t0, r0), (t1, r1) in zip(before, after, strict=True):
                assert t0 == t1 and (r0 is None or np.array_equal(r0, r1))
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


def test_one_matcher_without_handle_walks_each_request(smollm2, monkeypatch):
    """One live matcher the compiled helper cannot call is enough to walk every request
    through xgrammar's Python binding; the rows are the replay's either way."""
    vocab = smollm2
    walks = _walks(monkeypatch, True)
    rng = random.Random("fast/mixed")
    requests, spec, expected = _step(rng, vocab, 6, kinds=("valid", "refused", "eos"))
    ids = list(requests)
    odd = requests["r3"].structured_output_request.grammar.matcher
    handle = compiled.xgrammar_handle
    monkeypatch.setattr(compiled, "xgrammar_handle", lambda m: 0 if m is odd else handle(m))
    manager = _manager(vocab.words)
    plugin.build_or_none(manager, requests, ids, spec)  # learns the widths
    buffer = manager._grammar_bitmask.numpy()
    buffer[:] = 7
    walks.clear()
    out = plugin.fast_rows(manager, requests, ids, spec, 0, buffer)
    assert out is not None and walks == [] and out.unwritten == []
    np.testing.assert_array_equal(out.rows, np.concatenate(expected))


@pytest.mark.parametrize("walk", ["one_call", "per_request"])
def test_a_walk_xgrammar_refuses_is_named_and_goes_to_the_checked_path(smollm2, walk, monkeypatch):
    """xgrammar refusing a walk (here: a matcher of a smaller vocabulary taken for the
    model's width) raises MatcherError naming the request, every matcher back in its state;
    the plugin then gives the step to its checked path, which refuses it too: vLLM's own fill
    takes the step (``build_or_none`` returns None)."""
    import xgrammar as xgr

    vocab = smollm2
    walks = _walks(monkeypatch, walk == "one_call")
    rng = random.Random("fast/refused")
    requests, spec, _ = _step(rng, vocab, 4, kinds=("valid",))
    ids = list(requests)
    manager = _manager(vocab.words)
    plugin.build_or_none(manager, requests, ids, spec)  # learns the widths
    small = xgr.TokenizerInfo(vocab.tokens[:1000])
    narrow = xgr.GrammarMatcher(xgr.GrammarCompiler(small).compile_grammar('root ::= "a"+'))
    stop = xgrammar_engine.xgrammar_info(requests["r0"].structured_output_request.grammar.matcher)
    xgrammar_engine._cache.put(
        narrow, MatcherInfo(vocab.words, vocab.words * 32, stop.stop_ids, stop.stop_set)
    )
    handle = compiled.xgrammar_handle(narrow)
    if handle:  # the compiled walks read the same (wrong) width from the facts table
        facts = (weakref.ref(narrow), handle, vocab.words, vocab.words * 32, stop.stop_ids)
        monkeypatch.setitem(xgrammar_engine.chain_facts, id(narrow), facts)
    requests["r2"] = SimpleNamespace(
        structured_output_request=SimpleNamespace(grammar=XgrammarGrammar(narrow))
    )
    spec["r2"] = [vocab.tokens.index("a")] * 2
    before = _state({k: v for k, v in requests.items() if k != "r2"}, vocab)
    buffer = manager._grammar_bitmask.numpy()
    walks.clear()
    with pytest.raises(ps.MatcherError) as info:
        plugin.fast_rows(manager, requests, ids, spec, 0, buffer)
    assert info.value.request_index == 2
    assert walks == ([4] if walk == "one_call" else [])
    assert plugin.build_or_none(manager, requests, ids, spec) is None
    after = _state({k: v for k, v in requests.items() if k != "r2"}, vocab)
    for (t0, r0), (t1, r1) in zip(before, after, strict=True):
        assert t0 == t1 and (r0 is None or np.array_equal(r0, r1))


@pytest.mark.parametrize("walk", ["one_call", "per_request"])
def test_unusual_steps_leave_the_fast_path_before_any_matcher_moves(smollm2, walk, monkeypatch):
    """Padding, a chain longer than the strided layout's rows, a reasoning parser, a matcher
    listed twice, another backend: the one-function path returns None and no matcher has
    moved; the checked path then builds the step."""
    vocab = smollm2
    _walks(monkeypatch, walk == "one_call")
    rng = random.Random("fast/unusual")
    requests, spec, _ = _step(rng, vocab, 3, kinds=("valid",))
    spec = {rid: spec.get(rid) or [vocab.tokens.index("{")] for rid in requests}
    ids = list(requests)
    manager = _manager(vocab.words)
    plugin.build_or_none(manager, requests, ids, spec)  # learns the widths
    buffer = manager._grammar_bitmask.numpy()
    assert plugin.fast_rows(manager, requests, ids, spec, 0, buffer) is not None

    before = _state(requests, vocab)
    cases = []
    padded = dict(spec, r2=[*spec["r2"][:1], -1])
    cases.append((manager, requests, ids, padded))
    cases.append((manager, requests, ids, dict(spec, r0=[-1, *spec["r0"]])))
    reasoning = _manager(vocab.words, reasoner=object)
    reasoning._grammar_bitmask = manager._grammar_bitmask
    cases.append((reasoning, requests, ids, spec))
    twice = dict(requests, r3=requests["r0"])
    cases.append((manager, twice, [*ids, "r3"], spec))
    other = dict(requests, r1=SimpleNamespace(structured_output_request=SimpleNamespace(
        grammar=SimpleNamespace(matcher=requests["r1"].structured_output_request.grammar.matcher))))  # fmt: skip
    cases.append((manager, other, ids, spec))
    for case in cases:
        buffer[:] = 7
        assert plugin.fast_rows(case[0], case[1], case[2], case[3], 0, buffer) is None
        assert (buffer == 7).all()
    # strided rows of 1 + 1 per request (stride 2): every chain fits them, then one is a
    # draft longer
    fits = {rid: tokens[:1] for rid, tokens in spec.items()}
    longer = dict(fits, r1=fits["r1"] * 2)
    for drafts, taken in ((fits, True), (longer, False)):
        buffer[:] = 7
        written = plugin.fast_rows(manager, requests, ids, drafts, 2, buffer)
        assert (written is not None) == taken
        assert taken or (buffer == 7).all()
        after = _state(requests, vocab)
        for (t0, r0), (t1, r1) in zip(before, after, strict=True):
            assert t0 == t1 and (r0 is None or np.array_equal(r0, r1))
        after = _state(requests, vocab)
        for (t0, r0), (t1, r1) in zip(before, after, strict=True):
            assert t0 == t1 and (r0 is None or np.array_equal(r0, r1))


def test_the_compiled_reader_reads_the_names_it_is_handed(smollm2, monkeypatch):
    """The compiled step reader knows no attribute name of vLLM's: objects of the same shape
    under other names are read through the names handed in, with the same rows; vLLM's names
    then find nothing there (declined), and names that are not a tuple of str are refused."""
    vocab = smollm2
    _walks(monkeypatch, True)
    rng = random.Random("fast/names")
    requests, spec, expected = _step(rng, vocab, 4, kinds=("valid", "refused"))
    ids = list(requests)
    manager = _manager(vocab.words)
    plugin.build_or_none(manager, requests, ids, spec)  # learns the grammars
    buffer = manager._grammar_bitmask.numpy()
    wrappers = {XgrammarGrammar}

    class Renamed:  # vLLM's wrapper under another name, its matcher too
        def __init__(self, grammar):
            self.engine_matcher = grammar.matcher

    renamed = {}
    for rid, request in requests.items():
        grammar = request.structured_output_request.grammar
        held = Renamed(grammar)
        renamed[rid] = SimpleNamespace(state=SimpleNamespace(field=held))
        # the facts the plugin learnt, for this object
        monkeypatch.setitem(fast_path._known, id(held), fast_path._known[id(grammar)])
    names = ("state", "field", "engine_matcher")
    args = (ids, spec, fast_path._known, {Renamed}, buffer, 0, fast_path._NO_STOPS)
    buffer[:] = 7
    out, walked, _ = compiled.vllm_chains(renamed, *args, names)
    assert walked[2] < 0  # nothing failed
    np.testing.assert_array_equal(out, np.concatenate(expected))
    buffer[:] = 7
    assert compiled.vllm_chains(renamed, *args, fast_path._NAMES) is None
    assert compiled.vllm_chains(requests, *args[:3], wrappers, *args[4:], names) is None
    assert (buffer == 7).all()
    for bad in (["state", "field", "engine_matcher"], ("state", "field"), ("a", "b", 3)):
        with pytest.raises(TypeError, match="tuple of 3 str"):
            compiled.vllm_chains(renamed, *args, bad)
