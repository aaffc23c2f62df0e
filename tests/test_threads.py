"""The compiled helper under callers that share objects across threads.

Engines build masks on one thread while another (a scheduler) changes what the build reads:
replaces a request's matcher in the list, rewrites the tree's links, clears a list a call is
reading. Every compiled walk owns what it reads without the GIL (a reference to each matcher,
private copies of tokens, links, spans and stop tokens), holds its matchers in the table of
builds in flight, and reads a caller's index once, bounded where it is used.

Two kinds of test:

* deterministic ones run the change at the exact moment another thread could: the walk hook
  (``portable_spec.native.set_walk_hook``) is called by every compiled walk right before it
  releases the GIL, after its checks. The rows must be the oracle's for the inputs as they
  were when the call was made (a per-node replay on fresh matchers, ``_oracle``);
* the crash reproductions race a second thread against the builds, in a subprocess (a
  crash there is a failed test, not a dead test run); they crashed the helper before every
  walk owned its inputs (SIGSEGV, or xgrammar's "states to be popped" abort).

The sanitizer build of the helper (``scripts/native-check.sh``) runs this file too.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import Request, expected_accepted, expected_rows, fill_row

import portable_spec as ps
import portable_spec.builder.routes as routes
from portable_spec import native as native_module
from portable_spec.engines import xgrammar as xgrammar_engine
from portable_spec.engines.xgrammar import probe_xgrammar
from portable_spec.integrations.vllm import xgrammar as vllm_xgrammar

compiled_only = pytest.mark.skipif(
    native_module.native is None, reason="portable_spec._native is not built here"
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bits(row):
    return (row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)).reshape(-1) & 1


def _grammar_chain(vocab, length, seed):
    """(request, drafts): a JSON-schema request and ``length`` drafts its grammar accepts."""
    rng = random.Random(seed)
    compiled = vocab.grammars["json_schema"]
    probe = Request(compiled).fresh()
    drafts = []
    while len(drafts) < length:
        row = fill_row(probe, vocab.words, vocab.size)
        allowed = [t for t in np.flatnonzero(_bits(row)[: vocab.size]).tolist() if t != vocab.eos]
        t = rng.choice(allowed)
        assert probe.accept_token(t)
        drafts.append(t)
    return Request(compiled), drafts


def _chain_rows(request, drafts, vocab):
    n = len(drafts) + 1
    nt, ns, dt = [*range(1, n), -1], [-1] * n, [0, *drafts]
    return (
        expected_rows(request.fresh, nt, ns, dt, vocab.size, vocab.words),
        expected_accepted(request.fresh, nt, ns, dt, vocab.size, vocab.words),
    )


class _Hook:
    """Runs ``action`` at the first compiled walk (then nothing); counts the walks."""

    def __init__(self, action):
        self.action, self.calls = action, 0

    def __call__(self):
        self.calls += 1
        if self.calls == 1:
            self.action()

    def __enter__(self):
        native_module.set_walk_hook(self)
        return self

    def __exit__(self, *exc):
        native_module.set_walk_hook(None)


def _probed(vocab, request):
    matcher = request.fresh()
    probe_xgrammar(matcher, vocab.words)
    return matcher


# -- deterministic: the change made where another thread could make it -------------------------
@compiled_only
@pytest.mark.parametrize("entry", ["chain_lists", "linear_chain", "packed_chains"])
def test_a_matcher_dropped_during_the_walk_is_still_walked(smollm2, entry):
    """The caller's list loses its matchers (the last references) while the walk runs: the
    walk holds its own references, and the rows are the oracle's."""
    pairs = [_grammar_chain(smollm2, 3 + b, seed=b) for b in range(3)]
    grammars = [_probed(smollm2, request) for request, _ in pairs]
    alive = [id(g) for g in grammars]

    def drop():
        grammars[:] = [None] * len(grammars)  # the only references the caller had
        gc.collect()

    lists = [d for _, d in pairs]
    with _Hook(drop) as hook:
        if entry == "chain_lists":
            mask = ps.build_chain_bitmask(grammars, lists, smollm2.size)
        elif entry == "linear_chain":
            width = max(len(d) for d in lists) + 1
            chains = np.array([[0, *d, *d[:1] * (width - 1 - len(d))] for d in lists], np.int64)
            lists = [row[1:].tolist() for row in chains]
            mask = ps.build_host_bitmask(
                grammars, ps.GrammarTree.from_linear_chain(chains), smollm2.size
            )
        else:
            flat = np.array([t for d in lists for t in (0, *d)], np.int64)
            offsets = np.cumsum([0, *[len(d) + 1 for d in lists]])
            mask = ps.build_host_bitmask(
                grammars, ps.GrammarTree.from_packed_chains(flat, offsets), smollm2.size
            )
    assert hook.calls == 1 and grammars == [None] * 3 and len(alive) == 3
    start = 0
    for (request, _), drafts in zip(pairs, lists, strict=True):
        want, _ = _chain_rows(request, drafts, smollm2)
        np.testing.assert_array_equal(mask[start : start + len(want)], want)
        start += len(want)


