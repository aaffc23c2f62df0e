"""Malformed input is refused with a clear error before any matcher moves."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import ProtocolMatcher, matcher_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_spec as ps
import portable_spec.topology as topology_module

# (name, next_token, next_sibling, expected message pattern); node 0 is the root.
MALFORMED_TREES = [
    ("child cycle", [1, 2, 1, -1], [-1, -1, -1, -1], r"two parents|cycle"),
    ("sibling cycle", [1, -1, -1, -1], [-1, 2, 3, 2], r"two parents|cycle"),
    ("self child", [1, 1, -1], [-1, -1, -1], r"two parents|cycle"),
    ("self sibling", [1, -1, -1], [-1, 2, 2], r"two parents|cycle"),
    ("back to root as child", [1, 0, -1], [-1, -1, -1], r"links the root"),
    ("back to root as sibling", [1, -1, -1], [-1, 0, -1], r"links the root"),
    ("root self link", [0, -1], [-1, -1], r"links the root"),
    ("root has a sibling", [1, -1, -1], [2, -1, -1], r"root \(node 0\) cannot have a sibling"),
    ("unreachable cycle", [1, -1, -1, 4, 3], [-1, -1, -1, -1, -1], r"cycle"),
    ("unreachable sibling cycle", [1, -1, -1, -1, -1], [-1, -1, 3, 4, 2], r"cycle"),
    (
        "two parents (children)",
        [1, 3, 3, -1],
        [-1, 2, -1, -1],
        r"node 3 of request 0 has two parents",
    ),
    (
        "two parents (child+sibling)",
        [1, 2, -1],
        [-1, 2, -1],
        r"node 2 of request 0 has two parents",
    ),
    (
        "link below -1",
        [1, -2, -1],
        [-1, -1, -1],
        r"retrieve_next_token\[0, 1\] = -2 is outside \[-1, 3\)",
    ),
    ("link past the end", [1, 3, -1], [-1, -1, -1], r"retrieve_next_token\[0, 1\] = 3 is outside"),
    (
        "sibling past the end",
        [1, -1, -1],
        [-1, 9, -1],
        r"retrieve_next_sibling\[0, 1\] = 9 is outside",
    ),
    ("huge link", [1, 2**40, -1], [-1, -1, -1], r"is outside"),
]


@pytest.fixture
def recording(smollm2):
    """Two matchers (xgrammar and protocol) whose every movement is observable."""
    compiled = smollm2.grammars["json_schema"]
    xm = xgr.GrammarMatcher(compiled)
    pm = ProtocolMatcher(xgr.GrammarMatcher(compiled), vocab_size=smollm2.size)
    return xm, pm


def _assert_untouched(xm, pm, smollm2, before):
    assert pm.calls == []
    assert matcher_state(xm, [0, 1, 2, 90], smollm2.words) == before


@pytest.mark.parametrize("path", ["lists", "arrays"])
@pytest.mark.parametrize(
    ("name", "nt", "ns", "pattern"), MALFORMED_TREES, ids=[t[0] for t in MALFORMED_TREES]
)
def test_malformed_links(
    smollm2, recording, monkeypatch, builder_mode, path, name, nt, ns, pattern
):
    if path == "arrays":
        monkeypatch.setattr(topology_module, "SMALL_TREE_ROWS", 0)
    xm, pm = recording
    before = matcher_state(xm, [0, 1, 2, 90], smollm2.words)
    # The malformed tree is request 1; request 0 is valid, so an eager builder would move.
    n = len(nt)
    good_nt = [1, -1] + [-1] * (n - 2)
    good_ns = [-1] * n
    tree = ps.GrammarTree.from_host([good_nt, nt], [good_ns, ns], np.zeros((2, n), dtype=np.int64))
    with pytest.raises(
        ValueError, match=pattern.replace("request 0", "request 1").replace("[0, ", "[1, ")
    ):
        ps.build_host_bitmask([xm, pm], tree, smollm2.size)
    _assert_untouched(xm, pm, smollm2, before)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    nodes=st.integers(1, 12),
    data=st.data(),
)
def test_both_validators_agree(nodes, data):
    """Random (mostly malformed) links: the list and array validators raise the same error,
    or derive the same parents."""
    batch = data.draw(st.integers(1, 3))
    link = st.integers(-2, nodes)
    nt = np.array(
        data.draw(
            st.lists(st.lists(link, min_size=nodes, max_size=nodes), min_size=batch, max_size=batch)
        )
    )
    ns = np.array(
        data.draw(
            st.lists(st.lists(link, min_size=nodes, max_size=nodes), min_size=batch, max_size=batch)
        )
    )
    results = []
    for small in (topology_module._validate_lists, topology_module._validate_numpy):
        try:
            topo = small(nt, ns)
            results.append(("ok", topo.parent.tolist(), topo.reachable.tolist()))
        except ValueError as exc:
            results.append(("error", str(exc)))
    assert results[0] == results[1]


def test_valid_random_trees_validate(smollm2):
    """Generated valid trees of every shape pass both validators with the oracle's parents."""
    from _oracle import parents_of

    rng = np.random.default_rng(3)
    for _ in range(200):
        batch, nodes = int(rng.integers(1, 4)), int(rng.integers(1, 30))
        nt = np.full((batch, nodes), -1)
        ns = np.full((batch, nodes), -1)
        for b in range(batch):
            kids: dict[int, list[int]] = {0: []}
            order = rng.permutation(np.arange(1, nodes)).tolist()
            for j in order:
                if rng.random() < 0.1:
                    continue
                p = int(rng.choice(sorted(kids)))
                kids[p].insert(int(rng.integers(0, len(kids[p]) + 1)), j)
                kids[j] = []
            for u, ks in kids.items():
                if ks:
                    nt[b, u] = ks[0]
                for a, c in itertools.pairwise(ks):
                    ns[b, a] = c
        for fn in (topology_module._validate_lists, topology_module._validate_numpy):
            topo = fn(nt, ns)
            for b in range(batch):
                want = parents_of(nt[b].tolist(), ns[b].tolist())
                got = topo.parent[b * nodes : (b + 1) * nodes]
                got = [int(p) - b * nodes if p >= 0 else -1 for p in got]
                assert got == want


