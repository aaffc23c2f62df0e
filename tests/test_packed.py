"""Packed (ragged) chains: ``GrammarTree.from_packed_chains(tokens, offsets)`` against the
per-node replay oracle on SmolLM2's vocabulary, with xgrammar, llguidance and outlines-core
matchers, reasoning requests, numpy / torch CPU / JAX CPU staging, and malformed offsets."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from _cases import allowed_tokens, draw_case
from _oracle import (
    expected_accepted,
    expected_node_counts,
    expected_reasoning_mask,
    expected_rows,
    matcher_state,
)
from _short_path import spy_short_paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_spec as ps
import portable_spec.builder.routes as routes
from portable_spec.stats import reset_grammar_stats

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROBE = [0, 1, 2, 100, 1000, 18, 107]
ENGINES = ("xgrammar", "llguidance", "outlines")


def _factory(smollm2, engines):
    if engines == ("xgrammar",):
        return None, ("json_schema", "ebnf", "regex", "builtin_json")
    pytest.importorskip("llguidance")
    pytest.importorskip("outlines_core")
    from _engines import engine_factory

    return engine_factory(smollm2, engines)


def _prints(matchers, words):
    from _engines import matcher_prints

    return matcher_prints(matchers, words, PROBE)


def _draw_chain(data, request, vocab, vocab_size, length):
    """A chain of ``length`` nodes (the root first, its value unread): mostly tokens the
    grammar allows after the path so far, sometimes off-grammar, EOS or out of range."""
    tokens = [data.draw(st.integers(0, vocab.size - 1), label="root token")]
    state = None if request is None else request.fresh()
    for _ in range(length - 1):
        category = data.draw(st.integers(0, 9), label="token category")
        if category <= 5 and state is not None and not state.is_terminated():
            options = allowed_tokens(state, vocab.words, vocab.size)
            token = (
                int(options[data.draw(st.integers(0, 10**6)) % len(options)]) if len(options) else 0
            )
        elif category == 6:
            token = data.draw(st.integers(0, vocab.size - 1))
        elif category == 7:
            token = vocab.eos
        elif category == 8:
            token = data.draw(st.sampled_from([-1, -(2**31), vocab.size, vocab_size, 2**31 - 1]))
        else:
            token = data.draw(st.integers(vocab.size, max(vocab.size, vocab_size - 1)))
        tokens.append(token)
        if state is not None and not state.is_terminated() and 0 <= token < vocab.size:
            if not state.accept_token(token):
                state = None
        elif state is not None and token != vocab.eos:
            state = None
    return tokens


def _draw_packed(data, smollm2, engines, max_length=8, uniform=False):
    """A drawn batch (grammars with prefixes, some unconstrained) and ragged chains (of one
    length with ``uniform``): ``(case, chains, tokens, offsets)``."""
    make, kinds = _factory(smollm2, engines)
    case = draw_case(
        data, smollm2, kinds=kinds, make_request=make, protocol=False, max_nodes=1, max_batch=5
    )
    chains = []
    same = data.draw(st.integers(1, max_length), label="uniform length")
    for request in case.requests:
        length = same if uniform else data.draw(st.integers(1, max_length), label="length")
        chains.append(_draw_chain(data, request, smollm2, case.vocab_size, length))
    offsets = np.cumsum([0, *map(len, chains)]).astype(np.int64)
    tokens = np.array([t for chain in chains for t in chain], dtype=np.int64)
    return case, chains, tokens, offsets


def _links(n):
    return [*range(1, n), -1], [-1] * n


def _oracle(case, chains, vocab, words):
    """Expected packed rows and flat valid flags, by per-node replay of each chain."""
    rows, valid = [], []
    for request, chain in zip(case.requests, chains, strict=True):
        nt, ns = _links(len(chain))
        fresh = None if request is None else request.fresh
        rows.append(expected_rows(fresh, nt, ns, chain, vocab, words))
        valid.extend(expected_accepted(fresh, nt, ns, chain, vocab, words))
    return np.concatenate(rows, axis=0), np.array(valid, dtype=bool)


def _assert_rows(mask, want):
    assert mask.dtype == np.int32 and mask.shape == want.shape, (mask.shape, want.shape)
    bad = np.flatnonzero((mask != want).any(axis=1))
    assert bad.size == 0, f"rows differing from the oracle: {bad.tolist()}"


@pytest.mark.parametrize("engines", [("xgrammar",), ("llguidance",), ("outlines",), ENGINES])
@SETTINGS
@given(data=st.data())
def test_matches_oracle(smollm2, engines, builder_mode, data, monkeypatch):
    """Ragged chains (1-node requests included), every engine, with and without the compiled
    helper, inline or on the pool: row ``offsets[b] + j`` equals the replay of request b's
    first j drafts, valid flags equal, the given ``out`` written in place, matchers
    restored."""
    monkeypatch.setattr(routes, "POOL_WORK", data.draw(st.sampled_from([0, routes.POOL_WORK])))
    case, chains, tokens, offsets = _draw_packed(data, smollm2, engines)
    before = _prints(case.matchers, smollm2.words)
    tree = ps.GrammarTree.from_packed_chains(tokens, offsets)
    assert (tree.batch, tree.rows) == (len(chains), int(offsets[-1]))
    want, want_valid = _oracle(case, chains, case.vocab_size, smollm2.words)
    out = np.zeros((tree.rows, -(-case.vocab_size // 32)), dtype=np.int32)
    mask, valid = ps.build_host_bitmask(
        case.matchers, tree, case.vocab_size, out=out, return_valid=True
    )
    if all(m is None for m in case.matchers):
        assert mask is None
    else:
        assert mask is out
        _assert_rows(mask, want)
    assert valid.shape == (tree.rows,) and valid.dtype == bool
    np.testing.assert_array_equal(valid, want_valid)
    assert _prints(case.matchers, smollm2.words) == before


@pytest.mark.parametrize("engines", [("xgrammar",), ENGINES])
@pytest.mark.parametrize("layout", ["packed", "linear"])
@SETTINGS
@given(data=st.data())
def test_reasoning_matches_oracle(smollm2, engines, layout, builder_mode, data, monkeypatch):
    """reasoning= over packed chains (and linear chains of one length) equals the reasoning
    replay of each chain, inline or through the pool, matchers restored."""
    monkeypatch.setattr(routes, "POOL_WORK", data.draw(st.sampled_from([0, routes.POOL_WORK])))
    case, chains, tokens, offsets = _draw_packed(data, smollm2, engines, uniform=layout == "linear")
    seen = sorted({int(t) for c in chains for t in c[1:] if 0 <= t < smollm2.size})
    pool = [*seen, smollm2.eos, 0, 5]
    chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
    split = data.draw(st.integers(0, len(chosen)))
    ends, content = chosen[:split], chosen[split:]
    active = np.array(
        data.draw(st.lists(st.booleans(), min_size=len(chains), max_size=len(chains))), dtype=bool
    )
    reasoning = ps.Reasoning(active, ends, content)
    before = _prints(case.matchers, smollm2.words)
    if layout == "linear":
        tree = ps.GrammarTree.from_linear_chain(np.array(chains, dtype=np.int64))
    else:
        tree = ps.GrammarTree.from_packed_chains(tokens, offsets)
    mask, valid = ps.build_host_bitmask(
        case.matchers, tree, case.vocab_size, reasoning=reasoning, return_valid=True
    )
    valid = valid.reshape(-1)
    blocks, flags = [], []
    for b, chain in enumerate(chains):
        nt, ns = _links(len(chain))
        rows, ok = expected_reasoning_mask(
            [case.requests[b]],
            np.array([nt]),
            np.array([ns]),
            np.array([chain]),
            case.vocab_size,
            smollm2.words,
            [bool(active[b])],
            set(ends),
            set(content),
            with_valid=True,
        )
        blocks.append(rows)
        flags.append(ok[0])
    if mask is not None:
        _assert_rows(mask, np.concatenate(blocks, axis=0))
    np.testing.assert_array_equal(valid, np.concatenate(flags))
    assert _prints(case.matchers, smollm2.words) == before


def _json_batch(smollm2):
    """Three JSON requests with chains of 3, 1 and 4 nodes (real grammar-valid drafts)."""
    from _oracle import Request

    requests = [Request(smollm2.grammars["json_schema"]) for _ in range(3)]
    chains = []
    for request, length in zip(requests, (3, 1, 4), strict=True):
        m = request.fresh()
        chain = [0]
        for _ in range(length - 1):
            token = int(allowed_tokens(m, smollm2.words, smollm2.size)[0])
            assert m.accept_token(token)
            chain.append(token)
        chains.append(chain)
    offsets = np.cumsum([0, *map(len, chains)]).astype(np.int64)
    tokens = np.array([t for c in chains for t in c], dtype=np.int64)
    return requests, chains, tokens, offsets


def _frameworks():
    stages = [("numpy", lambda a: a)]
    try:
        import torch

        stages.append(("torch", lambda a: torch.from_numpy(a.copy())))
    except ImportError:  # pragma: no cover
        pass
    try:
        import jax.numpy as jnp

        stages.append(("jax", lambda a: jnp.asarray(a.astype(np.int32))))
    except ImportError:  # pragma: no cover
        pass
    return stages


@pytest.mark.parametrize("framework", [name for name, _ in _frameworks()])
@pytest.mark.parametrize("capacity", [None, 12])
def test_staged_from_every_framework(smollm2, framework, capacity):
    """Tokens and offsets from numpy, torch CPU tensors or JAX CPU arrays (int32 included):
    build_grammar_vocab_mask returns the framework's mask with the oracle's rows, then
    all-allowed capacity rows; return_valid flat."""
    stage = dict(_frameworks())[framework]
    requests, chains, tokens, offsets = _json_batch(smollm2)
    matchers = [r.fresh() for r in requests]
    tree = ps.GrammarTree.from_packed_chains(stage(tokens), stage(offsets))
    assert tree.backend.name == framework
    mask, valid = ps.build_grammar_vocab_mask(
        matchers, tree, smollm2.size, row_capacity=capacity, return_valid=True
    )
    host = np.asarray(mask.cpu() if framework == "torch" else mask)
    want, want_valid = _oracle(
        type("C", (), {"requests": requests})(), chains, smollm2.size, smollm2.words
    )
    rows = int(offsets[-1])
    assert host.shape == (capacity or rows, smollm2.words)
    _assert_rows(host[:rows], want)
    assert (host[rows:] == -1).all()
    np.testing.assert_array_equal(valid, want_valid)
    assert want_valid.all()  # the drafts were grammar-valid: every row is a grammar row
    assert ((want != -1).any(axis=1)).all()


def test_same_rows_as_a_padded_chain_tree(smollm2):
    """Independent of the oracle: the packed rows are the padded linear-chain tree's rows
    of each request's first n nodes (a chain tree padded with grammar-valid tokens)."""
    requests, chains, tokens, offsets = _json_batch(smollm2)
    width = max(map(len, chains))
    padded = np.zeros((len(chains), width), dtype=np.int64)
    for b, c in enumerate(chains):
        padded[b, : len(c)] = c
    full = ps.build_host_bitmask(
        [r.fresh() for r in requests], ps.GrammarTree.from_linear_chain(padded), smollm2.size
    )
    packed = ps.build_host_bitmask(
        [r.fresh() for r in requests],
        ps.GrammarTree.from_packed_chains(tokens, offsets),
        smollm2.size,
    )
    want = np.concatenate([full[b * width : b * width + len(c)] for b, c in enumerate(chains)])
    np.testing.assert_array_equal(packed, want)


