"""build_chain_bitmask: chain masks straight from an engine's per-request draft lists.

Rows and valid flags are checked against the per-node replay on fresh matchers (the reasoning
rule's replay for requests still reasoning), packed and strided, with unconstrained,
terminated and reasoning requests in the batch; the compiled path is shown taken; inputs it
does not read itself give the same rows through the general build; malformed inputs are
refused before any matcher moves.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from _oracle import Request, expected_node_counts, expected_reasoning_mask, matcher_state
from test_xgrammar_ffi import _random_chain, _terminated_request

import portable_spec as ps
import portable_spec.builder.routes as routes
import portable_spec.native as native_module
from portable_spec.engines.xgrammar import chain_facts
from portable_spec.stats import (
    get_slow_grammar_threshold,
    reset_grammar_stats,
    set_slow_grammar_threshold,
)

END = 1  # stands for </think>: a token the sample JSON grammar never takes first


def _case(rng, vocab, batch, k):
    """(requests, matchers, drafts, active): live, terminated, unconstrained and reasoning
    requests; reasoning drafts are free text, the end token, then the grammar's drafts."""
    requests, drafts, active = [], [], []
    for _ in range(batch):
        roll = rng.random()
        if roll < 0.25:  # still reasoning: the matcher at the grammar's start
            request, tail = _random_chain(rng, vocab, k)
            request = Request(request.compiled)
            cut = rng.randrange(0, k + 1)
            head = [rng.randrange(END + 1, vocab.size) for _ in range(cut)]
            if rng.random() < 0.6:
                head.append(END)
            row = (head + tail)[: rng.randrange(0, k + 1)]
            if rng.random() < 0.1 and row:
                row[-1] = vocab.size + 7  # out of the vocabulary while reasoning
            requests.append(request)
            drafts.append(row)
            active.append(True)
            continue
        request, row = _random_chain(rng, vocab, rng.randrange(0, k + 1))
        if roll < 0.35:
            request = _terminated_request(vocab)
        requests.append(None if roll > 0.92 else request)
        drafts.append(row)
        active.append(False)
    matchers = [None if r is None else r.native() for r in requests]
    return requests, matchers, drafts, active


def _expected(requests, drafts, active, vocab, rows_per_request):
    """Rows and flags by replay: each request's chain padded with -1 to its rows."""
    blocks, flags = [], []
    for b, (request, row) in enumerate(zip(requests, drafts, strict=True)):
        width = rows_per_request or len(row) + 1
        tokens = np.array([[0, *row, *[-1] * (width - 1 - len(row))]], dtype=np.int64)
        links = np.array([[*range(1, width), -1]], dtype=np.int64)
        mask, valid = expected_reasoning_mask(
            [request], links, np.full_like(links, -1), tokens, vocab.size, vocab.words,
            [active[b]], {END}, set(), with_valid=True,
        )  # fmt: skip
        blocks.append(mask)
        flags.append(valid.reshape(-1))
    return np.concatenate(blocks), np.concatenate(flags)


def _probe(matchers, vocab):
    """The library's first look at the matchers (the compiled path reads what it learnt)."""
    live = [m for m in matchers if m is not None]
    if live:
        zeros = np.zeros((len(live), 1), dtype=np.int64)
        ps.build_host_bitmask(live, ps.GrammarTree.from_linear_chain(zeros), vocab.size)


@pytest.fixture
def direct_calls(monkeypatch):
    """Whether the route table's ``chain lists`` row (one compiled call) answered, per call
    (build_chain_bitmask calls the row's build, ``routes._lists``, directly)."""
    taken = []
    lists = routes._lists

    def spying(*args):
        done = lists(*args)
        taken.append(done is not None)
        return done

    monkeypatch.setattr(routes, "_lists", spying)
    return taken