@compiled_only
def test_tokens_and_links_rewritten_during_the_walk_change_nothing(smollm2):
    """Host trees read in place (``from_host``): the caller rewrites the links (out of range,
    a cycle) and the tokens while the walk runs; the walk reads its own copies, checked as
    copied, and the rows and flags are the oracle's for the arrays as given."""
    from _cases import matrix_case
    from _oracle import expected_mask, expected_valid

    requests, nt, ns, dt, _ = matrix_case(smollm2, 8, 6)
    matchers = [None if r is None else _probed(smollm2, r) for r in requests]
    arrays = [np.array(a, dtype=np.int64) for a in (nt, ns, dt)]

    def rewrite():
        arrays[0][:] = 10**12
        arrays[0][:, 0] = 0  # the root its own child: a cycle
        arrays[1][:] = -(10**9)
        arrays[2][:] = smollm2.size + 7

    with _Hook(rewrite) as hook:
        mask, valid = ps.build_host_bitmask(
            matchers, ps.GrammarTree.from_host(*arrays), smollm2.size, return_valid=True
        )
    assert hook.calls == 1
    np.testing.assert_array_equal(
        mask, expected_mask(requests, nt, ns, dt, smollm2.size, smollm2.words)
    )
    np.testing.assert_array_equal(
        valid, expected_valid(requests, nt, ns, dt, smollm2.size, smollm2.words)
    )


@compiled_only
def test_stop_tokens_dropped_during_the_walk(smollm2, monkeypatch):
    """A stop set outside the shared table (past its bound) lives only as long as its
    matcher's facts: dropping the matcher and its facts during the walk leaves the walk its
    own copy, and the stop token still ends the chain."""
    monkeypatch.setattr(xgrammar_engine, "_MAX_STOP_SETS", 0)
    compiled = smollm2.compiler.compile_grammar('root ::= "{}"')
    stops = [smollm2.eos, 1]  # a stop set of its own
    probe = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
    drafts = []
    while not _bits(fill_row(probe, smollm2.words, smollm2.size))[smollm2.eos]:
        allowed = np.flatnonzero(_bits(fill_row(probe, smollm2.words, smollm2.size))).tolist()
        t = next(t for t in allowed if t not in stops)
        assert probe.accept_token(t)
        drafts.append(t)
    drafts.append(smollm2.eos)
    grammars = [xgr.GrammarMatcher(compiled, override_stop_tokens=stops)]
    probe_xgrammar(grammars[0], smollm2.words)

    def drop():
        key = id(grammars[0])
        grammars[0] = None
        xgrammar_engine.chain_facts.pop(key, None)
        gc.collect()

    with _Hook(drop) as hook:
        mask, valid = ps.build_chain_bitmask(grammars, [drafts], smollm2.size, return_valid=True)
    assert hook.calls == 1
    n = len(drafts) + 1
    assert valid.tolist() == [True] * n
    assert (mask[-1] == -1).all()  # the stop token: terminated, all-allowed
    fresh = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
    for j, t in enumerate(drafts):
        np.testing.assert_array_equal(mask[j], fill_row(fresh, smollm2.words, smollm2.size))
        if t != smollm2.eos:
            assert fresh.accept_token(t)