BAD_OFFSETS = [
    ([1, 3, 5], "offsets[0] must be 0"),
    ([0, 3, 3, 5], "request 1 has offsets[2] - offsets[1] = 0 nodes"),
    ([0, 4, 2, 5], "request 1 has offsets[2] - offsets[1] = -2"),
    ([], "offsets must be 1-D"),
    ([[0, 5]], "offsets must be 1-D"),
]


@pytest.mark.parametrize("offsets, message", BAD_OFFSETS)
def test_malformed_offsets_are_refused(smollm2, offsets, message):
    """Bad offsets raise a ValueError naming the request or field; nothing moves."""
    requests, _, tokens, _ = _json_batch(smollm2)
    matchers = [r.fresh() for r in requests]
    before = [matcher_state(m, PROBE, smollm2.words) for m in matchers]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tree = ps.GrammarTree.from_packed_chains(tokens[:5], np.array(offsets, dtype=np.int64))
        ps.build_host_bitmask(matchers, tree, smollm2.size)
    assert [matcher_state(m, PROBE, smollm2.words) for m in matchers] == before


def test_malformed_tokens_and_arguments_are_refused(smollm2):
    """Wrong dtypes and shapes, a token count other than offsets[-1], a wrong number of
    grammars, the compact layout, a wrong ``out``: refused before any matcher moves."""
    requests, _, tokens, offsets = _json_batch(smollm2)
    matchers = [r.fresh() for r in requests]
    before = [matcher_state(m, PROBE, smollm2.words) for m in matchers]
    with pytest.raises(TypeError, match="offsets must have an integer dtype"):
        ps.GrammarTree.from_packed_chains(tokens, offsets.astype(np.float64))
    with pytest.raises(TypeError, match="tokens must have an integer dtype"):
        ps.GrammarTree.from_packed_chains(tokens.astype(np.float32), offsets)
    with pytest.raises(ValueError, match="tokens has 7 entries but offsets"):
        ps.GrammarTree.from_packed_chains(tokens[:-1], offsets)
    with pytest.raises(ValueError, match="tokens must be 1-D"):
        ps.GrammarTree.from_packed_chains(tokens.reshape(1, -1), offsets)
    tree = ps.GrammarTree.from_packed_chains(tokens, offsets)
    with pytest.raises(ValueError, match="matchers"):
        ps.build_host_bitmask(matchers[:2], tree, smollm2.size)
    with pytest.raises(ValueError, match="dense masks only"):
        ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact")
    with pytest.raises(ValueError, match="dense masks only"):
        ps.build_grammar_vocab_mask(matchers, tree, smollm2.size, layout="compact")
    with pytest.raises(ValueError, match="out must have shape"):
        bad = np.zeros((3 * 4, smollm2.words), dtype=np.int32)
        ps.build_host_bitmask(matchers, tree, smollm2.size, out=bad)
    assert [matcher_state(m, PROBE, smollm2.words) for m in matchers] == before


