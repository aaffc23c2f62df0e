"""Thread pool configuration and concurrency; pooled host buffers."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import Request, expected_mask

import portable_spec as ps
import portable_spec.builder.routes as routes
from portable_spec.hostbuffers import HostBufferPool
from portable_spec.pool import WorkItemError, pool_stats, run_indexed


def test_num_threads_setting():
    ps.set_num_threads(3)
    assert ps.get_num_threads() == 3
    ps.set_num_threads(None)
    assert ps.get_num_threads() >= 1
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads must be a positive int or None"):
            ps.set_num_threads(bad)


def test_env_threads(monkeypatch):
    monkeypatch.setenv("PORTABLE_SPEC_NUM_THREADS", "2")
    ps.set_num_threads(None)
    assert ps.get_num_threads() == 2
    monkeypatch.setenv("PORTABLE_SPEC_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="PORTABLE_SPEC_NUM_THREADS must be a positive integer"):
        ps.set_num_threads(None)
    monkeypatch.delenv("PORTABLE_SPEC_NUM_THREADS")
    ps.set_num_threads(None)


def test_run_indexed_reports_lowest_failing_index():
    ps.set_num_threads(4)
    seen = []
    lock = threading.Lock()

    def fn(i):
        if i in (5, 9):
            raise KeyError(i)
        with lock:
            seen.append(i)

    with pytest.raises(WorkItemError) as info:
        run_indexed(fn, 40, parallel=True)
    assert info.value.index == 5 and isinstance(info.value.error, KeyError)
    run_indexed(lambda i: None, 10, parallel=True)  # the pool still works
    ps.set_num_threads(None)


def test_concurrent_builds_share_the_pool(smollm2, monkeypatch):
    """Two threads building different batches at once through the shared pool."""
    monkeypatch.setattr(routes, "POOL_WORK", 0)
    ps.set_num_threads(3)
    compiled = smollm2.grammars["builtin_json"]
    rng = np.random.default_rng(0)
    jobs = []
    for _ in range(2):
        dt = rng.integers(0, smollm2.size, (6, 8))
        dt[:, 1] = smollm2.tokens.index("{")
        dt[:, 2] = smollm2.tokens.index('"')
        requests = [Request(compiled) for _ in range(6)]
        tree = ps.GrammarTree.from_linear_chain(dt)
        jobs.append(
            (requests, tree, expected_mask(requests, *tree.resolve(), smollm2.size, smollm2.words))
        )
    errors = []

    def worker(k):
        requests, tree, want = jobs[k]
        matchers = [r.fresh() for r in requests]
        try:
            for _ in range(20):
                got = ps.build_host_bitmask(matchers, tree, smollm2.size)
                np.testing.assert_array_equal(got, want)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert pool_stats()["workers"] <= 2
    ps.set_num_threads(None)


def test_pool_does_not_grow(smollm2, monkeypatch):
    monkeypatch.setattr(routes, "POOL_WORK", 0)
    monkeypatch.setattr(routes, "ONE_THREAD_WORK", 0)  # chains in parts too
    ps.set_num_threads(2)
    m = [xgr.GrammarMatcher(smollm2.grammars["regex"]) for _ in range(4)]
    tree = ps.GrammarTree.from_linear_chain(np.zeros((4, 3), dtype=np.int64))
    for _ in range(50):
        ps.build_host_bitmask(m, tree, smollm2.size)
    assert pool_stats() == {"threads": 2, "workers": 1}
    ps.set_num_threads(None)


def test_lent_buffer_not_reused_while_referenced():
    pool = HostBufferPool()
    a = pool.acquire((4, 8))
    first = pool.lend(a)
    view = first[1:3]  # a view keeps the block lent even after `first` dies
    del first
    gc.collect()
    b = pool.acquire((4, 8))
    assert not np.shares_memory(b.array, view)
    pool.release(b)
    assert pool.stats()["lent"] == 1  # `view` still holds a's block
    del view
    gc.collect()
    assert pool.stats() | {"allocated_bytes": 0} == {
        "free": 2,
        "lent": 0,
        "in_flight": 0,
        "allocated_bytes": 0,
        "allocations": 2,
    }
    again = [pool.acquire((4, 8)) for _ in range(2)]
    assert any(x.block is a.block for x in again) and pool.stats()["allocations"] == 2


def test_in_flight_buffer_waits_for_its_event():
    pool = HostBufferPool(max_in_flight=2)
    done = {"flag": False}
    a = pool.acquire((2, 2))
    pool.after(a, lambda: done["flag"], lambda: done.__setitem__("flag", True))
    b = pool.acquire((2, 2))
    assert b.block is not a.block  # a is still in flight
    pool.after(b, lambda: False, lambda: None)
    done["flag"] = True
    c = pool.acquire((2, 2))
    assert c.block is a.block  # its event fired
    stats = pool.stats()
    assert stats["in_flight"] == 1 and stats["lent"] == 1


def test_too_many_in_flight_waits_for_oldest():
    pool = HostBufferPool(max_in_flight=1)
    waited = []
    a = pool.acquire((2, 2))
    pool.after(a, lambda: False, lambda: waited.append("a"))
    b = pool.acquire((2, 2))
    assert waited == ["a"] and b.block is a.block


def test_numpy_mask_from_pool_survives_later_builds(smollm2):
    """build_grammar_vocab_mask (numpy backend) lends pooled memory: a later build never
    overwrites a mask the caller still holds."""
    compiled = smollm2.grammars["builtin_json"]
    brace = smollm2.tokens.index("{")
    first = ps.build_grammar_vocab_mask(
        [xgr.GrammarMatcher(compiled)], ps.GrammarTree.from_linear_chain([[0, brace]]), smollm2.size
    )
    kept = first.copy()
    for _ in range(5):
        ps.build_grammar_vocab_mask(
            [xgr.GrammarMatcher(compiled)], ps.GrammarTree.from_linear_chain([[0, 5]]), smollm2.size
        )
    np.testing.assert_array_equal(first, kept)


def test_row_capacity_padding(smollm2):
    compiled = smollm2.grammars["regex"]
    tree = ps.GrammarTree.from_linear_chain(np.zeros((2, 3), dtype=np.int64))
    mask = ps.build_grammar_vocab_mask(
        [xgr.GrammarMatcher(compiled), None], tree, smollm2.size, row_capacity=16
    )
    assert mask.shape == (16, smollm2.words)
    assert (mask[6:] == -1).all() and (mask[3:6] == -1).all() and (mask[0] != -1).any()
    with pytest.raises(ValueError, match="row_capacity = 5 is smaller than the mask's 6 rows"):
        ps.build_grammar_vocab_mask([None, None], tree, smollm2.size, row_capacity=5)
    with pytest.raises(TypeError, match="row_capacity must be an int"):
        ps.build_grammar_vocab_mask([None, None], tree, smollm2.size, row_capacity=7.0)


class _CollectingLock:
    """A lock that runs a full garbage collection right after it is taken: the worst moment
    for a finaliser to need the same lock."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        self.inner.acquire()
        gc.collect()
        return self

    def __exit__(self, *exc):
        self.inner.release()


def test_finaliser_returning_a_block_under_the_pool_lock_does_not_deadlock():
    """A lent array held only by a reference cycle dies in a collection that runs while this
    thread holds the pool's (non-reentrant) lock. Returning its block must not take that lock
    again: the acquire below would block forever."""
    pool = HostBufferPool()
    gc.disable()
    try:
        lent = pool.lend(pool.acquire((4, 4)))

        class Holder:
            pass

        holder = Holder()
        holder.cycle = holder
        holder.lent = lent
        del holder, lent  # now garbage that only the cycle collector can free
        pool._lock = _CollectingLock(pool._lock)
        done = threading.Event()

        def acquire_again():
            buffer = pool.acquire((4, 4))
            pool.release(buffer)
            done.set()

        worker = threading.Thread(target=acquire_again, daemon=True)
        worker.start()
        worker.join(timeout=600)
        assert done.is_set(), "acquire deadlocked: a finaliser took the pool lock it ran under"
        stats = pool.stats()
        assert stats["lent"] == 0 and stats["free"] >= 1 and stats["allocations"] == 1
    finally:
        gc.enable()
