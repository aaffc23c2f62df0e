"""The three compiled walks of llguidance matchers, each forced and spied, against the per-node
replay oracle on SmolLM2's vocabulary: the small build in one call (``llguidance_masks``), a
general dense build's batch walk (``llguidance_walks``) and the per-request walk
(``llguidance_walk``, the compact layout's); rows, valid flags, node counts, every matcher
restored. The Python walk they replace: tests/test_engines.py with ``builder_mode=python``."""

from __future__ import annotations

import numpy as np
import pytest
from _cases import draw_case
from _oracle import assert_mask_matches, expected_node_counts, expected_valid
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

llguidance = pytest.importorskip("llguidance")

from _engines import engine_factory, matcher_prints  # noqa: E402

import portable_spec as ps  # noqa: E402
from portable_spec import native as compiled  # noqa: E402
from portable_spec.builder import dense, small_llguidance  # noqa: E402
from portable_spec.stats import reset_grammar_stats  # noqa: E402

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROBE = [0, 1, 2, 100, 1000, 18, 107]
ENTRIES = {
    "small": "llguidance_masks",  # the small build in one compiled call
    "small_python": "llguidance_walks",  # the small build's Python lines (packed chains, ...)
    "batch": "llguidance_walks",
    "single": "llguidance_walk",
}


def _spy(monkeypatch, name):
    calls = []
    function = getattr(compiled, name)

    def spy(*args):  # True: the entry took the call (returned something, or raised)
        try:
            result = function(*args)
        except Exception:
            calls.append(True)
            raise
        calls.append(result is not None)
        return result

    monkeypatch.setattr(compiled, name, spy)
    return calls


@pytest.mark.parametrize("shape", ["tree", "chain"])
@pytest.mark.parametrize("path", ["small", "small_python", "batch", "single"])
@SETTINGS
@given(data=st.data())
def test_compiled_walks_match_oracle(smollm2, path, shape, data):
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone after each example
        if compiled.native is None:
            pytest.skip("the compiled helper is not built")
        make, kinds = engine_factory(smollm2, ("llguidance",))
        case = draw_case(data, smollm2, kinds=kinds, make_request=make, protocol=False)
        if shape == "chain":  # the same requests on chains: node i's only child i + 1
            nodes = case.draft.shape[1]
            case.next_token[:] = np.arange(1, nodes + 1)
            case.next_token[:, -1] = -1
            case.next_sibling[:] = -1
            tree = ps.GrammarTree.from_linear_chain(case.draft)
        else:
            tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
        if path in ("batch", "single"):  # the general build
            monkeypatch.setattr(small_llguidance, "in_place", lambda *args: None)
        if path == "single":  # each request in a job of its own
            monkeypatch.setattr(dense._DenseRows, "llguidance_walks", lambda *args: None)
        if path == "small_python":  # as for arrays the compiled call does not read in place
            monkeypatch.setattr(compiled, "llguidance_masks", lambda *args: None)
        before = matcher_prints(case.matchers, smollm2.words, PROBE)
        ps.build_host_bitmask(case.matchers, tree, case.vocab_size)  # probes each matcher once
        calls = _spy(monkeypatch, ENTRIES[path])
        reset_grammar_stats()
        mask, valid = ps.build_host_bitmask(case.matchers, tree, case.vocab_size, return_valid=True)
        constrained = [m for m in case.matchers if m is not None]
        padded = (case.vocab_size + 31) // 32 != smollm2.words  # rows wider than the matchers
        taken = len(constrained) == len(case.matchers) and not padded  # the small build's case
        if path == "small":
            assert calls == [True] if taken else True not in calls
        elif (path == "small_python" and taken) or (path == "batch" and constrained and not padded):
            assert calls == [True]
        elif path == "single":
            assert len(calls) == len(constrained) and all(calls)
        assert_mask_matches(case, smollm2.words, mask)
        arrays = (case.next_token, case.next_sibling, case.draft)
        want = expected_valid(case.requests, *arrays, case.vocab_size, smollm2.words)
        np.testing.assert_array_equal(valid, want)
        if mask is not None:
            stats = ps.grammar_stats()
            counts = expected_node_counts(case.requests, *arrays, case.vocab_size, smollm2.words)
            assert (stats["checked_nodes"], stats["rejected_nodes"]) == counts
        assert matcher_prints(case.matchers, smollm2.words, PROBE) == before


@pytest.mark.parametrize("path", ["small", "batch", "single"])
def test_an_error_inside_llguidance_is_named(smollm2, path, monkeypatch):
    """llguidance raising inside a compiled walk (here: its matchers told a width one word
    wider than theirs, so it refuses the row buffer) is a MatcherError naming the request,
    with llguidance's exception chained; every matcher is back in its state."""
    from portable_spec import testing as ge
    from portable_spec.engines import llguidance as engine

    if compiled.native is None:
        pytest.skip("the compiled helper is not built")
    wider = smollm2.words + 1
    matchers = [ge.llguidance_matcher("json_schema") for _ in range(3)]
    draft = np.array([[0, 108, 18]] * 3, dtype=np.int64)
    ps.build_host_bitmask(matchers, ps.GrammarTree.from_linear_chain(draft), 32 * smollm2.words)
    for m in matchers:
        engine._cache.put(m, engine.MatcherInfo(words=wider, vocab_size=32 * wider))
    if path != "small":
        monkeypatch.setattr(small_llguidance, "in_place", lambda *args: None)
    if path == "single":
        monkeypatch.setattr(dense._DenseRows, "llguidance_walks", lambda *args: None)
    calls = _spy(monkeypatch, ENTRIES[path])
    before = matcher_prints(matchers, smollm2.words, PROBE)
    with pytest.raises(ps.MatcherError) as info:
        ps.build_host_bitmask(matchers, ps.GrammarTree.from_linear_chain(draft), 32 * wider)
    assert info.value.request_index == 0 and isinstance(info.value.__cause__, ValueError)
    assert calls and calls[0]
    assert matcher_prints(matchers, smollm2.words, PROBE) == before