@compiled_only
def test_a_build_started_during_a_compiled_walk_is_refused(smollm2):
    """While a compiled build walks a matcher, another build over it (``wait=False`` or
    blocking, as from another thread) is refused with a ValueError; afterwards it runs."""
    request, drafts = _grammar_chain(smollm2, 3, seed=7)
    matcher = _probed(smollm2, request)
    tree = ps.GrammarTree.from_linear_chain(np.array([[0, *drafts]], np.int64))
    refused = []

    def start_others():
        for build in (
            lambda: ps.build_grammar_vocab_mask([matcher], tree, smollm2.size, wait=False),
            lambda: ps.build_host_bitmask([matcher], tree, smollm2.size),
            lambda: ps.build_chain_bitmask([matcher], [drafts], smollm2.size),
        ):
            with pytest.raises(ValueError, match="being walked by another build") as raised:
                build()
            refused.append(raised.value)

    with _Hook(start_others):
        mask = ps.build_chain_bitmask([matcher], [drafts], smollm2.size)
    assert len(refused) == 3
    want, _ = _chain_rows(request, drafts, smollm2)
    np.testing.assert_array_equal(mask, want)
    pending = ps.build_grammar_vocab_mask([matcher], tree, smollm2.size, wait=False)
    np.testing.assert_array_equal(pending.result(), want)


@compiled_only
def test_the_vllm_step_holds_what_it_read(smollm2):
    """vLLM's objects read by the compiled step: the wrapper loses its matcher and the
    request dict its entries during the walk; the rows are the oracle's (vLLM's rule)."""
    from test_vllm_fast import XgrammarGrammar, _held, _manager

    pairs = [_grammar_chain(smollm2, 2 + b, seed=20 + b) for b in range(3)]
    grammars = [XgrammarGrammar(r.fresh()) for r, _ in pairs]
    requests = {str(b): _held(g) for b, g in enumerate(grammars)}
    ids = list(requests)
    spec = {str(b): list(d) for b, (_, d) in enumerate(pairs)}
    manager = _manager(smollm2.words)
    buffer = np.full((16, smollm2.words), 7, dtype=np.int32)
    vllm_xgrammar.fast_rows(manager, requests, ids, spec, 0, buffer)  # learns the grammars

    def drop():  # every reference but the walk's own
        for g in grammars:
            g.matcher = None
        requests.clear()
        spec.clear()
        ids.clear()
        vllm_xgrammar.forget_grammars()
        gc.collect()

    with _Hook(drop) as hook:
        written = vllm_xgrammar.fast_rows(manager, requests, ids, spec, 0, buffer)
    assert hook.calls == 1 and written is not None
    out = written.rows
    start = 0
    for request, drafts in pairs:
        want, _ = _chain_rows(request, drafts, smollm2)
        np.testing.assert_array_equal(out[start : start + len(want)], want)
        start += len(want)


@compiled_only
def test_chains_walked_in_parts_hold_their_matchers(smollm2, monkeypatch):
    """A batch big enough to be walked in parts on the pool: the matchers dropped by the
    caller between the pack and the parts' walks are still walked, rows as the oracle's."""

    monkeypatch.setattr(routes, "ONE_THREAD_WORK", routes.work(8, smollm2.words))
    pairs = [_grammar_chain(smollm2, 3, seed=40 + b) for b in range(6)]
    grammars = [_probed(smollm2, request) for request, _ in pairs]

    def drop():
        grammars[:] = [None] * len(grammars)
        gc.collect()

    previous = ps.get_num_threads()
    ps.set_num_threads(2)
    try:
        with _Hook(drop) as hook:
            mask = ps.build_chain_bitmask(grammars, [d for _, d in pairs], smollm2.size)
    finally:
        ps.set_num_threads(previous)
    assert hook.calls >= 2  # walked in parts
    for b, (request, drafts) in enumerate(pairs):
        want, _ = _chain_rows(request, drafts, smollm2)
        np.testing.assert_array_equal(mask[4 * b : 4 * b + 4], want)


