"""Edges an adversarial review found: byte orders, pending builds seen by draft sessions,
exceptions between two protocol calls, request indices under reasoning, finalisers inside a
pool's lock, the background thread's last result, guide widths, exotic torch tensors, logits
wider than the mask, and xgrammar's warnings about padding tokens. Each test checks real
behaviour against an independent replay on fresh matchers (tests/_oracle.py) on SmolLM2's
vocabulary."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import (
    FailingMatcher,
    GatedMatcher,
    ProtocolMatcher,
    Request,
    expected_mask,
    fill_row,
    matcher_state,
)
from _short_path import spy_short_paths

import portable_spec as ps
import portable_spec.drafting.session as drafting_session
from portable_spec.drafting import forced_tokens
from portable_spec.hostbuffers import HostBufferPool
from portable_spec.pending import check_not_pending
from portable_spec.registry import get_backend
from portable_spec.testing import compile_sample

# A JSON-schema path of SmolLM2 tokens below 127 ('{', '"', 'n', 'a'): every integer dtype
# holds them.
OPEN, QUOTE, LETTER_N, LETTER_A = 107, 18, 94, 81
# root -> '{' -> '"' -> 'n'; 'a' is a sibling of '{' (refused at the root)
TREE_NT = [1, 2, 4, -1, -1]
TREE_NS = [-1, 3, -1, -1, -1]
TREE_DT = [0, OPEN, QUOTE, LETTER_A, LETTER_N]
PROBE = [0, 1, 18, 94, 100, 107, 1000]

INTEGER_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


def _dtypes() -> list[np.dtype]:
    out = []
    for name in INTEGER_DTYPES:
        for order in "<>":
            out.append(np.dtype(name).newbyteorder(order))
    return out


def _typed(values: list[int] | list[list[int]], dtype: np.dtype) -> np.ndarray:
    """``values`` stored in ``dtype`` as a C cast would (-1 wraps in unsigned types)."""
    return np.array(values, dtype=np.int64).astype(dtype)


def _request(smollm2) -> Request:
    return Request(smollm2.grammars["json_schema"])


def _want(smollm2, nt, ns, dt) -> np.ndarray:
    arrays = (np.array([nt]), np.array([ns]), np.array([dt]))
    return expected_mask([_request(smollm2)], *arrays, smollm2.size, smollm2.words)


# -- 1. byte orders ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_tree_arrays_of_every_integer_dtype_and_byte_order(smollm2, dtype):
    """Values are converted, never reinterpreted: the draft tokens and links of any integer
    dtype in either byte order give the oracle's mask."""
    want = _want(smollm2, TREE_NT, TREE_NS, TREE_DT)
    links = (np.array([TREE_NT]), np.array([TREE_NS]))
    tree = ps.GrammarTree.from_host(*links, _typed([TREE_DT], dtype))
    assert tree.resolve()[2].tolist() == [TREE_DT]
    matcher = _request(smollm2).fresh()
    np.testing.assert_array_equal(ps.build_host_bitmask([matcher], tree, smollm2.size), want)
    staged = ps.GrammarTree.from_device(*links, _typed([TREE_DT], dtype))
    np.testing.assert_array_equal(ps.build_host_bitmask([matcher], staged, smollm2.size), want)
    chain = ps.GrammarTree.from_linear_chain(_typed([[0, OPEN, QUOTE]], dtype))
    assert chain.resolve()[2].tolist() == [[0, OPEN, QUOTE]]

    nt, ns = _typed([TREE_NT], dtype), _typed([TREE_NS], dtype)
    if dtype.kind == "u" and dtype.itemsize < 8:
        # -1 does not exist in these types: the stored value is what the error names
        biggest = np.iinfo(dtype).max
        with pytest.raises(ValueError, match=rf"= {biggest} is outside"):
            ps.build_host_bitmask([matcher], ps.GrammarTree.from_host(nt, ns, [TREE_DT]), 49152)
        return
    for tree in (
        ps.GrammarTree.from_host(nt, ns, _typed([TREE_DT], dtype)),
        ps.GrammarTree.from_device(nt, ns, _typed([TREE_DT], dtype)),
    ):
        assert [a.tolist() for a in tree.resolve()] == [[TREE_NT], [TREE_NS], [TREE_DT]]
        np.testing.assert_array_equal(ps.build_host_bitmask([matcher], tree, smollm2.size), want)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_chains_of_a_seen_matcher_in_every_dtype_layout_and_byte_order(smollm2, dtype, monkeypatch):
    """A matcher the library has seen takes the compiled call over the caller's own arrays
    when they are aligned, native-order, C-contiguous int64, read-only ones too (the call
    copies what it reads; spied); tokens of any other integer dtype or byte order and a
    strided view go another way and give the same rows as the oracle; an ``out`` the call
    cannot write is refused by name."""
    chain = [0, OPEN, QUOTE, LETTER_N]
    want = _want(smollm2, [1, 2, 3, -1], [-1, -1, -1, -1], chain)
    matcher = _request(smollm2).fresh()
    seen = ps.GrammarTree.from_linear_chain(np.array([chain]))
    ps.build_host_bitmask([matcher], seen, smollm2.size)  # the library learns the matcher
    before = matcher_state(matcher, PROBE, smollm2.words)
    taken = spy_short_paths(monkeypatch)
    tokens = _typed([chain], dtype)
    strided = _typed([[t, 0] for t in chain], dtype)[:, 0].reshape(1, -1)
    readonly = tokens.copy()
    readonly.flags.writeable = False
    for name, array in (("tokens", tokens), ("strided", strided), ("read-only", readonly)):
        plain = name != "strided" and dtype == np.dtype(np.int64)
        for tree in (
            ps.GrammarTree.from_linear_chain(array),
            ps.GrammarTree.from_packed_chains(array.reshape(-1), np.array([0, 4], np.int32)),
        ):
            taken.clear()
            got = ps.build_host_bitmask([matcher], tree, smollm2.size)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {tree!r}")
            assert ("one call" in taken) == plain, (name, taken)
    assert matcher_state(matcher, PROBE, smollm2.words) == before
    out = np.zeros((4, smollm2.words), np.int32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        ps.build_host_bitmask([matcher], ps.GrammarTree.from_linear_chain(tokens), smollm2.size,
                              out=out)  # fmt: skip
    assert matcher_state(matcher, PROBE, smollm2.words) == before


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_draft_session_tokens_of_every_integer_dtype_and_byte_order(smollm2, dtype):
    """DraftSession.extend converts parents and tokens of any integer dtype and byte order:
    it stores the token values and its rows are the oracle's."""
    request = _request(smollm2)
    tokens = [OPEN, LETTER_A, QUOTE]
    with ps.DraftSession([request.fresh()], smollm2.size) as session:
        rows = session.extend(_typed([0, 0, 0], dtype), _typed(tokens, dtype))
        assert session.tree()[1].tolist() == [[0, *tokens]]
        deeper = session.extend(_typed([1], dtype), _typed([QUOTE], dtype))
        assert session.tree()[1].tolist() == [[0, *tokens, QUOTE]]
        verify = session.verify_mask()
    nt, ns, dt = [1, 4, -1, -1, -1], [-1, 2, 3, -1, -1], [0, *tokens, QUOTE]
    want = _want(smollm2, nt, ns, dt)
    np.testing.assert_array_equal(rows, want[1:4])
    np.testing.assert_array_equal(deeper, want[4:5])
    np.testing.assert_array_equal(verify, want)
    # the row of '{' is the grammar's, not all-allowed: the token was read as 107
    fresh = request.fresh()
    assert fresh.accept_token(OPEN)
    np.testing.assert_array_equal(rows[0], fill_row(fresh, smollm2.words, smollm2.size))


# -- 2. draft sessions over matchers a pending build holds --------------------------------------
def test_draft_sessions_refuse_matchers_of_a_pending_build(smollm2):
    request = _request(smollm2)
    gate = threading.Event()
    gated = GatedMatcher(request.fresh(), gate)
    plain = request.fresh()
    replayed = ProtocolMatcher(request.fresh())  # no fork: a session would move it
    early = ps.DraftSession([plain, replayed], smollm2.size)  # opened before the build
    early.extend([[0], [0]], [[OPEN], [OPEN]], masks=False)
    tree = ps.GrammarTree.from_linear_chain(np.tile([0, OPEN, QUOTE], (4, 1)))
    handle = ps.build_grammar_vocab_mask(
        [None, gated, plain, replayed], tree, smollm2.size, wait=False
    )
    try:
        assert gated.entered.wait(600)
        before = matcher_state(plain, PROBE, smollm2.words)
        calls = list(replayed.calls)
        for grammars, index in (([plain], 0), ([None, replayed], 1), ([gated], 0)):
            with pytest.raises(ValueError, match=rf"grammars\[{index}\] is being walked"):
                ps.DraftSession(grammars, smollm2.size)
            with pytest.raises(ValueError, match=rf"grammars\[{index}\] is being walked"):
                forced_tokens(grammars, smollm2.size)
        for call in (
            lambda: early.extend([[0], [0]], [[QUOTE], [QUOTE]]),
            lambda: early.forced(),
            lambda: early.verify_mask(),  # computes the masks=False level
        ):
            with pytest.raises(ValueError, match=r"grammars\[0\] is being walked"):
                call()
        assert replayed.calls == calls  # nothing moved, nothing filled
        assert matcher_state(plain, PROBE, smollm2.words) == before
        with ps.DraftSession([request.fresh()], smollm2.size):  # other matchers: as usual
            pass
    finally:
        gate.set()
    want = expected_mask(
        [None, request, request, request], *tree.resolve(), smollm2.size, smollm2.words
    )
    np.testing.assert_array_equal(handle.result(timeout=600), want)
    with ps.DraftSession([plain, replayed], smollm2.size) as session:  # released
        assert session.forced() is not None
    with early:  # nothing was dropped: the masks=False level is computed now
        links = ([[1, -1], [1, -1]], [[-1, -1], [-1, -1]], [[0, OPEN], [0, OPEN]])
        want = expected_mask([request] * 2, *map(np.array, links), smollm2.size, smollm2.words)
        np.testing.assert_array_equal(early.verify_mask(), want)


# -- 3. an exception between accept_token and is_terminated ---------------------------------------
class RaisesAfterAccept(ProtocolMatcher):
    """``is_terminated`` raises the first time it is asked after the ``nth`` accepted token."""

    def __init__(self, inner, nth: int) -> None:
        super().__init__(inner)
        self.nth = nth
        self.accepted = 0
        self.armed = False

    def accept_token(self, token_id: int) -> bool:
        ok = super().accept_token(token_id)
        if ok:
            self.accepted += 1
            if self.accepted == self.nth:
                self.armed = True
        return ok

    def is_terminated(self) -> bool:
        if self.armed:
            self.armed = False
            raise RuntimeError(f"injected failure after accepted token #{self.nth}")
        return super().is_terminated()


def _assert_where_it_started(matcher: RaisesAfterAccept, request: Request, words: int) -> None:
    assert matcher.depth == 0
    assert matcher_state(matcher.inner, PROBE, words) == matcher_state(
        request.fresh(), PROBE, words
    )


@pytest.mark.parametrize("layout", ["dense", "compact"])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_is_terminated_raising_after_an_accept_restores_the_matcher(smollm2, layout, nth):
    request = _request(smollm2)
    matcher = RaisesAfterAccept(request.fresh(), nth)
    tree = ps.GrammarTree.from_host([TREE_NT], [TREE_NS], [TREE_DT])
    with pytest.raises(ps.MatcherError, match="injected failure") as info:
        ps.build_host_bitmask([matcher], tree, smollm2.size, layout=layout)
    assert info.value.request_index == 0
    _assert_where_it_started(matcher, request, smollm2.words)


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_is_terminated_raising_in_draft_session_extend_restores_the_matcher(smollm2, nth):
    request = _request(smollm2)
    matcher = RaisesAfterAccept(request.fresh(), nth)
    with ps.DraftSession([matcher], smollm2.size) as session:
        with pytest.raises(ps.MatcherError, match="injected failure"):
            session.extend([0, 0], [OPEN, LETTER_A])
            session.extend([1], [QUOTE])
            session.extend([3], [LETTER_N])
        _assert_where_it_started(matcher, request, smollm2.words)


# -- 4. the request index under reasoning ----------------------------------------------------------
def test_reasoning_names_the_batch_index_of_a_failing_free_row(smollm2):
    request = _request(smollm2)
    failing = FailingMatcher(request.fresh(), fail_in="fill", at_call=1)
    grammars = [request.fresh(), request.fresh(), None, failing]
    rule = ps.Reasoning([False, True, False, True], [1007], [OPEN])
    tree = ps.GrammarTree.from_linear_chain(np.tile([0, 5, 6], (4, 1)))
    with pytest.raises(ps.MatcherError, match=r"grammars\[3\]") as info:
        ps.build_host_bitmask(grammars, tree, smollm2.size, reasoning=rule)
    assert info.value.request_index == 3
    assert failing.depth == 0


# -- 5. an unclosed DraftSession collected inside the store pool's lock -----------------------------
def test_unclosed_session_finalised_inside_the_store_lock(smollm2, monkeypatch):
    """The cyclic collector may finalise a session while the draft store pool's lock is held
    (any allocation inside it); its close() must not take that lock. A watchdog turns a
    deadlock into a failure instead of a hang (a correct build returns at once)."""
    pool = HostBufferPool(max_free=4)
    monkeypatch.setattr(drafting_session, "_stores", pool)
    matcher = _request(smollm2).fresh()
    finished = threading.Event()

    def scenario() -> None:
        session = ps.DraftSession([matcher], smollm2.size)
        session.cycle = session  # only the cyclic collector frees it
        del session
        with pool._lock:
            gc.collect()
        finished.set()

    enabled = gc.isenabled()
    gc.disable()  # nothing collects the cycle before the lock is held
    try:
        worker = threading.Thread(target=scenario, daemon=True)
        worker.start()
        worker.join(60)
    finally:
        if enabled:
            gc.enable()
    assert finished.is_set(), "finalising a DraftSession inside the pool's lock deadlocked"
    assert pool.stats()["lent"] == 0  # its store went back


# -- 9. the background thread lets a dropped handle's mask go ---------------------------------------
def test_dropped_pending_handles_release_their_masks(smollm2, monkeypatch):
    pool = HostBufferPool()
    monkeypatch.setattr(get_backend("numpy"), "pool", pool)
    request = _request(smollm2)
    matchers = [request.fresh() for _ in range(300)]
    tree = ps.GrammarTree.from_linear_chain(np.array([[0, OPEN, QUOTE]]))
    for matcher in matchers:
        ps.build_grammar_vocab_mask([matcher], tree, smollm2.size, wait=False)  # dropped
    # wait for the last build to end (its matcher is released then); watchdogs, not timings
    deadline = time.monotonic() + 600
    while True:
        try:
            for matcher in matchers:
                check_not_pending([matcher])
            break
        except ValueError:
            assert time.monotonic() < deadline, "the builds never released their matcher"
            time.sleep(0.01)
    while True:
        gc.collect()
        if pool.stats()["lent"] == 0:
            break
        assert time.monotonic() < deadline, f"still lent after the builds: {pool.stats()}"
        time.sleep(0.01)
    mask = ps.build_host_bitmask([matcher], tree, smollm2.size)  # the matcher is free again
    np.testing.assert_array_equal(
        mask, expected_mask([request], *tree.resolve(), smollm2.size, smollm2.words)
    )


# -- 10. no xgrammar warnings for padding tokens -----------------------------------------------------
@contextlib.contextmanager
def _stderr_of_this_process(into: list[str]):
    """Capture file descriptor 2 (C++ code writes there directly, past sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            into.append(capture.read().decode(errors="replace"))


@pytest.mark.parametrize("threads", [1, 4])
def test_padding_draft_tokens_print_nothing(smollm2, threads):
    """SmolLM2's tokenizer padded to the model's 49216 tokens (as
    ``TokenizerInfo.from_huggingface(..., vocab_size=model_vocab)`` builds it): draft tokens
    in [49152, 49216) are rejected nodes (all-allowed rows, as the oracle says) and reach no
    xgrammar call that would log them. With 4 threads a 300-node tree is split, and the
    pieces' forks walk paths that start with such tokens."""
    from portable_spec.testing import load_vocab, tokenizer_info

    padded = 49216
    compiled = compile_sample(xgr.GrammarCompiler(tokenizer_info(vocab_size=padded)), "json_schema")
    request = Request(compiled)
    # root -> padding token -> chain of 150 nodes; root -> '{' -> '"' -> 'n' -> 'a' -> ...
    pads = [49152, 49200, 49215]
    n = 301
    nt = np.full(n, -1)
    ns = np.full(n, -1)
    dt = np.zeros(n, dtype=np.int64)
    nt[0], ns[1] = 1, 151
    for v in range(1, 150):
        nt[v] = v + 1
        dt[v] = pads[v % 3] if v < 5 else QUOTE
    for v in range(151, n - 1):
        nt[v] = v + 1
    dt[150] = pads[0]
    dt[151:] = [OPEN, QUOTE, LETTER_N, LETTER_A] + [pads[1]] + [LETTER_A] * (n - 156)
    tree = ps.GrammarTree.from_host(nt[None], ns[None], dt[None])
    want = expected_mask([request], nt[None], ns[None], dt[None], padded, padded // 32)
    ps.set_num_threads(threads)
    captured: list[str] = []
    try:
        with _stderr_of_this_process(captured):
            dense = ps.build_host_bitmask([request.fresh()], tree, padded)
            compact = ps.build_host_bitmask([request.fresh()], tree, padded, layout="compact")
            with ps.DraftSession([request.fresh()], padded) as session:
                session.extend([0, 0, 0], pads)
                session.forced()
    finally:
        ps.set_num_threads(None)
    assert captured == [""], f"xgrammar wrote to stderr: {captured[0][:300]}"
    np.testing.assert_array_equal(dense, want)
    np.testing.assert_array_equal(compact.to_dense(), want)
    assert load_vocab().size == 49152  # the padding really lies past the tokenizer


# -- 6. an outlines-core guide first used with a padded vocabulary -------------------------------
def test_outlines_guide_first_used_padded_serves_the_real_vocabulary(smollm2):
    pytest.importorskip("outlines_core")
    from _engines import engine_request

    request = engine_request("outlines", "json_schema", smollm2.eos)
    guide = request.native()
    links = ([TREE_NT], [TREE_NS], [TREE_DT])
    tree = ps.GrammarTree.from_host(*links)
    arrays = tuple(np.array(a) for a in links)
    for vocab in (49216, smollm2.size, 49216, 60000, smollm2.size):
        want = expected_mask([request], *arrays, vocab, smollm2.words)
        np.testing.assert_array_equal(ps.build_host_bitmask([guide], tree, vocab), want)
        with ps.DraftSession([guide], vocab) as session:
            np.testing.assert_array_equal(session.extend([0, 0], [OPEN, LETTER_A]), want[[1, 3]])
    with pytest.raises(ValueError, match=r"smaller than the vocabulary of grammars\[0\]"):
        ps.build_host_bitmask([guide], tree, smollm2.size - 32)


# -- 7. torch tensors whose memory does not hold their values ----------------------------------------
def _odd_tensors():
    torch = pytest.importorskip("torch")
    values = torch.tensor([[0, OPEN, QUOTE]])
    return {
        "meta": torch.empty((1, 3), dtype=torch.int64, device="meta"),
        "negative bit": torch._neg_view(values),
    }


@pytest.mark.parametrize("kind", ["meta", "negative bit"])
def test_unreadable_torch_tensors_are_refused_by_name(smollm2, kind):
    torch = pytest.importorskip("torch")
    odd = _odd_tensors()[kind]
    nt, ns = torch.tensor([[1, 2, -1]]), torch.tensor([[-1, -1, -1]])
    for ctor in (ps.GrammarTree.from_device, ps.GrammarTree.from_host):
        for position, name in enumerate(
            ("retrieve_next_token", "retrieve_next_sibling", "draft_tokens")
        ):
            arrays = [nt, ns, torch.tensor([[0, OPEN, QUOTE]])]
            arrays[position] = odd
            with pytest.raises(TypeError, match=rf"^{name}: .*(meta|negative)"):
                ctor(*arrays)
    with pytest.raises(TypeError, match=r"^draft_tokens: .*(meta|negative)"):
        ps.GrammarTree.from_linear_chain(odd)
    matcher = ProtocolMatcher(_request(smollm2).fresh())
    with ps.DraftSession([matcher], smollm2.size) as session:
        calls = list(matcher.calls)
        with pytest.raises(TypeError, match=r"^tokens: .*(meta|negative)"):
            session.extend(torch.zeros((1, 3), dtype=torch.int64), odd)
        with pytest.raises(TypeError, match=r"^parents: .*(meta|negative)"):
            session.extend(odd * 0 if kind == "meta" else torch._neg_view(odd * 0), odd.abs())
        assert matcher.calls == calls and session.nodes == 1


# -- 8. logits wider than the mask --------------------------------------------------------------------
def _framework(name):
    if name == "numpy":
        return None, lambda a: a, np.asarray
    if name == "torch":
        torch = pytest.importorskip("torch")
        return torch.device("cpu"), torch.from_numpy, lambda a: a.numpy()
    jax = pytest.importorskip("jax")
    return jax.devices("cpu")[0], lambda a: jax.device_put(a, jax.devices("cpu")[0]), np.asarray


@pytest.mark.parametrize("layout", ["dense", "compact"])
@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_logits_wider_than_the_mask(smollm2, framework, layout):
    """60000-wide logits, a mask of SmolLM2's 49152 tokens: refused (the 10848 extra columns
    would stay allowed in constrained rows); with vocab_size=49152 the columns below are
    masked as the oracle says and every column past it is -inf in every row, the
    unconstrained request's and rejected nodes' all-allowed rows included."""
    device, put, get = _framework(framework)
    request = _request(smollm2)
    links = (np.array([TREE_NT] * 2), np.array([TREE_NS] * 2), np.array([TREE_DT] * 2))
    want = expected_mask([request, None], *links, smollm2.size, smollm2.words)
    tree = ps.GrammarTree.from_host(*links)
    mask = ps.build_grammar_vocab_mask(
        [request.fresh(), None], tree, smollm2.size, device=device, layout=layout
    )
    rng = np.random.default_rng(8)
    host = rng.standard_normal((want.shape[0], 60000)).astype(np.float32)
    logits = put(host.copy())
    with pytest.raises(ValueError, match=r"60000 columns but the mask covers only 49152 tokens"):
        ps.apply_vocab_mask(logits, mask)
    np.testing.assert_array_equal(get(logits), host)  # nothing written
    with pytest.raises(ValueError, match=r"vocab_size = 49153 but the mask covers only 49152"):
        ps.apply_vocab_mask(logits, mask, vocab_size=49153)
    masked = get(ps.apply_vocab_mask(logits, mask, vocab_size=smollm2.size))
    bits = np.unpackbits(want.view(np.uint8), axis=1, bitorder="little").astype(bool)
    reference = host.copy()
    reference[:, : smollm2.size][~bits] = -np.inf
    reference[:, smollm2.size :] = -np.inf
    np.testing.assert_array_equal(masked, reference)
    assert (want[5:] == -1).all() and np.isneginf(masked[5:, smollm2.size :]).all()
    # no mask at all (no request has a grammar): only the padding ids go
    fresh = put(host.copy())
    unmasked = get(ps.apply_vocab_mask(fresh, None, vocab_size=smollm2.size))
    np.testing.assert_array_equal(unmasked[:, : smollm2.size], host[:, : smollm2.size])
    assert np.isneginf(unmasked[:, smollm2.size :]).all()
    assert get(ps.apply_vocab_mask(put(host.copy()), None)).tolist() == host.tolist()
