"""Property: for any input, either a ValueError/TypeError before any matcher moved, or the
oracle's bits, and every matcher back in its starting state.

Inputs mix valid trees (from ``draw_case``) with corrupted ones (out-of-range links, two
parents, self-loops, links to the root, cycles through siblings), token ids over the whole
int32 range, vocab sizes around the tokenizer's (and non-integers), mixed None / xgrammar /
protocol / terminated matchers, and every array flavour: numpy int16/int32/int64 (strided,
Fortran-ordered, read-only), lists, torch CPU (non-contiguous) and JAX int32.

``PORTABLE_SPEC_FUZZ_EXAMPLES=5000 scripts/test.sh tests/test_fuzz.py`` runs the long version.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _cases import draw_case
from _oracle import ProtocolMatcher, expected_mask, matcher_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_spec as ps

EXAMPLES = int(os.environ.get("PORTABLE_SPEC_FUZZ_EXAMPLES", "60"))
FLAVOURS = ["int64", "int32", "int16", "strided", "fortran", "readonly", "list", "torch", "jax"]


def links_are_valid(nt: np.ndarray, ns: np.ndarray) -> bool:
    """An independent, slow check of the link rules."""
    batch, nodes = nt.shape
    for b in range(batch):
        pred = [-1] * nodes
        for links in (nt[b], ns[b]):
            for u, v in enumerate(links.tolist()):
                if not -1 <= v < nodes or v == 0:
                    return False
                if v != -1:
                    if pred[v] != -1:
                        return False
                    pred[v] = u
        if ns[b, 0] != -1:
            return False
        for start in range(nodes):
            v, steps = start, 0
            while pred[v] != -1:
                v = pred[v]
                steps += 1
                if steps > nodes:
                    return False  # a cycle
    return True


def flavour(data, array: np.ndarray, name: str):
    kind = data.draw(st.sampled_from(FLAVOURS), label=f"{name} flavour")
    fits16 = array.size == 0 or (array.min() >= -(2**15) and array.max() < 2**15)
    if kind == "int16" and not fits16:
        kind = "int64"
    if kind == "int64":
        return array.astype(np.int64)
    if kind == "int32":
        return array.astype(np.int32)
    if kind == "int16":
        return array.astype(np.int16)
    if kind == "strided":
        wide = np.zeros((array.shape[0], array.shape[1] * 2), dtype=np.int64)
        wide[:, ::2] = array
        return wide[:, ::2]
    if kind == "fortran":
        return np.asfortranarray(array.astype(np.int32))
    if kind == "readonly":
        out = array.astype(np.int64)
        out.flags.writeable = False
        return out
    if kind == "list":
        return array.tolist()
    if kind == "torch":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(array.T.astype(np.int64)))
        return t.t()  # non-contiguous
    import jax.numpy as jnp

    return jnp.asarray(array.astype(np.int32))


def corrupt(data, nt: np.ndarray, ns: np.ndarray) -> None:
    batch, nodes = nt.shape
    for _ in range(data.draw(st.integers(1, 3), label="corruptions")):
        b = data.draw(st.integers(0, batch - 1))
        j = data.draw(st.integers(0, nodes - 1))
        target = nt if data.draw(st.booleans()) else ns
        target[b, j] = data.draw(
            st.sampled_from([-3, -2, 0, j, nodes, nodes + 7, 2**40])
            | st.integers(-1, max(0, nodes - 1)),
            label="bad link",
        )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_property(smollm2, builder_mode, data):
    case = draw_case(data, smollm2, max_batch=3, max_nodes=14)
    nt, ns, dt = case.next_token.copy(), case.next_sibling.copy(), case.draft.copy()
    if data.draw(st.integers(0, 2), label="corrupt links?") == 0:
        corrupt(data, nt, ns)
    if data.draw(st.booleans(), label="wild tokens?"):
        dt[:, :] = np.array(
            data.draw(
                st.lists(st.integers(-(2**31), 2**31 - 1), min_size=dt.size, max_size=dt.size)
            )
        ).reshape(dt.shape)
    vocab_size = data.draw(
        st.sampled_from(
            [
                smollm2.size,
                smollm2.size + 1,
                smollm2.size + 37,
                smollm2.size - 1,
                smollm2.size - 33,
                32,
                0,
                -5,
                1.0 * smollm2.size,
                True,
            ]
        )
        | st.integers(smollm2.size - 40, smollm2.size + 40),
        label="vocab_size",
    )
    matchers = list(case.matchers)
    requests = list(case.requests)
    if data.draw(st.integers(0, 9), label="grammars shape") == 0:
        matchers = matchers[:-1] if len(matchers) > 1 else [*matchers, None]
    if data.draw(st.integers(0, 19), label="bad grammar type?") == 0:
        matchers[0] = "a grammar"

    probe = [smollm2.eos, 0, 1, 100]

    def fingerprint():
        out = []
        for m in case.matchers:
            if m is None:
                out.append(None)
            else:
                inner = m.inner if isinstance(m, ProtocolMatcher) else m
                out.append((matcher_state(inner, probe, smollm2.words), getattr(m, "depth", 0)))
        return out

    before = fingerprint()
    calls_before = [len(m.calls) if isinstance(m, ProtocolMatcher) else 0 for m in case.matchers]
    arrays = [flavour(data, a, n) for a, n in ((nt, "nt"), (ns, "ns"), (dt, "dt"))]

    constrained = any(m is not None for m in matchers)
    ints = isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
    # Documented rule: a protocol matcher's vocab_size is checked exactly; xgrammar does not
    # expose its vocabulary size, only its bitmask width, so those are checked per 32 tokens.
    protocol = any(isinstance(m, ProtocolMatcher) for m in matchers)
    xgrammar = any(m is not None and not isinstance(m, (ProtocolMatcher, str)) for m in matchers)
    big_enough = ints and (
        (not protocol or vocab_size >= smollm2.size)
        and (not xgrammar or -(-vocab_size // 32) >= smollm2.words)
    )
    valid = (
        ints
        and vocab_size > 0
        and len(matchers) == nt.shape[0]
        and not any(isinstance(m, str) for m in matchers)
        and (not constrained or (big_enough and links_are_valid(nt, ns)))
    )
    with_device = data.draw(st.booleans(), label="build_grammar_vocab_mask?")

    def build():
        tree = ps.GrammarTree.from_device(*arrays)
        if with_device:
            mask = ps.build_grammar_vocab_mask(matchers, tree, vocab_size)
            return (
                None
                if mask is None
                else np.asarray(mask.detach() if hasattr(mask, "detach") else mask)
            )
        return ps.build_host_bitmask(matchers, tree, vocab_size)

    if not valid:
        try:
            result = build()
        except (ValueError, TypeError):
            pass
        else:
            # Acceptable only when nothing had to be checked: no constrained request.
            assert result is None and not constrained, "malformed input was accepted"
    else:
        mask = build()
        if mask is None:
            assert not constrained
        else:
            want = expected_mask(requests, nt, ns, dt, vocab_size, smollm2.words)
            bad = np.flatnonzero((mask != want).any(axis=1))
            assert bad.size == 0, f"rows differing from the oracle: {bad.tolist()}"
    assert fingerprint() == before
    if not valid:
        calls_after = [len(m.calls) if isinstance(m, ProtocolMatcher) else 0 for m in case.matchers]
        assert calls_after == calls_before, "a matcher moved before the input was refused"


@pytest.mark.parametrize("flavour_name", ["numpy", "torch", "jax"])
def test_deep_chain_5000(smollm2, flavour_name):
    compiled = smollm2.grammars["builtin_json"]
    import xgrammar as xgr

    tokens = [0, smollm2.tokens.index("[")] + [
        smollm2.tokens.index("1"),
        smollm2.tokens.index(","),
    ] * 2500
    tokens = np.array([tokens[:5000]])
    if flavour_name == "torch":
        import torch

        tokens = torch.from_numpy(tokens).to(torch.int32)
    elif flavour_name == "jax":
        import jax.numpy as jnp

        tokens = jnp.asarray(tokens, dtype=jnp.int32)
    m = xgr.GrammarMatcher(compiled)
    mask = ps.build_grammar_vocab_mask([m], ps.GrammarTree.from_linear_chain(tokens), smollm2.size)
    host = np.asarray(mask)
    assert host.shape == (5000, smollm2.words)
    assert (host != -1).any(axis=1).all()  # every node accepted, every row a grammar row
    assert not m.is_terminated()


def test_wide_root_1000_children_random_tokens(smollm2):
    import xgrammar as xgr

    nodes = 1001
    nt = np.full((1, nodes), -1)
    nt[0, 0] = 1
    ns = np.full((1, nodes), -1)
    ns[0, 1:-1] = np.arange(2, nodes)
    rng = np.random.default_rng(9)
    dt = rng.integers(-(2**31), 2**31, (1, nodes))
    dt[0, 5] = smollm2.tokens.index("{")
    compiled = smollm2.grammars["builtin_json"]
    mask = ps.build_host_bitmask(
        [xgr.GrammarMatcher(compiled)], ps.GrammarTree.from_host(nt, ns, dt), smollm2.size
    )
    filled = (mask != -1).any(axis=1)
    assert filled[0] and filled[5] and filled.sum() == 2