@compiled_only
def test_python_code_run_while_reading_arguments_is_harmless(smollm2):
    """Spans holding an object with ``__index__`` (which clears the list being read) are
    refused, not read (the race below shows what reading them did)."""

    class Clearing:  # not an int: reading it as one calls __index__
        def __init__(self, value):
            self.value = value

        def __index__(self):
            spans.clear()
            return self.value

    matcher = _probed(smollm2, Request(smollm2.grammars["json_schema"]))
    rows = np.zeros((2, smollm2.words), np.int32)
    tokens = np.zeros(2, np.int64)
    stops = np.zeros(0, np.int64)
    spans = [(Clearing(0), 0, 2)]
    with pytest.raises(ValueError, match="spans out of bounds or malformed"):
        native_module.walk_chains(rows, tokens, spans, [matcher], 64, stops, 0)
    spans = [(0, 0, Clearing(2), 1)]
    with pytest.raises(ValueError, match="spans out of bounds or malformed"):
        native_module.repair_chains(rows, tokens, spans, 64, stops, 0)


# -- crash reproductions: a second thread races the builds (in a subprocess) ------------------
_PRELUDE = """
import gc, random, sys, threading
import numpy as np, xgrammar as xgr
import portable_spec as ps
from portable_spec import native
from portable_spec.testing import compile_sample, load_vocab, tokenizer_info
info = tokenizer_info(load_vocab())
V = info.vocab_size
compiled = compile_sample(xgr.GrammarCompiler(info), "json_schema")
NEW_ABI = getattr(native.native, "ABI_VERSION", 1) >= 2
NAMES_ABI = getattr(native.native, "ABI_VERSION", 1) >= 4  # vLLM's names handed in

def grammar_chain(n, seed=0):
    rng, m, out = random.Random(seed), xgr.GrammarMatcher(compiled), []
    row = np.zeros((1, (V + 31) // 32), np.int32)
    while len(out) < n:
        m.fill_next_token_bitmask(row, 0)
        bits = np.unpackbits(row[0].view(np.uint8), bitorder="little")[:V]
        t = rng.choice([t for t in np.flatnonzero(bits).tolist() if t not in m.stop_token_ids])
        assert m.accept_token(t)
        out.append(t)
    return out

def race(work, disturb, rounds):
    stop = [False]
    def other():
        while not stop[0]:
            disturb()
    thread = threading.Thread(target=other)
    thread.start()
    try:
        for _ in range(rounds):
            work()
    finally:
        stop[0] = True
        thread.join()
    print("ok")
"""

