"""``build_grammar_vocab_mask(..., wait=False)``: returns at once, builds on the library's
threads, gives the blocking call's result (or error) from ``result()``, holds its matchers
until then, and uploads as the caller would have."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _oracle import (
    FailingMatcher,
    GatedMatcher,
    ProtocolMatcher,
    Request,
    expected_mask,
    matcher_state,
)

import portable_spec as ps


def _case(smollm2, batch=3):
    compiled = smollm2.grammars["builtin_json"]
    dt = np.tile([0, smollm2.tokens.index("{"), smollm2.tokens.index('"')], (batch, 1))
    tree = ps.GrammarTree.from_linear_chain(dt)
    requests = [Request(compiled) for _ in range(batch)]
    want = expected_mask(requests, *tree.resolve(), smollm2.size, smollm2.words)
    return requests, tree, want


def test_returns_at_once_and_holds_its_matchers(smollm2):
    requests, tree, want = _case(smollm2)
    gate = threading.Event()
    gated = GatedMatcher(requests[0].fresh(), gate)
    matchers = [gated, requests[1].fresh(), requests[2].fresh()]
    handle = ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, wait=False)
    assert isinstance(handle, ps.PendingMask)
    assert gated.entered.wait(600)  # the build runs on another thread...
    assert not handle.done()  # ... and waits for the gate: the call did not
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.01)
    # a second build over a held matcher is refused, whatever the entry point
    for build in (
        lambda: ps.build_grammar_vocab_mask([matchers[1]], tree_of(1, smollm2), smollm2.size),
        lambda: ps.build_host_bitmask([None, matchers[2]], tree_of(2, smollm2), smollm2.size),
        lambda: ps.build_grammar_vocab_mask(
            [matchers[1]], tree_of(1, smollm2), smollm2.size, wait=False
        ),
    ):
        with pytest.raises(ValueError, match=r"another build that has not finished"):
            build()
    other = [requests[0].fresh()]  # other matchers build as usual meanwhile
    assert ps.build_host_bitmask(other, tree_of(1, smollm2), smollm2.size) is not None
    gate.set()
    mask = handle.result(timeout=600)
    assert handle.done()
    np.testing.assert_array_equal(mask, want)
    assert gated.depth == 0
    again = ps.build_grammar_vocab_mask(matchers, tree, smollm2.size)  # released
    np.testing.assert_array_equal(again, want)


def tree_of(batch, smollm2):
    dt = np.tile([0, smollm2.tokens.index("[")], (batch, 1))
    return ps.GrammarTree.from_linear_chain(dt)


@pytest.mark.parametrize("layout", ["dense", "compact"])
def test_same_result_as_blocking(smollm2, layout):
    requests, tree, want = _case(smollm2, batch=5)
    handle = ps.build_grammar_vocab_mask(
        [r.fresh() for r in requests], tree, smollm2.size, layout=layout, wait=False
    )
    mask = handle.result(timeout=600)
    got = mask.to_dense() if layout == "compact" else mask
    np.testing.assert_array_equal(got, want)
    none = ps.build_grammar_vocab_mask([None] * 5, tree, smollm2.size, wait=False)
    assert none.result(timeout=600) is None


def test_errors_surface_from_result_with_matchers_restored(smollm2):
    requests, tree, _ = _case(smollm2)
    probe = [0, 1, smollm2.tokens.index("{"), 100]
    # a malformed tree is found in the background (validation needs the tree's data)
    cycle = ps.GrammarTree.from_host(
        np.array([[1, 2, 1]]), np.array([[-1, -1, -1]]), np.array([[0, 5, 6]])
    )
    untouched = ProtocolMatcher(requests[0].fresh())
    handle = ps.build_grammar_vocab_mask([untouched], cycle, smollm2.size, wait=False)
    with pytest.raises(ValueError, match="cycle|two parents|more than one"):
        handle.result(timeout=600)
    assert untouched.calls == []
    # a matcher raising mid-walk: MatcherError names it, every matcher is back in its state
    good = requests[1].fresh()
    failing = FailingMatcher(requests[2].fresh(), fail_in="fill", at_call=2)
    before = matcher_state(good, probe, smollm2.words)
    handle = ps.build_grammar_vocab_mask(
        [good, None, failing], tree, smollm2.size, layout="compact", wait=False
    )
    with pytest.raises(ps.MatcherError, match=r"matchers\[2\]") as info:
        handle.result(timeout=600)
    assert info.value.request_index == 2
    with pytest.raises(ps.MatcherError):  # the same error again
        handle.result()
    assert failing.depth == 0 and matcher_state(good, probe, smollm2.words) == before
    # released: the same matchers build again
    assert ps.build_host_bitmask([good], tree_of(1, smollm2), smollm2.size) is not None


def test_argument_errors_are_raised_by_the_call(smollm2):
    requests, tree, _ = _case(smollm2, batch=1)
    matcher = ProtocolMatcher(requests[0].fresh())
    with pytest.raises(TypeError, match="wait must be a bool"):
        ps.build_grammar_vocab_mask([matcher], tree, smollm2.size, wait=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        ps.build_grammar_vocab_mask([matcher], tree, smollm2.size, layout="x", wait=False)
    with pytest.raises(ValueError, match="row_capacity"):
        ps.build_grammar_vocab_mask([matcher], tree, smollm2.size, row_capacity=1, wait=False)
    with pytest.raises(TypeError, match="matchers must be a sequence"):
        ps.build_grammar_vocab_mask(iter([matcher]), tree, smollm2.size, wait=False)
    assert matcher.calls == []
    # nothing was held: a blocking build over the matcher works
    assert ps.build_host_bitmask([matcher], tree, smollm2.size) is not None


def test_many_pending_builds_and_dropped_handles(smollm2):
    """Builds queue on the background thread; each result is its own; a dropped handle's
    build still finishes and lets its matchers go."""
    cases = [_case(smollm2, batch=b) for b in (1, 2, 3, 4)]
    handles = []
    for requests, tree, want in cases:
        handles.append(
            (
                ps.build_grammar_vocab_mask(
                    [r.fresh() for r in requests], tree, smollm2.size, wait=False
                ),
                want,
            )
        )
    requests, tree, _ = cases[0]
    dropped = [requests[0].fresh()]
    ps.build_grammar_vocab_mask(dropped, tree, smollm2.size, wait=False)  # handle dropped
    for handle, want in handles:
        np.testing.assert_array_equal(handle.result(timeout=600), want)
    deadline = time.monotonic() + 600  # a hang guard only
    while True:
        try:
            ps.build_host_bitmask(dropped, tree, smollm2.size)
            break
        except ValueError:
            assert time.monotonic() < deadline, "a dropped build never released its matcher"
            time.sleep(0.01)


def test_jax_default_device_is_captured(smollm2):
    """A mask whose placement is JAX's default device goes where the caller's default is."""
    jax = pytest.importorskip("jax")
    cpus = jax.devices("cpu")
    if len(cpus) < 2:
        pytest.skip("needs two JAX CPU devices")
    backend = ps.get_backend("jax")
    with jax.default_device(cpus[1]):
        context = backend.capture_context(None)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(_put_in(context)))
    worker.start()
    worker.join()
    assert seen == [{cpus[1]}]
    with backend.capture_context(cpus[0])():  # an explicit placement needs nothing
        pass


def _put_in(context):
    import jax

    with context():
        return jax.device_put(np.zeros(2)).devices()


FORK_SCRIPT = """
import os, sys, threading
import numpy as np, xgrammar as xgr
sys.path.insert(0, TESTS_DIR)
from _oracle import ProtocolMatcher
import portable_spec as ps
from portable_spec.testing import load_vocab, tokenizer_info

