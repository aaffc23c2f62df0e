"""Small verify trees of probed xgrammar matchers (and unconstrained requests) in one compiled
call (``tree_masks``).

Property, against the per-node replay on fresh matchers: for any batch of ``from_host`` trees
(random shapes, sibling orders, padding nodes, terminated matchers, off-grammar, EOS and
out-of-range drafts), any array flavour, vocabulary size, output buffer and corrupted links,
a build either raises ``ValueError``/``TypeError`` with every matcher where it was, or gives
the replay's rows, valid flags and node counts, with every matcher back in its state. The
compiled call must take exactly the batches it is meant for (every request unconstrained or
a matcher the library has probed, at least one, C-contiguous int64 arrays, valid links, the matchers' width, an output
that fits) and decline the others, which then take the general path.
"""

from __future__ import annotations

import numpy as np
import pytest
from _cases import draw_case
from _oracle import expected_mask, expected_node_counts, expected_valid, matcher_state
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import portable_spec as ps
from portable_spec import native as native_module
from portable_spec.engines.xgrammar import chain_facts
from portable_spec.stats import (
    get_slow_grammar_threshold,
    reset_grammar_stats,
    set_slow_grammar_threshold,
)

native = native_module.native
pytestmark = pytest.mark.skipif(
    native is None or not hasattr(native, "tree_masks"),
    reason="portable_spec._native (with tree_masks) is not built here",
)

FLAVOURS = ["int64", "readonly", "int32", "strided", "fortran"]


def _flavour(kind: str, array: np.ndarray) -> np.ndarray:
    if kind == "int64":
        return np.ascontiguousarray(array, dtype=np.int64)
    if kind == "readonly":
        out = np.array(array, dtype=np.int64)
        out.flags.writeable = False
        return out
    if kind == "int32":
        return array.astype(np.int32)
    if kind == "strided":
        wide = np.zeros((array.shape[0], array.shape[1] * 2), dtype=np.int64)
        wide[:, ::2] = array
        return wide[:, ::2]
    return np.asfortranarray(array.astype(np.int64))


def _probe(matcher, vocab_size: int) -> None:
    """The library's first look at a matcher (the general path learns its facts)."""
    ps.build_host_bitmask([matcher], ps.GrammarTree.from_linear_chain(np.zeros((1, 1), np.int64)),
                          vocab_size)  # fmt: skip