_RACES = {
    "chain_lists_lose_their_matcher": """
chain = grammar_chain(40)
grammars = [xgr.GrammarMatcher(compiled)]
ps.build_chain_bitmask(grammars, [chain], V)
def disturb():
    grammars[0] = xgr.GrammarMatcher(compiled)
race(lambda: ps.build_chain_bitmask(grammars, [chain], V), disturb, 1500)
""",
    "linear_chain_loses_its_matcher": """
chain = np.array([[0, *grammar_chain(40)]], np.int64)
grammars = [xgr.GrammarMatcher(compiled)]
ps.build_host_bitmask(grammars, ps.GrammarTree.from_linear_chain(chain), V)
def disturb():
    grammars[0] = xgr.GrammarMatcher(compiled)
def work():
    ps.build_host_bitmask(grammars, ps.GrammarTree.from_linear_chain(chain), V)
race(work, disturb, 1500)
""",
    "tree_links_rewritten": """
n = 24
nt = np.array([[*range(1, n), -1]] * 2, np.int64)
ns = np.full((2, n), -1, np.int64)
dt = np.array([[0, *grammar_chain(n - 1, s)] for s in range(2)], np.int64)
grammars = [xgr.GrammarMatcher(compiled) for _ in range(2)]
ps.build_host_bitmask(grammars, ps.GrammarTree.from_host(nt, ns, dt), V)
good = nt.copy()
rng = np.random.default_rng(0)
def disturb():
    nt[:] = good
    nt[rng.integers(2), rng.integers(1, n)] = rng.choice([10**9, -(10**9), 0, 1])
def work():
    try:
        ps.build_host_bitmask(grammars, ps.GrammarTree.from_host(nt, ns, dt), V)
    except ValueError:
        pass  # links malformed when the build copied them: refused
race(work, disturb, 3000)
""",
    "take_rows_index_rewritten": """
source = np.arange(64 * 512, dtype=np.int32).reshape(64, 512)
index = np.zeros(20000, np.int32)
dest = np.zeros((20000, 512), np.int32)
numbers = np.zeros(20000, np.int32)
def disturb():
    index[::7] = 2**30
    index[::7] = 3
def work():
    try:
        native.take_rows(source, index, dest, numbers, 0)
    except ValueError:
        pass  # an index outside the source when checked: refused
race(work, disturb, 300)
""",
    "repair_spans_rewritten": """
W = 64
rows = np.zeros((8000, W), np.int32)
tokens = np.zeros(8000, np.int64)
spans = np.array([[4 * c, 4 * c, 4, 1] for c in range(2000)], np.int64)
stops = np.zeros(0, np.int64)
def disturb():
    spans[::5, 0] = 10**12
    spans[::5, 0] = 0
repair = getattr(native, "repair_chains", None) or native.native.repair_chains
def work():
    try:
        repair(rows, tokens, spans, 32 * W, stops, 1)
    except ValueError:
        pass  # spans out of bounds when read: refused
race(work, disturb, 300)
""",
    "spans_cleared_by_index": """
class Clearing:  # not an int: reading it as one calls __index__
    def __init__(self, value):
        self.value = value
    def __index__(self):
        spans.clear()
        return self.value
m = xgr.GrammarMatcher(compiled)
ps.build_host_bitmask([m], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)), V)
rows = np.zeros((2, (V + 31) // 32), np.int32)
tokens = np.zeros(2, np.int64)
for _ in range(200):
    spans = [(Clearing(0), 0, 2, 0) for _ in range(50)]
    try:
        if NEW_ABI:
            native.walk_chains(rows, tokens, spans, [m] * 50, V, np.zeros(0, np.int64), 0)
        else:
            native.native.walk_chains(rows, tokens, spans, V, np.zeros(0, np.int64), 0)
    except (ValueError, TypeError):
        pass
print("ok")
""",
    "vllm_id_freed_by_a_key": """
from types import SimpleNamespace
class XgrammarGrammar:
    def __init__(self, matcher):
        self.matcher = matcher
m = xgr.GrammarMatcher(compiled)
ps.build_host_bitmask([m], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)), V)
from portable_spec.native import xgrammar_handle
words = (V + 31) // 32
def name():  # a new string object each time, equal to the others
    return "".join(["req", "-", str(10**40)])
class Evil:  # a key of the id's hash: comparing the id with it drops the id
    armed = False
    def __hash__(self):
        return hash(name())
    def __eq__(self, other):
        if Evil.armed:
            ids.clear()
        return False
for _ in range(200):
    grammar = XgrammarGrammar(m)
    Evil.armed = False
    spec = {Evil(): [1], name(): [5]}
    ids = [name()]  # the only reference to this id object
    Evil.armed = True
    requests = {name(): SimpleNamespace(structured_output_request=SimpleNamespace(_grammar=grammar))}
    known = {id(grammar): (m, xgrammar_handle(m), words, np.zeros(0, np.int64), None)}
    buffer = np.zeros((4, words), np.int32)
    fn = native.vllm_chains if NEW_ABI else native.native.vllm_chains
    names = (("structured_output_request", "_grammar", "matcher"),) if NAMES_ABI else ()
    fn(requests, ids, spec, known, {XgrammarGrammar}, buffer, 0, np.zeros(0, np.int64), *names)
print("ok")
""",
    "llguidance_inputs_rewritten_while_walked": """
from portable_spec import testing
matchers = [testing.llguidance_matcher("json_schema") for _ in range(4)]
tokens = np.array([[0] + grammar_chain(7, seed) for seed in range(4)], dtype=np.int64)
links = np.tile(np.array([1, 2, 3, 4, 5, 6, 7, -1], dtype=np.int64), (4, 1))
siblings = np.full((4, 8), -1, dtype=np.int64)
ps.build_host_bitmask(matchers, ps.GrammarTree.from_host(links, siblings, tokens), V)
grammars = list(matchers)
def step():  # the small build reads these arrays and this list in place
    try:
        ps.build_host_bitmask(grammars, ps.GrammarTree.from_host(links, siblings, tokens), V)
    except (ValueError, TypeError, ps.MatcherError):
        pass
def disturb():  # while llguidance computes a mask without the GIL
    links[:, 3] = 99
    tokens[:, 2] = -5
    grammars[1] = None
    links[:, 3] = 4
    grammars[1] = matchers[1]
race(step, disturb, 80)
print("ok")
""",
    "vllm_guidance_objects_changed_while_read": """
from types import SimpleNamespace
from portable_spec import testing
from portable_spec.integrations.vllm import guidance as vllm_guidance
tokenizer = testing.llguidance_tokenizer()
words = (V + 31) // 32
drafts = [grammar_chain(4, seed) for seed in range(4)]
class GuidanceGrammar:  # its attribute reads empty the step's containers and draft lists
    def __init__(self, matcher):
        self.ll_matcher = matcher
        self.ll_tokenizer = tokenizer
    @property
    def terminated(self):
        for tokens in spec.values():
            tokens.clear()
        ids.clear()
        requests.clear()
        return False
vllm_guidance._tokenizer_facts(tokenizer)
buffer = np.zeros((64, words), np.int32)
def step():
    global spec, ids, requests
    spec = {f"r{i}": list(tokens) for i, tokens in enumerate(drafts)}
    ids = list(spec)
    requests = {
        rid: SimpleNamespace(structured_output_request=SimpleNamespace(
            _grammar=GuidanceGrammar(testing.llguidance_matcher("json_schema"))))
        for rid in ids
    }
    fn = native.vllm_guidance
    fn(requests, ids, spec, {GuidanceGrammar}, vllm_guidance._eos, buffer, 0,
       vllm_guidance._NAMES)
def disturb():  # another thread rewriting the drafts while llguidance holds no GIL
    for tokens in list(spec.values()):
        tokens[:] = [-7] * 9
step()
race(step, disturb, 60)
print("ok")
""",
}