vocab = load_vocab()
grammar = xgr.GrammarCompiler(tokenizer_info(vocab)).compile_builtin_json_grammar()
gate, entered = threading.Event(), threading.Event()


class Gated(ProtocolMatcher):
    def fill_next_token_bitmask(self, bitmask, index):
        entered.set()
        gate.wait(600)
        return super().fill_next_token_bitmask(bitmask, index)


matcher = Gated(xgr.GrammarMatcher(grammar))
tree = ps.GrammarTree.from_linear_chain(np.array([[0, vocab.tokens.index("{")]]))
handle = ps.build_grammar_vocab_mask([matcher], tree, vocab.size, wait=False)
assert entered.wait(600)
try:
    ps.build_host_bitmask([matcher], tree, vocab.size)
    raise SystemExit("the parent did not refuse a held matcher")
except ValueError:
    pass
pid = os.fork()
if pid == 0:
    gate.set()  # the child's own copy of the gate
    code = 3
    try:
        mask = ps.build_host_bitmask([matcher], tree, vocab.size)
        later = ps.build_grammar_vocab_mask([matcher], tree, vocab.size, wait=False)
        code = 0 if np.array_equal(later.result(timeout=600), mask) else 2
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
gate.set()
handle.result(timeout=600)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_holds_no_matcher(tmp_path):
    """The background thread does not survive fork(): in the child, the matchers a pending
    build of the parent holds are free, and the child's own builds (blocking and not) work.
    In a fresh interpreter without JAX (forking a process that runs JAX is unsafe)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT.replace("TESTS_DIR", repr(os.path.dirname(__file__))))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