def test_no_grammar_gives_none_and_every_node_valid(smollm2):
    """Unconstrained requests only: no mask, every packed node valid."""
    tree = ps.GrammarTree.from_packed_chains(np.arange(6), np.array([0, 1, 6]))
    mask, valid = ps.build_host_bitmask([None, None], tree, smollm2.size, return_valid=True)
    assert mask is None
    np.testing.assert_array_equal(valid, np.ones(6, dtype=bool))


def test_end_tokens_and_terminated_matchers(smollm2, tok, builder_mode):
    """Chains that end the grammar (the end token mid-chain) and a matcher terminated before
    the build, next to a live one and a 1-node request: the oracle's rows in an ``out``
    holding zeros (no row left unwritten), valid flags equal."""
    from _oracle import Request

    (close,) = tok.encode("]")
    (digit,) = tok.encode("3")
    opened = tok.encode("[12")
    json = smollm2.grammars["builtin_json"]
    requests = [
        Request(json, list(opened)),  # closes, ends, then more drafts
        Request(json, [*tok.encode("[1]"), smollm2.eos]),  # terminated before the build
        Request(json, list(opened)),  # one node only
        Request(json, list(opened)),  # goes on, closes, ends, more
    ]
    chains = [
        [0, close, smollm2.eos, digit],
        [0, digit, smollm2.eos],
        [0],
        [0, digit, digit, close, smollm2.eos, digit],
    ]
    offsets = np.cumsum([0, *map(len, chains)]).astype(np.int64)
    tokens = np.array([t for c in chains for t in c], dtype=np.int64)
    matchers = [r.native() for r in requests]
    assert matchers[1].is_terminated()
    tree = ps.GrammarTree.from_packed_chains(tokens, offsets)
    out = np.zeros((tree.rows, smollm2.words), dtype=np.int32)
    mask, valid = ps.build_host_bitmask(matchers, tree, smollm2.size, out=out, return_valid=True)
    case = type("C", (), {"requests": requests})()
    want, want_valid = _oracle(case, chains, smollm2.size, smollm2.words)
    _assert_rows(mask, want)
    np.testing.assert_array_equal(valid, want_valid)
    assert (mask[offsets[1] : offsets[2]] == -1).all()  # the terminated matcher's rows