def run_isolated(body: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``body`` after the prelude in a fresh interpreter (the checkout's library)."""
    script = textwrap.dedent(_PRELUDE) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )


@compiled_only
@pytest.mark.parametrize("race", sorted(_RACES))
def test_races_that_crashed_the_helper(race):
    # freed memory overwritten at once: a read after free is seen, not silently survived
    env = {"PYTHONMALLOC": "debug"}
    done = run_isolated(_RACES[race], env)
    died = f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0 else ""
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"{race}: exit {done.returncode} {died}\n{done.stderr[-3000:]}"
    )


# -- a draft past the tokenizer's vocabulary ---------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab():
    """A 1,000-token tokenizer (not a multiple of 32) under 1,024-wide logits."""
    tokens = ["</s>", *[f"t{i}" for i in range(1, 1000)]]
    tokens[1:96] = [chr(c) for c in range(32, 127)]
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=1000, stop_token_ids=[0])
    return SimpleNamespace(
        compiled=xgr.GrammarCompiler(info).compile_builtin_json_grammar(), size=1000, words=32
    )


def _in_a_string(vocab):
    """A matcher state inside a JSON string, where xgrammar allows the bits past its
    vocabulary: the prefix, and the drafts ``a``, 1010 (past the tokenizer), ``b``."""
    prefix = [ord(c) - 31 for c in '{"']
    return Request(vocab.compiled, prefix), [ord("a") - 31, 1010, ord("b") - 31]