def _links_valid(nt: np.ndarray, ns: np.ndarray) -> bool:
    """An independent check of the link rules: in range, nothing into the root, at most one
    link into a node, no cycle."""
    batch, nodes = nt.shape
    for b in range(batch):
        if ns[b, 0] != -1:
            return False
        parent = [-1] * nodes
        for links in (nt[b].tolist(), ns[b].tolist()):
            for u, v in enumerate(links):
                if not -1 <= v < nodes or v == 0:
                    return False
                if v != -1:
                    if parent[v] != -1:
                        return False
                    parent[v] = u
        for start in range(nodes):
            v, steps = start, 0
            while parent[v] != -1:
                v, steps = parent[v], steps + 1
                if steps > nodes:
                    return False
    return True


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_small_trees_match_the_replay(smollm2, data):
    """Rows, valid flags, node counts and build counters as the replay says; the compiled call
    takes exactly the batches it is for; malformed input refused with no matcher moved."""
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone after each example
        case = draw_case(data, smollm2, max_batch=4, max_nodes=20, protocol=False)
        requests, matchers = list(case.requests), list(case.matchers)
        nt, ns, dt = case.next_token.copy(), case.next_sibling.copy(), case.draft.copy()
        batch, nodes = nt.shape
        # half the examples are the common engine call (the one the compiled path is for, some
        # requests unconstrained), the others anything: unprobed matchers, other dtypes or sizes;
        # links corrupted in both
        common = data.draw(st.booleans(), label="common call?")
        live = [m for m in matchers if m is not None]
        assume(live)  # with no grammar there is nothing to build (see the builder's own tests)
        sizes = (
            [smollm2.size]
            if common
            else [smollm2.size] * 3 + [smollm2.size - 1, smollm2.size + 37, 64]
        )
        vocab_size = data.draw(st.sampled_from(sizes), label="vocab_size")
        for m in matchers:
            if m is not None and (common or data.draw(st.integers(0, 9), label="unprobed?") > 0):
                _probe(m, smollm2.size)
        if data.draw(st.integers(0, 3), label="corrupt links?") == 0:
            b, j = data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, nodes - 1))
            target = nt if data.draw(st.booleans()) else ns
            target[b, j] = data.draw(st.sampled_from([-2, 0, j, nodes, 2**40]), label="bad link")
        flavours = ["int64", "readonly"] if common else FLAVOURS
        kinds = [data.draw(st.sampled_from(flavours), label=n) for n in ("nt", "ns", "dt")]
        arrays = [_flavour(k, a) for k, a in zip(kinds, (nt, ns, dt), strict=True)]
        words = -(-vocab_size // 32)
        outs = ["none", "fits"] if common else ["none", "fits", "wrong"]
        out_kind = data.draw(st.sampled_from(outs), label="out")
        out = None
        if out_kind != "none":
            out = np.full((batch * nodes + (out_kind == "wrong"), words), 7, dtype=np.int32)
        return_valid = data.draw(st.booleans(), label="return_valid")
        set_slow_grammar_threshold(1e-12 if data.draw(st.booleans(), label="slow?") else None)

        taken = []
        walk = native_module.tree_masks

        def spy(*args):
            done = walk(*args)
            taken.append(done is not None)
            return done

        monkeypatch.setattr(native_module, "tree_masks", spy)
        probes = [smollm2.eos, 0, 1, 100, 4095]
        before = [None if m is None else matcher_state(m, probes, smollm2.words) for m in matchers]
        links_ok = _links_valid(nt, ns)
        valid_input = words >= smollm2.words and links_ok and out_kind != "wrong"
        probed = all(m is None or _known(m) for m in matchers)  # before the build probes any
        reset_grammar_stats()
        try:
            tree = ps.GrammarTree.from_host(*arrays)
            if not valid_input:
                with pytest.raises((ValueError, TypeError)):
                    ps.build_host_bitmask(
                        matchers, tree, vocab_size, out=out, return_valid=return_valid
                    )
                assert not any(taken)
            else:
                result = ps.build_host_bitmask(
                    matchers, tree, vocab_size, out=out, return_valid=return_valid
                )
                mask, valid = result if return_valid else (result, None)
                want = expected_mask(requests, nt, ns, dt, vocab_size, smollm2.words)
                np.testing.assert_array_equal(mask, want)
                assert out is None or mask is out
                if return_valid:
                    want_valid = expected_valid(requests, nt, ns, dt, vocab_size, smollm2.words)
                    np.testing.assert_array_equal(valid, want_valid)
                stats = ps.grammar_stats()
                counts = expected_node_counts(requests, nt, ns, dt, vocab_size, smollm2.words)
                assert (stats["checked_nodes"], stats["rejected_nodes"]) == counts
                assert (stats["builds"], stats["rows"]) == (1, batch * nodes)
                assert stats["requests"] == len(live)
                # the compiled call takes the batch exactly when it is meant for it
                meant = (
                    probed
                    and all(a.dtype == np.int64 and a.flags.c_contiguous for a in arrays)
                    and words == smollm2.words
                )
                assert any(taken) == meant
                event(f"one compiled call: {meant}")
                if meant:
                    want_slow = len(live) if get_slow_grammar_threshold() else 0
                    assert stats["slow_requests"] == want_slow
        finally:
            set_slow_grammar_threshold(None)
        after = [None if m is None else matcher_state(m, probes, smollm2.words) for m in matchers]
        assert after == before


def _known(matcher) -> bool:
    """Whether the library has learnt this matcher's facts (independently of the build: the
    facts table is keyed by the object's id and holds a weak reference to it)."""
    entry = chain_facts.get(id(matcher))
    return entry is not None and entry[0]() is matcher