def test_device_offsets_are_checked_before_any_matcher_moves(smollm2):
    """Offsets staged from JAX (not host data for the library) are checked when the build
    resolves the tree: a zero-length request raises, every matcher where it was."""
    jnp = pytest.importorskip("jax.numpy")
    requests, _, tokens, offsets = _json_batch(smollm2)
    matchers = [r.fresh() for r in requests]
    before = [matcher_state(m, PROBE, smollm2.words) for m in matchers]
    bad = np.array([0, 3, 3, 8], dtype=np.int32)
    tree = ps.GrammarTree.from_packed_chains(jnp.asarray(tokens), jnp.asarray(bad))
    with pytest.raises(ValueError, match=r"request 1 has offsets\[2\] - offsets\[1\] = 0"):
        ps.build_host_bitmask(matchers, tree, smollm2.size)
    short = ps.GrammarTree.from_packed_chains(jnp.asarray(tokens[:-1]), jnp.asarray(offsets))
    with pytest.raises(ValueError, match="tokens has 7 entries but offsets"):
        ps.build_host_bitmask(matchers, short, smollm2.size, return_valid=True)
    assert [matcher_state(m, PROBE, smollm2.words) for m in matchers] == before


def test_offsets_layout_is_not_confused_across_shapes_and_lengths(smollm2):
    """The same offset bytes as a 2-D array, or with another token count, are refused even
    right after a good build with those offsets (the checked layout is reused only for equal
    offsets and token counts)."""
    requests, _, tokens, offsets = _json_batch(smollm2)
    good = ps.GrammarTree.from_packed_chains(tokens, offsets)
    ps.build_host_bitmask([r.fresh() for r in requests], good, smollm2.size)
    with pytest.raises(ValueError, match="offsets must be 1-D"):
        ps.GrammarTree.from_packed_chains(tokens, offsets.reshape(1, -1))
    with pytest.raises(ValueError, match="tokens has 7 entries but offsets"):
        ps.GrammarTree.from_packed_chains(tokens[:-1], offsets)
    # another dtype whose bytes equal the good int64 offsets' is read by its own values
    same_bytes = offsets.astype(np.int64).view(np.int32)
    assert same_bytes.tobytes() == offsets.astype(np.int64).tobytes()
    with pytest.raises(ValueError, match=r"request 0 has offsets\[1\] - offsets\[0\] = 0"):
        ps.GrammarTree.from_packed_chains(tokens, same_bytes)
    for dtype in (np.int32, np.uint8, np.int16):
        tree = ps.GrammarTree.from_packed_chains(tokens, offsets.astype(dtype))
        assert (tree.batch, tree.nodes, tree.rows) == (good.batch, good.nodes, good.rows)