@pytest.mark.parametrize("rows_per_request", [None, 5, 8])
@pytest.mark.parametrize("reasoning", [False, True])
def test_rows_match_the_replay(smollm2, direct_calls, rows_per_request, reasoning):
    """Rows and valid flags equal the replay's; every matcher ends where it started; the
    compiled helper answered whenever it is built and bound."""
    rng = random.Random(hash((rows_per_request, reasoning)) & 0xFFFF)
    probes = list(range(0, smollm2.size, 997))
    for _ in range(5):
        requests, matchers, drafts, active = _case(rng, smollm2, rng.randrange(1, 10), 4)
        if not reasoning:
            active = [False] * len(active)
        if all(m is None for m in matchers):
            continue
        _probe(matchers, smollm2)
        before = [None if m is None else matcher_state(m, probes, smollm2.words) for m in matchers]
        rule = ps.Reasoning(active, END) if reasoning else None
        mask, valid = ps.build_chain_bitmask(
            matchers, drafts, smollm2.size, rows_per_request=rows_per_request, reasoning=rule,
            return_valid=True,
        )  # fmt: skip
        want_mask, want_valid = _expected(requests, drafts, active, smollm2, rows_per_request)
        np.testing.assert_array_equal(mask, want_mask)
        assert valid.reshape(-1).tolist() == want_valid.tolist()
        if rows_per_request is not None:
            assert valid.shape == (len(drafts), rows_per_request)
        after = [None if m is None else matcher_state(m, probes, smollm2.words) for m in matchers]
        assert after == before
    if native_module.walks_xgrammar():
        assert direct_calls and all(direct_calls)


def test_parts_on_the_pool_match_the_replay(smollm2, direct_calls, monkeypatch):
    """A batch large enough to be walked in parts on the pool: the same rows."""
    monkeypatch.setattr(routes, "ONE_THREAD_WORK", 1)
    ps.set_num_threads(2)
    rng = random.Random(5)
    requests, matchers, drafts, active = _case(rng, smollm2, 24, 3)
    _probe(matchers, smollm2)
    mask, valid = ps.build_chain_bitmask(
        matchers, drafts, smollm2.size, reasoning=ps.Reasoning(active, [END]), return_valid=True
    )
    want_mask, want_valid = _expected(requests, drafts, active, smollm2, None)
    np.testing.assert_array_equal(mask, want_mask)
    assert valid.tolist() == want_valid.tolist()
    if native_module.walks_xgrammar():
        assert direct_calls == [True]


def test_inputs_the_compiled_path_declines_build_the_same_rows(smollm2, direct_calls):
    """Per-request arrays and tuples (read by the compiled path), numpy scalars in the lists
    and a content end token (the general build): the replay's rows every time."""
    rng = random.Random(8)
    requests, matchers, drafts, _ = _case(rng, smollm2, 6, 3)
    _probe(matchers, smollm2)
    active = [False] * len(drafts)
    want_mask, want_valid = _expected(requests, drafts, active, smollm2, 4)
    forms = [
        [np.array(row, dtype=np.int64) for row in drafts],
        tuple(tuple(row) for row in drafts),
        [[np.int32(t) if t >= 0 else t for t in row] for row in drafts],
    ]
    for form in forms:
        mask, valid = ps.build_chain_bitmask(
            matchers, form, smollm2.size, rows_per_request=4, return_valid=True
        )
        np.testing.assert_array_equal(mask, want_mask)
        assert valid.reshape(-1).tolist() == want_valid.tolist()
    content = ps.Reasoning(active, [END], content_end_token_ids=[2])
    mask = ps.build_chain_bitmask(matchers, drafts, smollm2.size, rows_per_request=4,
                                  reasoning=content)  # fmt: skip
    np.testing.assert_array_equal(mask, want_mask)
    if native_module.walks_xgrammar():  # arrays and tuples read, the rest not
        assert direct_calls == [True, True, False, False]