def test_deep_chain_validates_without_recursion():
    nodes = 5000
    nt = np.append(np.arange(1, nodes), -1)[None]
    ns = np.full((1, nodes), -1)
    for fn in (topology_module._validate_lists, topology_module._validate_numpy):
        topo = fn(nt, ns)
        assert topo.parent[-1] == nodes - 2


# -- arrays, grammars, vocab, out -------------------------------------------------------------
def _tree(batch=2, nodes=3):
    return ps.GrammarTree.from_host(
        np.tile([1, -1, -1][:nodes], (batch, 1)),
        np.full((batch, nodes), -1),
        np.zeros((batch, nodes), dtype=np.int32),
    )


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        (
            ([[1, -1]], [[-1, -1, -1]], [[0, 0]]),
            ValueError,
            r"retrieve_next_token has shape \(1, 2\) but retrieve_next_sibling has shape \(1, 3\)",
        ),
        (
            ([[[1]]], [[[1]]], [[[1]]]),
            ValueError,
            r"must be \[batch, nodes\] or \[nodes\], got 3 dimensions",
        ),
        ((np.int64(1), np.int64(1), np.int64(1)), ValueError, r"got 0 dimensions"),
        (
            (np.zeros((1, 2)), np.zeros((1, 2), int), np.zeros((1, 2), int)),
            TypeError,
            r"retrieve_next_token must have an integer dtype, got float64",
        ),
        (
            (np.zeros((1, 2), int), np.zeros((1, 2), bool), np.zeros((1, 2), int)),
            TypeError,
            r"retrieve_next_sibling must have an integer dtype, got bool",
        ),
        (
            (np.zeros((1, 0), int), np.zeros((1, 0), int), np.zeros((1, 0), int)),
            ValueError,
            r"at least the root node",
        ),
        (("abc", [1], [1]), TypeError, r"no portable_spec backend handles"),
    ],
)
def test_bad_arrays(args, error, pattern):
    with pytest.raises(error, match=pattern):
        ps.GrammarTree.from_host(*args)


def test_bad_grammars(smollm2, recording):
    xm, pm = recording
    tree = _tree()
    with pytest.raises(ValueError, match=r"len\(matchers\) = 1 but the tree has batch 2"):
        ps.build_host_bitmask([xm], tree, smollm2.size)
    with pytest.raises(TypeError, match=r"matchers\[1\] is a builtins.str"):
        ps.build_host_bitmask([pm, "json"], tree, smollm2.size)
    with pytest.raises(TypeError, match=r"missing: accept_token, rollback"):
        ps.build_host_bitmask([pm, object()], tree, smollm2.size)
    with pytest.raises(TypeError, match=r"matchers must be a sequence"):
        ps.build_host_bitmask(xm, tree, smollm2.size)
    with pytest.raises(
        ValueError, match=r"matchers\[1\] is the same matcher object as matchers\[0\]"
    ):
        ps.build_host_bitmask([pm, pm], tree, smollm2.size)
    assert pm.calls == []


