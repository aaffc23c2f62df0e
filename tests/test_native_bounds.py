"""The compiled helper against callers whose sizes and objects turn hostile mid-call.

Each case once crashed the helper (a write past a buffer, a signed overflow of a row count, a
read of a freed object); each runs in a fresh interpreter, so that a crash is a failed test
rather than a dead test run, with Python's debug allocator (freed memory overwritten at once).
The sanitizer build (``scripts/native-check.sh``) runs this file too, where each is reported
at the faulty access itself.

* ``llguidance_walks`` sizes its scratch from the spans before the first entry; an entry's
  matcher is Python code, and may rewrite a later span before it is read.
* ``vllm_guidance``, ``pack_chains`` and ``vllm_chains`` add a stride per request: a huge
  stride must not wrap the total back under the rows the caller has.
* ``vllm_chains`` reads its stop tokens out of the caller's table; dropping the last
  reference to a grammar wrapper (a weak-reference callback removing its entry) must not free
  them under the read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from portable_spec import native as native_module

compiled_only = pytest.mark.skipif(
    native_module.native is None, reason="portable_spec._native is not built here"
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import gc, sys, weakref
import numpy as np
import portable_spec as ps
from portable_spec import native
helper = native.native
# the attribute names the vLLM plugin hands the step readers (vllm/internals.py)
XGRAMMAR_NAMES = ("structured_output_request", "_grammar", "matcher")
GUIDANCE_NAMES = ("structured_output_request", "_grammar", "terminated", "ll_tokenizer", "ll_matcher")
"""

