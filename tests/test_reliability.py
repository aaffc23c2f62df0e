"""Slow-grammar warnings and counters, clean shutdown, and a bounded soak run."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import ProtocolMatcher

import portable_spec as ps
from portable_spec.stats import (
    get_slow_grammar_threshold,
    reset_grammar_stats,
    set_slow_grammar_threshold,
)


class SlowMatcher(ProtocolMatcher):
    """A protocol matcher whose fills take ``delay`` seconds."""

    def __init__(self, inner, delay):
        super().__init__(inner)
        self.delay = delay

    def fill_next_token_bitmask(self, bitmask, index):
        time.sleep(self.delay)
        return super().fill_next_token_bitmask(bitmask, index)


@pytest.fixture
def fresh_stats():
    reset_grammar_stats()
    old = get_slow_grammar_threshold()
    yield
    set_slow_grammar_threshold(old)
    reset_grammar_stats()


def test_slow_request_is_logged_and_counted(smollm2, fresh_stats, caplog):
    compiled = smollm2.grammars["regex"]
    set_slow_grammar_threshold(0.05)
    fast = xgr.GrammarMatcher(compiled)
    slow = SlowMatcher(xgr.GrammarMatcher(compiled), 0.08)
    tree = ps.GrammarTree.from_linear_chain(np.zeros((3, 2), dtype=np.int64))
    with caplog.at_level(logging.WARNING, logger="portable_spec"):
        ps.build_host_bitmask([fast, None, slow], tree, smollm2.size)
    messages = [r.getMessage() for r in caplog.records if r.name == "portable_spec"]
    assert len(messages) == 1
    assert messages[0].startswith("grammar of request 2 took ")
    assert "(threshold 50.0 ms)" in messages[0]
    stats = ps.grammar_stats()
    assert stats["builds"] == 1 and stats["requests"] == 2 and stats["rows"] == 6
    assert stats["slow_requests"] == 1 and stats["last_slow_request"] == 2
    assert stats["last_slow_seconds"] >= 0.08 and stats["slowest_seconds"] >= 0.08
    set_slow_grammar_threshold(None)
    with caplog.at_level(logging.WARNING, logger="portable_spec"):
        ps.build_host_bitmask([fast, None, slow], tree, smollm2.size)
    assert len([r for r in caplog.records if r.name == "portable_spec"]) == 1  # none added
    assert ps.grammar_stats()["builds"] == 2


def test_threshold_validation(fresh_stats, monkeypatch):
    for bad in (0, -1, "1", True):
        with pytest.raises(ValueError, match="threshold must be a positive number"):
            set_slow_grammar_threshold(bad)
    from portable_spec import stats

    monkeypatch.setenv("PORTABLE_SPEC_SLOW_GRAMMAR_MS", "250")
    assert stats._default_threshold() == 0.25
    monkeypatch.setenv("PORTABLE_SPEC_SLOW_GRAMMAR_MS", "0")
    assert stats._default_threshold() is None
    monkeypatch.setenv("PORTABLE_SPEC_SLOW_GRAMMAR_MS", "soon")
    with pytest.raises(ValueError, match="PORTABLE_SPEC_SLOW_GRAMMAR_MS"):
        stats._default_threshold()


def test_interpreter_exits_promptly_with_a_busy_pool():
    """Worker threads never keep the process alive, mid-build or idle."""
    code = textwrap.dedent(
        """
        import threading, numpy as np, portable_spec as ps
        import portable_spec.builder.routes as b
        b.POOL_WORK = 0
        ps.set_num_threads(4)

        class M:
            def accept_token(self, t): return True
            def rollback(self, n): pass
            def fill_next_token_bitmask(self, bitmask, index): bitmask[index] = -1
            def is_terminated(self): return False

        tree = ps.GrammarTree.from_linear_chain(np.zeros((8, 4), dtype=np.int64))
        for _ in range(20):
            ps.build_host_bitmask([M() for _ in range(8)], tree, 64)
        threading.Thread(
            target=lambda: [ps.build_host_bitmask([M() for _ in range(8)], tree, 64)
                            for _ in range(10**6)],
            daemon=True,
        ).start()
        print("done")
        """
    )
    # a process kept alive by the pool would run for ever: the timeout is a hang guard only
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"


@pytest.mark.parametrize("backend", ["numpy", "cuda", "jax"])
def test_bounded_soak(backend):
    """A CI-sized soak (the full one is `scripts/soak.sh --steps 20000`)."""
    from tools.soak import run_soak

    result = run_soak(1200, backend, max_batch=8, nodes=12, check_every=100, sample_every=100)
    growth = result["growth"]
    assert result["checks"] >= 10
    assert growth["threads"] == 0 and growth["pool_workers"] == 0
    assert growth["rss_mb"] < 16
    assert growth["host_buffer_mb"] <= 1


def test_stats_split_a_call_into_tree_wait_walk_and_upload(smollm2, fresh_stats, monkeypatch):
    """The blocking call's time: waiting for the tree (here a copy that takes 50 ms), the
    walks, and the upload, each accounted; together they fit in the call's own time."""
    original = ps.GrammarTree.resolve

    def slow_resolve(self):
        time.sleep(0.05)
        return original(self)

    monkeypatch.setattr(ps.GrammarTree, "resolve", slow_resolve)
    compiled = smollm2.grammars["builtin_json"]
    brace = smollm2.tokens.index("{")
    tree = ps.GrammarTree.from_linear_chain(np.array([[0, brace, 5], [0, 7, 9]]))
    start = time.perf_counter()
    ps.build_grammar_vocab_mask([xgr.GrammarMatcher(compiled), None], tree, smollm2.size)
    elapsed = time.perf_counter() - start
    stats = ps.grammar_stats()
    assert stats["tree_wait_seconds"] >= 0.05
    assert stats["walk_seconds"] > 0 and stats["upload_seconds"] > 0
    parts = stats["tree_wait_seconds"] + stats["walk_seconds"] + stats["upload_seconds"]
    assert parts <= stats["call_seconds"] <= elapsed
    # request 0: "{" accepted (checked), 5 checked and refused; request 1 unconstrained
    assert (stats["checked_nodes"], stats["rejected_nodes"]) == (2, 1)