def test_out_is_written_in_place(smollm2):
    rng = random.Random(2)
    requests, _, drafts, _ = _case(rng, smollm2, 4, 3)
    plain = Request(smollm2.grammars["json_schema"])
    requests = [plain if r is None else r for r in requests]  # every request constrained
    matchers = [r.native() for r in requests]
    _probe(matchers, smollm2)
    rows = sum(len(d) + 1 for d in drafts)
    out = np.zeros((rows, smollm2.words), dtype=np.int32)
    mask = ps.build_chain_bitmask(matchers, drafts, smollm2.size, out=out)
    assert mask is out
    np.testing.assert_array_equal(out, _expected(requests, drafts, [False] * 4, smollm2, None)[0])


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"drafts": [[1, 2.5]]}, TypeError, "drafts[0]"),
        ({"drafts": [[1], "ab"]}, TypeError, "drafts[1]"),
        ({"drafts": [[True, 3]]}, TypeError, "drafts[0]"),
        ({"drafts": [[1, [2]]]}, TypeError, "drafts[0]"),
        ({"drafts": [[1, 2**70]]}, TypeError, "drafts[0]"),
        ({"drafts": 7}, TypeError, "drafts"),
        ({"drafts": [[1, 2, 3, 4]], "rows_per_request": 4}, ValueError, "rows_per_request=4"),
        ({"rows_per_request": 0}, ValueError, "rows_per_request"),
        ({"rows_per_request": True}, ValueError, "rows_per_request"),
        ({"out": np.zeros((3, 2), dtype=np.int32)}, ValueError, "out"),
        ({"reasoning": ps.Reasoning([True], [True])}, TypeError, "end_token_ids"),
        ({"reasoning": ps.Reasoning([True], [10**9])}, ValueError, "end_token_ids"),
        ({"reasoning": ps.Reasoning([True, False], [END])}, ValueError, "batch"),
        ({"vocab_size": 0}, ValueError, "vocab_size"),
        # no tree is passed: the count of chains is named by the argument that holds them
        ({"drafts": [[107], [18]]}, ValueError, "len(matchers) = 1 but drafts holds 2"),
        ({"drafts": [[107], [18]], "rows_per_request": 3}, ValueError, "drafts holds 2"),
    ],
)
def test_bad_input_is_refused_before_any_matcher_moves(smollm2, kwargs, error, words):
    matcher = xgr_matcher(smollm2)
    _probe([matcher], smollm2)
    probes = list(range(0, smollm2.size, 991))
    before = matcher_state(matcher, probes, smollm2.words)
    call = {"drafts": [[5, 6]], "vocab_size": smollm2.size, **kwargs}
    with pytest.raises(error) as raised:
        ps.build_chain_bitmask([matcher], call.pop("drafts"), call.pop("vocab_size"), **call)
    assert words in str(raised.value)
    assert matcher_state(matcher, probes, smollm2.words) == before


def test_a_batch_with_no_grammar_returns_none(smollm2):
    mask, valid = ps.build_chain_bitmask([None, None], [[3], []], smollm2.size, return_valid=True)
    assert mask is None
    assert valid.tolist() == [True, True, True]


def _chain_arrays(drafts, width):
    """(next_token, next_sibling, draft) of the chains, ``width`` nodes each, the nodes past a
    request's drafts unreachable."""
    batch = len(drafts)
    next_token = np.full((batch, width), -1, dtype=np.int64)
    draft = np.full((batch, width), -1, dtype=np.int64)
    for b, row in enumerate(drafts):
        next_token[b, : len(row)] = np.arange(1, len(row) + 1)
        draft[b, : len(row) + 1] = [0, *row]
    return next_token, np.full_like(next_token, -1), draft