_CASES = {
    # entry 0's matcher grows entry 1's span to 300 nodes; the scratch holds 1 node
    "llguidance_walks_span_grown_by_a_matcher": """
class Matcher:  # llguidance's methods, in Python
    def __init__(self, grow):
        self.grow = grow
    def stop_reason(self):
        if self.grow:
            spans[1, 2] = 300
        return "NotStopped"
    def is_stopped(self):
        return False
    def unsafe_compute_mask_ptr(self, where, nbytes):
        pass
    def try_consume_tokens(self, tokens):
        return 0
    def rollback(self, count):
        return True
rows = np.zeros((400, 4), np.int32)
tokens = np.zeros(400, np.int64)
spans = np.array([[0, 0, 1], [1, 1, 1]], np.int64)
counts = np.zeros((2, 2), np.int64)
failed, error = helper.llguidance_walks(
    rows, None, None, tokens, spans, [Matcher(True), Matcher(False)],
    np.array([128, 128], np.int64), True, counts, None, None)
# the call reads the spans as they were when it was made: entry 1 is one node
assert failed == -1 and error is None, (failed, error)
assert counts.tolist() == [[0, 0], [0, 0]], counts
print("ok")
""",
    # four requests of stride 2**62: 4 * 2**62 wraps to 0 rows
    "vllm_guidance_stride_wraps": """
from types import SimpleNamespace
class GuidanceGrammar:
    terminated = True  # every row all-allowed: no llguidance needed
    ll_tokenizer = object()
    ll_matcher = None
ends = {id(GuidanceGrammar.ll_tokenizer): (GuidanceGrammar.ll_tokenizer, 0, 1000)}
ids = [f"r{i}" for i in range(4)]
grammar = GuidanceGrammar()
requests = {
    i: SimpleNamespace(structured_output_request=SimpleNamespace(_grammar=grammar)) for i in ids
}
buffer = np.zeros((8, 32), np.int32)
done = helper.vllm_guidance(
    requests, ids, {}, {GuidanceGrammar}, ends, buffer, 2**62, GUIDANCE_NAMES)
assert done is None, done
print("ok")
""",
    # three requests of stride (2**64 + 2) // 3 wrap to exactly the two rows given
    "pack_chains_stride_wraps": """
stride = (2**64 + 2) // 3
rows = np.zeros((2, 32), np.int32)
done = helper.pack_chains(
    [[], [], []], [None, None, None], stride, 1024, np.zeros(0, np.int64), None, rows, None)
assert done is None, done
print("ok")
""",
    "vllm_chains_stride_wraps": """
from types import SimpleNamespace
import xgrammar as xgr
from portable_spec.testing import compile_sample, load_vocab, tokenizer_info
info = tokenizer_info(load_vocab())
words = (info.vocab_size + 31) // 32
compiled = compile_sample(xgr.GrammarCompiler(info), "json_schema")
class XgrammarGrammar:
    def __init__(self, matcher):
        self.matcher = matcher
m = xgr.GrammarMatcher(compiled)
ps.build_host_bitmask([m], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)),
                      info.vocab_size)
if native.xgrammar_handle(m) == 0:
    print("ok")  # the helper does not call xgrammar here: nothing to check
    sys.exit(0)
stops = np.zeros(0, np.int64)
ids = ["a", "b", "c"]
grammars = {i: XgrammarGrammar(xgr.GrammarMatcher(compiled)) for i in ids}  # one matcher each
for g in grammars.values():
    ps.build_host_bitmask([g.matcher], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)),
                          info.vocab_size)
known = {
    id(g): (g.matcher, native.xgrammar_handle(g.matcher), words, stops, None)
    for g in grammars.values()
}
requests = {
    i: SimpleNamespace(structured_output_request=SimpleNamespace(_grammar=grammars[i]))
    for i in ids
}
buffer = np.zeros((2, words), np.int32)
stride = (2**64 + 2) // 3
done = helper.vllm_chains(
    requests, ids, {}, known, {XgrammarGrammar}, buffer, stride, np.zeros(0, np.int64),
    XGRAMMAR_NAMES)
assert done is None, done
print("ok")
""",
    # the wrapper's last reference goes with the attribute read; its weak-reference callback
    # drops the table's entry, the only owner of the stop tokens
    "vllm_chains_stop_tokens_freed": """
from types import SimpleNamespace
import xgrammar as xgr
from portable_spec.testing import compile_sample, load_vocab, tokenizer_info
info = tokenizer_info(load_vocab())
V = info.vocab_size
words = (V + 31) // 32
compiled = compile_sample(xgr.GrammarCompiler(info), "json_schema")
class XgrammarGrammar:
    def __init__(self, matcher):
        self.matcher = matcher
class Held:  # vLLM's structured_output_request; reading _grammar hands over its only reference
    def __init__(self, grammar):
        self.slot = [grammar]
    @property
    def _grammar(self):
        return self.slot.pop()
m = xgr.GrammarMatcher(compiled)
ps.build_host_bitmask([m], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)), V)
if native.xgrammar_handle(m) == 0:
    print("ok")
    sys.exit(0)
known = {}
walked = 0
for _ in range(50):
    grammar = XgrammarGrammar(m)
    key = id(grammar)
    ref = weakref.ref(grammar, lambda _, key=key: known.pop(key, None))
    stops = np.array([0, 2, 2**40 + 7], np.int64)  # owned by the entry alone
    known[key] = (m, native.xgrammar_handle(m), words, stops, ref)
    del stops
    requests = {"a": SimpleNamespace(structured_output_request=Held(grammar))}
    del grammar
    buffer = np.zeros((4, words), np.int32)
    done = helper.vllm_chains(
        requests, ["a"], {"a": [5]}, known, {XgrammarGrammar}, buffer, 0, np.zeros(0, np.int64),
        XGRAMMAR_NAMES)
    gc.collect()
    assert key not in known
    if done is not None:  # walked with the stop tokens it read: a reference of its own
        rows, (checked, rejected, failed, message), drafts = done
        assert failed == -1, message
        walked += 1
assert walked == 50, walked  # each call walked, its stop tokens held by a reference of its own
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
@pytest.mark.parametrize("case", sorted(_CASES))
def test_hostile_callers_do_not_crash_the_helper(case):
    env = {} if os.environ.get("PYTHONMALLOC") else {"PYTHONMALLOC": "debug"}
    done = run_isolated(_CASES[case], env)
    died = f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0 else ""
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"{case}: exit {done.returncode} {died}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
