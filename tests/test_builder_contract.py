"""Row-contract corner cases, matcher failures, buffers and deep trees."""

from __future__ import annotations

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import (
    FailingMatcher,
    ProtocolMatcher,
    Request,
    expected_mask,
    expected_rows,
    fill_row,
    matcher_state,
)

import portable_spec as ps
import portable_spec.builder.routes as routes


def token(vocab, text):
    return vocab.tokens.index(text)


def json_chain(vocab, text_tokens):
    """A chain of real tokens of a JSON document (node 0 = committed, ignored)."""
    return [0, *[token(vocab, t) for t in text_tokens]]


@pytest.fixture
def person_tokens(smollm2):
    # '{"name": "Ann", "age": 3, "address": {"street": "x", "city": "y", "zip": "12345"}}'
    pieces = [
        '{"',
        "name",
        '":',
        'Ġ"',
        "Ann",
        '",',
        'Ġ"',
        "age",
        '":',
        "Ġ",
        "3",
        ",",
        'Ġ"',
        "address",
        '":',
        "Ġ{",
        '"',
        "street",
        '":',
        'Ġ"',
        "x",
        '",',
        'Ġ"',
        "city",
        '":',
        'Ġ"',
        "y",
        '",',
        'Ġ"',
        "zip",
        '":',
        'Ġ"',
        "1",
        "2",
        "3",
        "4",
        "5",
        '"}',
        "}",
    ]
    return [token(smollm2, p) for p in pieces]


def test_every_kind_of_row(smollm2, person_tokens):
    """Accepted, rejected (and its subtree), out-of-range, EOS-terminated and padding nodes,
    an unconstrained request and a matcher terminated before the step, in one batch."""
    compiled = smollm2.grammars["json_schema"]
    done = Request(compiled, [*person_tokens, smollm2.eos])
    requests = [Request(compiled), None, done, Request(compiled, person_tokens)]
    bad = token(smollm2, "Ġthe")
    # node: 0 root, 1 '{"' ok, 2 'name' ok, 3 bad sibling of 2, 4 child of bad,
    #       5 -3 (out of range) sibling of 1, 6 padding
    nt = [[1, 2, -1, 4, -1, -1, -1]] * 3 + [[1, 2, -1, -1, -1, -1, -1]]
    ns = [[-1, 5, 3, -1, -1, -1, -1]] * 3 + [[-1, -1, -1, -1, -1, -1, -1]]
    dt = [[0, person_tokens[0], person_tokens[1], bad, person_tokens[1], -3, 0]] * 3
    dt.append([0, smollm2.eos, person_tokens[0], 0, 0, 0, 0])  # EOS then a child of it
    nt, ns, dt = np.array(nt), np.array(ns), np.array(dt)
    matchers = [None if r is None else r.fresh() for r in requests]
    tree = ps.GrammarTree.from_host(nt, ns, dt)
    mask = ps.build_host_bitmask(matchers, tree, smollm2.size)
    np.testing.assert_array_equal(
        mask, expected_mask(requests, nt, ns, dt, smollm2.size, smollm2.words)
    )
    rows = mask.reshape(4, 7, -1)
    filled = (rows != -1).any(axis=2)
    assert filled[0].tolist() == [True, True, True, False, False, False, False]
    assert not filled[1].any() and not filled[2].any()  # unconstrained; terminated before
    assert filled[3].tolist() == [True, False, False, False, False, False, False]
    assert not (mask == 0).all(axis=1).any()  # no all-zero row anywhere