@pytest.mark.parametrize(
    ("vocab_size", "error", "pattern"),
    [
        (0, ValueError, "vocab_size must be positive"),
        (-5, ValueError, "vocab_size must be positive"),
        (1.5, TypeError, "vocab_size must be an int, got float"),
        (True, TypeError, "vocab_size must be an int, got bool"),
        ("49152", TypeError, "vocab_size must be an int, got str"),
        (2**31, ValueError, r"vocab_size = 2147483648 is past portable_spec.MAX_VOCAB_SIZE"),
        (10**12, ValueError, r"vocab_size = 1000000000000 is past portable_spec.MAX_VOCAB_SIZE"),
        (np.int64(2**21 + 1), ValueError, r"vocab_size = 2097153 is past .*MAX_VOCAB_SIZE"),
        (1000, ValueError, r"vocab_size = 1000 is smaller than the vocabulary of matchers\[0\]"),
        (49120, ValueError, r"vocab_size = 49120 is smaller than the vocabulary of matchers\[0\]"),
    ],
)
def test_bad_vocab_size(smollm2, recording, vocab_size, error, pattern):
    xm, pm = recording
    before = matcher_state(xm, [0, 1, 2, 90], smollm2.words)
    with pytest.raises(error, match=pattern):
        ps.build_host_bitmask([xm, pm], _tree(), vocab_size)
    with pytest.raises(error, match=pattern):
        ps.build_grammar_vocab_mask([xm, pm], _tree(), vocab_size)
    _assert_untouched(xm, pm, smollm2, before)