def test_a_stale_compiled_helper_is_not_used(smollm2, monkeypatch, caplog):
    """A compiled helper built from other sources (another ABI_VERSION) is refused at load
    with one warning naming both versions, and the builds give the oracle's rows without it."""
    import importlib
    import types

    import portable_spec.native as native_module

    stale = types.ModuleType("portable_spec._native")
    stale.ABI_VERSION = native_module.ABI_VERSION - 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "portable_spec._native", stale)
    monkeypatch.setattr(importlib, "import_module", lambda name: sys.modules[name])
    monkeypatch.delenv("PORTABLE_SPEC_NO_NATIVE", raising=False)
    with caplog.at_level("WARNING", logger="portable_spec"):
        assert native_module._load() is None
    assert [r.getMessage() for r in caplog.records if "ABI" in r.getMessage()] == [
        f"portable_spec._native is a build of other sources (ABI {stale.ABI_VERSION}, these "
        f"sources need {native_module.ABI_VERSION}): reinstall the library to rebuild it; the "
        "numpy/Python paths are used"
    ]
    real = native_module.native
    native_module.use(None)
    try:
        requests, chains, tokens, offsets = _json_batch(smollm2)
        case = type("C", (), {"requests": requests})()
        want, want_valid = _oracle(case, chains, smollm2.size, smollm2.words)
        tree = ps.GrammarTree.from_packed_chains(tokens, offsets)
        matchers = [r.fresh() for r in requests]
        mask, valid = ps.build_host_bitmask(matchers, tree, smollm2.size, return_valid=True)
    finally:
        native_module.use(real)
    _assert_rows(mask, want)
    np.testing.assert_array_equal(valid, want_valid)