@pytest.mark.parametrize(
    "path", ["chain_lists", "linear_chain", "tree", "general", "compact", "python"]
)
def test_a_draft_past_the_tokenizer_vocabulary_is_refused(small_vocab, path):
    """xgrammar sets the bits past its 1,000 tokens inside a JSON string but refuses the
    token: the node is refused (not valid), its row and its subtree all-allowed, on every
    path, as the oracle (which asks a fresh matcher) says."""
    request, drafts = _in_a_string(small_vocab)
    row = fill_row(request.fresh(), small_vocab.words, 1024)
    assert _bits(row)[1010], "the premise: xgrammar allows 1010 in this state"
    logits = 1024
    chain = np.array([[0, *drafts]], np.int64)
    matcher = request.fresh()
    real = native_module.native
    if path == "python":
        native_module.use(None)
    try:
        if path == "chain_lists":
            mask, valid = ps.build_chain_bitmask([matcher], [drafts], logits, return_valid=True)
        elif path in ("linear_chain", "python"):
            tree = ps.GrammarTree.from_linear_chain(chain)
            mask, valid = ps.build_host_bitmask([matcher], tree, logits, return_valid=True)
        elif path == "tree":
            nt, ns = np.array([[1, 2, 3, -1]]), np.array([[-1, -1, -1, -1]])
            tree = ps.GrammarTree.from_host(nt, ns, chain)
            mask, valid = ps.build_host_bitmask([matcher], tree, logits, return_valid=True)
        else:  # the general build (a reasoning rule that never applies), or compact
            tree = ps.GrammarTree.from_linear_chain(chain)
            if path == "general":
                rule = ps.Reasoning(active=[False], end_token_ids=[999])
                mask, valid = ps.build_host_bitmask(
                    [matcher], tree, logits, reasoning=rule, return_valid=True
                )
            else:
                compact = ps.build_host_bitmask([matcher], tree, logits, layout="compact")
                mask, valid = compact.to_dense(), None
    finally:
        if path == "python":
            native_module.use(real)
    n = len(drafts) + 1
    nt, ns = [*range(1, n), -1], [-1] * n
    want = expected_rows(request.fresh, nt, ns, [0, *drafts], logits, small_vocab.words)
    accepted = expected_accepted(request.fresh, nt, ns, [0, *drafts], logits, small_vocab.words)
    assert accepted == [True, True, False, False]
    assert (want[2] == -1).all() and (want[3] == -1).all()
    np.testing.assert_array_equal(mask, want)
    if valid is not None:
        assert np.asarray(valid).reshape(-1).tolist() == accepted


@compiled_only
def test_the_vllm_plugin_repeats_the_row_before_a_draft_past_the_vocabulary(small_vocab):
    """vLLM's rule for a refused draft (repeat the row before it) holds for one past the
    tokenizer's vocabulary too, on the compiled step."""
    from test_vllm_fast import XgrammarGrammar, _held, _manager

    request, drafts = _in_a_string(small_vocab)
    grammar = XgrammarGrammar(request.fresh())
    buffer = np.full((8, small_vocab.words), 7, dtype=np.int32)
    written = vllm_xgrammar.fast_rows(
        _manager(small_vocab.words), {"0": _held(grammar)}, ["0"], {"0": drafts}, 0, buffer
    )
    want = expected_rows(request.fresh, [1, 2, 3, -1], [-1] * 4, [0, *drafts], 1024, 32)
    assert written is not None
    out = written.rows
    np.testing.assert_array_equal(out[:2], want[:2])
    np.testing.assert_array_equal(out[2], want[1])  # the row before the refused draft
    np.testing.assert_array_equal(out[3], want[1])