def test_vocab_size_limit(smollm2, recording):
    """The largest vocabulary a build takes is documented and leaves real ones room (the
    largest of released models: 262,144 tokens); chains and draft lists refuse past it too,
    before any matcher moves and before any mask is allocated."""
    xm, pm = recording
    assert ps.MAX_VOCAB_SIZE == 2**21 and ps.MAX_VOCAB_SIZE >= 8 * 262_144
    before = matcher_state(xm, [0, 1, 2, 90], smollm2.words)
    chains = ps.GrammarTree.from_linear_chain(np.zeros((2, 3), np.int64))
    for build in (
        lambda v: ps.build_host_bitmask([xm, pm], chains, v),
        lambda v: ps.build_chain_bitmask([xm, pm], [[90], [91]], v),
        lambda v: ps.build_grammar_vocab_mask([xm, pm], chains, v, wait=False),
    ):
        with pytest.raises(ValueError, match="past portable_spec.MAX_VOCAB_SIZE = 2097152"):
            build(ps.MAX_VOCAB_SIZE + 1)
    _assert_untouched(xm, pm, smollm2, before)
    # the limit itself is a vocabulary (of padded logits past the matchers' own)
    mask = ps.build_host_bitmask([None, xgr.GrammarMatcher(smollm2.grammars["regex"])],
                                 _tree(), ps.MAX_VOCAB_SIZE)  # fmt: skip
    assert mask.shape == (6, ps.MAX_VOCAB_SIZE // 32)


@pytest.mark.parametrize("entry", ["host", "chains", "device", "device-pending"])
@pytest.mark.parametrize("value", ["yes", 1, None, np.bool_(True)])
def test_return_valid_must_be_a_bool(smollm2, recording, entry, value):
    """As ``wait=``: ``return_valid`` of another type is refused by name, before anything."""
    xm, pm = recording
    before = matcher_state(xm, [0, 1, 2, 90], smollm2.words)
    builds = {
        "host": lambda: ps.build_host_bitmask([xm, pm], _tree(), smollm2.size, return_valid=value),
        "chains": lambda: ps.build_chain_bitmask(
            [xm, pm], [[90], [91]], smollm2.size, return_valid=value
        ),
        "device": lambda: ps.build_grammar_vocab_mask(
            [xm, pm], _tree(), smollm2.size, return_valid=value
        ),
        "device-pending": lambda: ps.build_grammar_vocab_mask(
            [xm, pm], _tree(), smollm2.size, return_valid=value, wait=False
        ),
    }
    with pytest.raises(TypeError, match=f"return_valid must be a bool, got {type(value).__name__}"):
        builds[entry]()
    _assert_untouched(xm, pm, smollm2, before)


@pytest.mark.parametrize("capacity", [-1, 0, -(2**40)])
def test_row_capacity_must_be_positive(smollm2, recording, capacity):
    xm, pm = recording
    with pytest.raises(ValueError, match=f"row_capacity must be positive, got {capacity}"):
        ps.build_grammar_vocab_mask([xm, pm], _tree(), smollm2.size, row_capacity=capacity)
    assert pm.calls == []


def test_protocol_matcher_vocab_larger_than_model(smollm2, recording):
    _, pm = recording
    with pytest.raises(
        ValueError,
        match=r"vocab_size = 49151 is smaller than the vocabulary of matchers\[1\] \(49152 tokens\)",
    ):
        ps.build_host_bitmask([None, pm], _tree(), 49151)
    pm.vocab_size = "big"
    with pytest.raises(TypeError, match=r"matchers\[1\].vocab_size must be a positive int"):
        ps.build_host_bitmask([None, pm], _tree(), 49152)
    assert pm.calls == []


def test_bad_out(smollm2, recording):
    xm, pm = recording
    tree = _tree()
    w = smollm2.words
    cases = [
        (np.zeros((6, w), np.int64), TypeError, "out must have dtype int32, got int64"),
        (np.zeros((5, w), np.int32), ValueError, re.escape(f"out must have shape (6, {w})")),
        (np.zeros((w, 6), np.int32).T, ValueError, "out must be C-contiguous"),
        ([[0]], TypeError, "out must be a numpy int32 array, got list"),
    ]
    readonly = np.zeros((6, w), np.int32)
    readonly.flags.writeable = False
    cases.append((readonly, ValueError, "out is read-only"))
    for out, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            ps.build_host_bitmask([xm, pm], tree, smollm2.size, out=out)
    assert pm.calls == []


def test_tree_type_checked(smollm2, recording):
    xm, pm = recording
    with pytest.raises(TypeError, match="tree must be a portable_spec.GrammarTree"):
        ps.build_host_bitmask([xm, pm], ([1], [1], [1]), smollm2.size)
    with pytest.raises(TypeError, match="tree must be a portable_spec.GrammarTree"):
        ps.build_grammar_vocab_mask([xm, pm], None, smollm2.size)


def test_empty_batch_and_unconstrained_return_none(smollm2):
    empty = ps.GrammarTree.from_host(
        np.zeros((0, 4), int), np.zeros((0, 4), int), np.zeros((0, 4), int)
    )
    assert empty.batch == 0
    assert ps.build_host_bitmask([], empty, smollm2.size) is None
    assert ps.build_grammar_vocab_mask([], empty, smollm2.size) is None
    out = np.full((6, smollm2.words), 7, np.int32)
    assert ps.build_host_bitmask([None, None], _tree(), smollm2.size, out=out) is None
    assert (out == 7).all()  # untouched
    # the unconstrained path does not even need a valid tree
    bad = ps.GrammarTree.from_host([[1, 1]], [[-1, -1]], [[0, 0]])
    assert ps.build_host_bitmask([None], bad, smollm2.size) is None


def test_width_probe_fallback(smollm2, monkeypatch):
    """If xgrammar's error message stops stating the width, the probe still works for
    matchers as wide as the model's mask and refuses others clearly."""
    import portable_spec.engines.xgrammar as grammars_module

    monkeypatch.setattr(grammars_module, "_WIDTH_IN_MESSAGE", re.compile("never matches"))
    m = xgr.GrammarMatcher(smollm2.grammars["regex"])
    tree = _tree(batch=1)
    assert ps.build_host_bitmask([m], tree, smollm2.size) is not None
    other = xgr.GrammarMatcher(smollm2.grammars["regex"])
    with pytest.raises(TypeError, match="could not determine the bitmask width"):
        ps.build_host_bitmask([other], tree, smollm2.size + 64)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(nodes=st.integers(1, 12), data=st.data())
def test_compiled_checker_agrees_with_python(nodes, data):
    """The compiled link checker says "valid" exactly when the Python validator does."""
    from portable_spec.native import native

    if native is None:
        pytest.skip("portable_spec._native is not built here")
    batch = data.draw(st.integers(1, 3))
    link = st.integers(-2, nodes)
    shape = st.lists(st.lists(link, min_size=nodes, max_size=nodes), min_size=batch, max_size=batch)
    nt = np.array(data.draw(shape), dtype=np.int64)
    ns = np.array(data.draw(shape), dtype=np.int64)
    if data.draw(st.booleans()):  # bias towards valid trees: drop most links
        nt[nt > 0] = np.where(np.arange(nt[nt > 0].size) % 3 == 0, nt[nt > 0], -1)
        ns[:, 0] = -1
    try:
        topology_module.validate_links(nt, ns)
        python_ok = True
    except ValueError:
        python_ok = False
    assert native.links_valid(nt, ns) == python_ok