@pytest.mark.parametrize("rows_per_request", [None, 6])
def test_counters_match_the_replay(smollm2, direct_calls, rows_per_request):
    """grammar_stats after compiled calls: builds, rows and requests as given, checked and
    refused draft nodes as the replay counts them; the counters add up over calls and reset
    to zero."""
    rng = random.Random(11 + (rows_per_request or 0))
    counted = ("builds", "rows", "requests", "checked_nodes", "rejected_nodes")
    reset_grammar_stats()
    for _ in range(4):
        requests, matchers, drafts, _ = _case(rng, smollm2, rng.randrange(2, 9), 5)
        if all(m is None for m in matchers):
            continue
        _probe(matchers, smollm2)
        reset_grammar_stats()  # the probe's own build is not counted below
        for name in counted:
            assert ps.grammar_stats()[name] == 0, name
        mask = ps.build_chain_bitmask(
            matchers, drafts, smollm2.size, rows_per_request=rows_per_request
        )
        checked, rejected = expected_node_counts(
            requests, *_chain_arrays(drafts, 6), smollm2.size, smollm2.words
        )
        stats = ps.grammar_stats()
        assert stats["builds"] == 1
        assert stats["rows"] == len(mask)
        assert stats["requests"] == sum(m is not None for m in matchers)
        assert (stats["checked_nodes"], stats["rejected_nodes"]) == (checked, rejected)
        assert 0 < stats["slowest_seconds"] <= stats["build_seconds"] <= stats["walk_seconds"]
        ps.build_chain_bitmask(matchers, drafts, smollm2.size, rows_per_request=rows_per_request)
        again = ps.grammar_stats()
        assert again["builds"] == 2 and again["rows"] == 2 * len(mask)
        assert (again["checked_nodes"], again["rejected_nodes"]) == (2 * checked, 2 * rejected)
    if native_module.walks_xgrammar():
        assert direct_calls and all(direct_calls)


def test_slow_walks_are_counted_and_logged(smollm2, direct_calls, caplog):
    """Every constrained request's walk over the threshold is logged with its index and
    counted, through the compiled path as through the general one."""
    rng = random.Random(4)
    _, matchers, drafts, _ = _case(rng, smollm2, 6, 3)
    matchers[2] = xgr_matcher(smollm2)
    _probe(matchers, smollm2)
    constrained = [b for b, m in enumerate(matchers) if m is not None]
    threshold = get_slow_grammar_threshold()
    set_slow_grammar_threshold(1e-12)
    reset_grammar_stats()
    try:
        with caplog.at_level("WARNING", logger="portable_spec"):
            ps.build_chain_bitmask(matchers, drafts, smollm2.size, rows_per_request=4)
    finally:
        set_slow_grammar_threshold(threshold)
    logged = [r.getMessage() for r in caplog.records if "to walk its draft tree" in r.message]
    assert [int(m.split()[3]) for m in logged] == constrained
    stats = ps.grammar_stats()
    assert stats["slow_requests"] == len(constrained)
    assert stats["last_slow_request"] == constrained[-1]
    if native_module.walks_xgrammar():
        assert direct_calls == [True]


def test_matchers_enter_the_facts_table_when_probed_and_leave_with_them(smollm2, direct_calls):
    """A matcher the library never saw is probed by the general build first (the compiled
    call declines it); its facts then serve the compiled call until the matcher dies."""
    import gc

    matcher = xgr_matcher(smollm2)
    key = id(matcher)
    assert key not in chain_facts
    first = ps.build_chain_bitmask([matcher], [[5, 6]], smollm2.size)
    second = ps.build_chain_bitmask([matcher], [[5, 6]], smollm2.size)
    np.testing.assert_array_equal(first, second)
    if not native_module.walks_xgrammar():
        return
    assert direct_calls == [False, True]
    ref, handle, words, vocab_size, stops = chain_facts[key]
    assert ref() is matcher and handle and not stops.flags.writeable
    assert (words, vocab_size) == (smollm2.words, 32 * smollm2.words)
    other = xgr_matcher(smollm2)
    _probe([other], smollm2)
    assert chain_facts[id(other)][4] is stops  # one array per stop set
    del matcher, ref
    gc.collect()
    assert key not in chain_facts or chain_facts[key][0]() is not None


def test_a_matcher_listed_twice_is_refused(smollm2):
    matcher = xgr_matcher(smollm2)
    _probe([matcher], smollm2)
    with pytest.raises(ValueError, match="twice|same matcher|more than once"):
        ps.build_chain_bitmask([matcher, matcher], [[5], [6]], smollm2.size)


def xgr_matcher(vocab):
    import xgrammar as xgr

    return xgr.GrammarMatcher(vocab.grammars["json_schema"])