@pytest.mark.parametrize("matcher_kind", ["xgrammar", "protocol"])
@pytest.mark.parametrize("pad", [0, 5, 32, 100])
def test_padded_model_vocab(smollm2, person_tokens, matcher_kind, pad):
    """vocab_size larger than the grammar's: bits past the grammar's vocabulary are 0 in
    grammar rows and 1 in all-allowed rows; tokens in the padding are rejected."""
    compiled = smollm2.grammars["builtin_json"]
    vocab_size = smollm2.size + pad
    m = xgr.GrammarMatcher(compiled)
    matcher = m if matcher_kind == "xgrammar" else ProtocolMatcher(m, vocab_size=smollm2.size)
    nt = np.array([[1, -1, -1]])
    ns = np.array([[-1, 2, -1]])
    dt = np.array([[0, person_tokens[0], vocab_size - 1]])
    mask = ps.build_host_bitmask([matcher], ps.GrammarTree.from_host(nt, ns, dt), vocab_size)
    assert mask.shape == (3, -(-vocab_size // 32))
    expected = expected_mask([Request(compiled)], nt, ns, dt, vocab_size, smollm2.words)
    np.testing.assert_array_equal(mask, expected)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
    assert not bits[:2, smollm2.size :].any()
    assert (mask[2] == -1).all()


def test_protocol_matcher_stray_bits_cleared(smollm2):
    """A foreign matcher that sets bits past its own vocabulary gets them cleared."""

    class Sloppy:
        vocab_size = 40

        def __init__(self):
            self.depth = 0

        def accept_token(self, t):
            self.depth += 1
            return True

        def rollback(self, n):
            self.depth -= n

        def fill_next_token_bitmask(self, bitmask, index):
            bitmask[index] = -1

        def is_terminated(self):
            return False

    m = Sloppy()
    tree = ps.GrammarTree.from_linear_chain(np.array([[0, 39, 41]]))
    mask = ps.build_host_bitmask([m], tree, 64)
    assert mask.shape == (3, 2)
    assert mask[0, 0] == -1 and mask[0, 1] == 0xFF  # tokens 32..39 allowed, 40..63 not
    assert mask[1, 1] == 0xFF  # token 39 accepted
    assert (mask[2] == -1).all()  # token 41 is past the grammar's vocabulary: rejected
    assert m.depth == 0


@pytest.mark.parametrize("matcher_kind", ["xgrammar", "protocol"])
def test_deep_chain_3000(smollm2, matcher_kind):
    """A 3000-node chain of accepted tokens (no recursion anywhere): both walks agree with
    each other and with the oracle on sampled nodes."""
    compiled = smollm2.grammars["builtin_json"]
    tokens = [0, token(smollm2, "["), *([token(smollm2, "1"), token(smollm2, ",")] * 1500)][:3000]
    dt = np.array([tokens])
    m = xgr.GrammarMatcher(compiled)
    matcher = m if matcher_kind == "xgrammar" else ProtocolMatcher(m, vocab_size=smollm2.size)
    before = matcher_state(m, [0, 1], smollm2.words)
    mask = ps.build_host_bitmask([matcher], ps.GrammarTree.from_linear_chain(dt), smollm2.size)
    assert (mask != -1).any(axis=1).all()
    assert matcher_state(m, [0, 1], smollm2.words) == before
    fresh = xgr.GrammarMatcher(compiled)
    for j in (0, 1, 2, 3, 2999):
        m2 = xgr.GrammarMatcher(compiled)
        for t in tokens[1 : j + 1]:
            assert m2.accept_token(t)
        np.testing.assert_array_equal(mask[j], fill_row(m2, smollm2.words, smollm2.size))
    other = (
        xgr.GrammarMatcher(compiled)
        if matcher_kind == "protocol"
        else ProtocolMatcher(fresh, vocab_size=smollm2.size)
    )
    again = ps.build_host_bitmask([other], ps.GrammarTree.from_linear_chain(dt), smollm2.size)
    np.testing.assert_array_equal(mask, again)


def test_wide_tree_1000_children(smollm2, person_tokens):
    compiled = smollm2.grammars["json_schema"]
    nodes = 1001
    nt = np.full(nodes, -1)
    nt[0] = 1
    ns = np.full(nodes, -1)
    ns[1:-1] = np.arange(2, nodes)
    rng = np.random.default_rng(0)
    dt = rng.integers(0, smollm2.size, nodes)
    dt[::7] = person_tokens[0]
    requests = [Request(compiled)]
    mask = ps.build_host_bitmask(
        [requests[0].fresh()], ps.GrammarTree.from_host(nt, ns, dt), smollm2.size
    )
    want = expected_rows(
        requests[0].fresh, nt.tolist(), ns.tolist(), dt.tolist(), smollm2.size, smollm2.words
    )
    np.testing.assert_array_equal(mask, want)


@pytest.mark.parametrize("fail_in", ["accept", "fill"])
@pytest.mark.parametrize("at_call", [1, 3])
@pytest.mark.parametrize("parallel", [False, True])
def test_matcher_failure_mid_walk(smollm2, person_tokens, monkeypatch, fail_in, at_call, parallel):
    """A matcher raising inside accept/fill: MatcherError names the request, every matcher is
    restored (the failing one included), and the next build works."""
    monkeypatch.setattr(routes, "POOL_WORK", 0 if parallel else 10**18)
    compiled = smollm2.grammars["json_schema"]
    chain = [0, *person_tokens[:8]]
    dt = np.array([chain] * 4)
    tree = ps.GrammarTree.from_linear_chain(dt)
    plain = [xgr.GrammarMatcher(compiled) for _ in range(3)]
    failing = FailingMatcher(xgr.GrammarMatcher(compiled), fail_in=fail_in, at_call=at_call)
    matchers = [plain[0], ProtocolMatcher(plain[1], vocab_size=smollm2.size), failing, plain[2]]
    before = [matcher_state(m, [0, 1], smollm2.words) for m in (*plain, failing.inner)]
    with pytest.raises(ps.MatcherError) as info:
        ps.build_host_bitmask(matchers, tree, smollm2.size)
    assert info.value.request_index == 2
    assert "grammars[2] raised RuntimeError: injected failure" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert failing.depth == 0 and matchers[1].depth == 0
    assert [matcher_state(m, [0, 1], smollm2.words) for m in (*plain, failing.inner)] == before
    failing.fail_in = "nothing"
    mask = ps.build_host_bitmask(matchers, tree, smollm2.size)
    requests = [Request(compiled)] * 4
    np.testing.assert_array_equal(
        mask, expected_mask(requests, *tree.resolve(), smollm2.size, smollm2.words)
    )


def test_out_reused_across_steps(smollm2, person_tokens):
    """The same out= buffer for different trees: every row is rewritten each time."""
    compiled = smollm2.grammars["json_schema"]
    out = np.empty((2 * 5, smollm2.words), np.int32)
    rng = np.random.default_rng(1)
    for step in range(6):
        dt = np.array([[0, *person_tokens[step : step + 4]], rng.integers(-5, smollm2.size, 5)])
        dt[:, 0] = 0
        requests = [Request(compiled, person_tokens[:step]), Request(compiled)]
        tree = ps.GrammarTree.from_linear_chain(dt)
        mask = ps.build_host_bitmask([r.fresh() for r in requests], tree, smollm2.size, out=out)
        assert mask is out
        np.testing.assert_array_equal(
            out, expected_mask(requests, *tree.resolve(), smollm2.size, smollm2.words)
        )


def test_realistic_batch_large_path(smollm2):
    """An EAGLE-like batch big enough for the vectorized validator and the thread pool, with
    drafts that mostly follow the grammar, against the oracle."""
    from _cases import allowed_tokens

    rng = np.random.default_rng(5)
    kinds = ["json_schema", "ebnf", "regex", "builtin_json"]
    batch, nodes = 12, 32
    nt = np.full((batch, nodes), -1)
    ns = np.full((batch, nodes), -1)
    dt = np.zeros((batch, nodes), dtype=np.int64)
    requests = []
    for b in range(batch):
        request = Request(smollm2.grammars[kinds[b % 4]])
        requests.append(request)
        states = {0: request.fresh()}
        frontier, j = [0], 1
        while j < nodes and frontier:
            nxt = []
            for p in frontier:
                st = states.get(p)
                options = (
                    allowed_tokens(st, smollm2.words, smollm2.size)
                    if st is not None and not st.is_terminated()
                    else np.array([], int)
                )
                prev = -1
                for _ in range(int(rng.integers(1, 4))):
                    if j >= nodes:
                        break
                    if len(options) and rng.random() < 0.85:
                        t = int(rng.choice(options))
                    else:
                        t = int(rng.integers(0, smollm2.size))
                    dt[b, j] = t
                    if prev == -1:
                        nt[b, p] = j
                    else:
                        ns[b, prev] = j
                    prev = j
                    if st is not None and not st.is_terminated():
                        f = st.fork()
                        if f.accept_token(t):
                            states[j] = f
                    nxt.append(j)
                    j += 1
            frontier = nxt
    matchers = [r.fresh() for r in requests]
    mask = ps.build_host_bitmask(matchers, ps.GrammarTree.from_host(nt, ns, dt), smollm2.size)
    want = expected_mask(requests, nt, ns, dt, smollm2.size, smollm2.words)
    np.testing.assert_array_equal(mask, want)
    assert (want != -1).any(axis=1).mean() > 0.3  # the drafts really follow the grammar