@SETTINGS
@given(data=st.data())
def test_small_packed_calls_take_the_short_path(smollm2, data):
    """Ragged chains of a few xgrammar requests the library has seen (tokens off the grammar,
    EOS and out of range included): the single-function path writes them (spied), from the
    caller's tokens in place, row for row and flag for flag as the replay says, an ``out``
    full of garbage rewritten, node counts as the replay counts them, matchers restored."""
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone after each example
        case, chains, tokens, offsets = _draw_packed(data, smollm2, ("xgrammar",), max_length=9)
        words = -(-case.vocab_size // 32)
        plain = all(m is not None for m in case.matchers) and words == smollm2.words
        taken = spy_short_paths(monkeypatch)
        ps.build_host_bitmask(  # the first call learns each matcher's width
            case.matchers, ps.GrammarTree.from_packed_chains(tokens, offsets), case.vocab_size
        )
        before = _prints(case.matchers, smollm2.words)
        want, want_valid = _oracle(case, chains, case.vocab_size, smollm2.words)
        out = np.random.default_rng(3).integers(
            -(2**31), 2**31, size=(int(offsets[-1]), words), dtype=np.int32
        )
        reset_grammar_stats()
        taken.clear()
        tree = ps.GrammarTree.from_packed_chains(tokens, offsets)
        result = ps.build_host_bitmask(
            case.matchers, tree, case.vocab_size, out=out, return_valid=True
        )
        # the caller's int64 tokens, read in place by one compiled call
        assert taken == (["one call"] if plain else [])
        mask, valid = result
        if all(m is None for m in case.matchers):
            assert mask is None
            return
        assert mask is out
        _assert_rows(mask, want)
        np.testing.assert_array_equal(valid, want_valid)
        if plain:
            links = [_links(len(c)) for c in chains]
            stats = ps.grammar_stats()
            want_counts = [0, 0]
            for request, chain, (nt, ns) in zip(case.requests, chains, links, strict=True):
                counts = expected_node_counts([request], np.array([nt]), np.array([ns]),
                                              np.array([chain]), case.vocab_size, smollm2.words)  # fmt: skip
                want_counts = [want_counts[0] + counts[0], want_counts[1] + counts[1]]
            assert [stats["checked_nodes"], stats["rejected_nodes"]] == want_counts
        assert _prints(case.matchers, smollm2.words) == before
