"""Drafts past an llguidance tokenizer's vocabulary, on every path that hands llguidance a
token.

llguidance takes a token id at or past its tokenizer's vocabulary (inside its mask's last
word, or a padding id of logits wider than the tokenizer, as draft heads propose) for an
error it never leaves: ``try_consume_tokens``, ``validate_tokens`` and the executor's chain
fill alike. Such a draft must be a refused node on every path (trees, chains of every size,
the executor, the compact layout, the Python fallback), every matcher left usable where it
started. The tokenizers here are SmolLM2's with a few ids of no token added
(:func:`portable_spec.testing.llguidance_tokenizer`), so that their vocabularies are not
multiples of 32; every mask is checked against the per-node replay oracle, and the compiled
helper's rows against the Python fallback's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from _cases import draw_case
from _oracle import assert_mask_matches, expected_node_counts, expected_valid
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

llguidance = pytest.importorskip("llguidance")

from _engines import LLRequest, matcher_prints  # noqa: E402

import portable_spec as ps  # noqa: E402
from portable_spec import native as compiled  # noqa: E402
from portable_spec import testing as samples  # noqa: E402
from portable_spec.builder import compact, dense, routes, small_llguidance  # noqa: E402
from portable_spec.engines import llguidance as llguidance_engine  # noqa: E402
from portable_spec.engines.llguidance import probe_llguidance  # noqa: E402
from portable_spec.stats import reset_grammar_stats  # noqa: E402

WORDS = 1537  # the mask of every tokenizer here: 49153..49184 ids
SIZES = (49153, 49157, 49183)
PROBE = [0, 1, 2, 100, 1000, 18, 107]
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _vocab(smollm2, size):
    return SimpleNamespace(size=size, words=WORDS, eos=smollm2.eos)


def _make(smollm2, size):
    tokenizer = samples.llguidance_tokenizer(size)

    def make(kind: str) -> LLRequest:
        grammar = samples.llguidance_grammar(kind.split(":")[1])
        return LLRequest(grammar, tokenizer=tokenizer, eos=smollm2.eos)

    return make, tuple(f"llguidance:{k}" for k in samples.ENGINE_KINDS["llguidance"])


@pytest.mark.parametrize("size", [49152, *SIZES, 49184, 49185])
def test_the_probe_finds_the_tokenizer_vocabulary(size):
    """The probe reads the vocabulary size off forks of the matcher, wherever the matcher is
    (at its start, inside a string, complete), and moves nothing."""
    text = samples.load_tokenizer().encode('{"name": "Al')
    for prefix in ([], text):
        matcher = samples.llguidance_matcher("json_schema", size)
        assert matcher.try_consume_tokens(prefix) == len(prefix)
        words = (size + 31) // 32
        before = matcher_prints([matcher], words, PROBE)
        info = probe_llguidance(matcher, words)
        assert (info.words, info.vocab_size) == (words, size)
        assert not matcher.is_error()
        assert matcher_prints([matcher], words, PROBE) == before
    complete = llguidance.LLMatcher(
        samples.llguidance_tokenizer(size),
        llguidance.LLMatcher.grammar_from_regex("a"),
        log_level=0,
    )
    assert complete.try_consume_tokens(samples.load_tokenizer().encode("a")) == 1
    assert complete.is_stopped()
    assert probe_llguidance(complete, (size + 31) // 32).vocab_size == size


# -- every route, one request set ----------------------------------------------------------------
ROUTES = ("small", "batch", "single", "python", "executor", "compact")


def _executor_spy(monkeypatch) -> list[int]:
    """Count the calls of llguidance's executor fill (dense and compact layouts), so that a
    test forcing it can tell that it ran. The spy wraps the library's own function, never
    what the layouts hold now (a spy set twice replaces the first, it does not wrap it)."""
    calls: list[int] = []
    real = llguidance_engine.fill_llguidance_chains

    def spy(*args, **kwargs):
        calls.append(len(args[0]))  # the group: request -> matcher
        return real(*args, **kwargs)

    for module in (dense, compact):
        monkeypatch.setattr(module, "fill_llguidance_chains", spy)
    return calls


def _route(route, monkeypatch) -> list[int]:
    """Force the build of a small batch of llguidance requests onto ``route``; returns the
    executor spy's calls."""
    if route in ("batch", "single", "executor", "compact"):  # the general build
        monkeypatch.setattr(small_llguidance, "in_place", lambda *args: None)
    if route == "single":
        monkeypatch.setattr(dense._DenseRows, "llguidance_walks", lambda *args: None)
    if route in ("executor", "compact"):  # llguidance's executor fills the chains, any size
        monkeypatch.setattr(routes, "EXECUTOR_WORK", 1)
    if route == "python":
        compiled.use(None)  # (the caller restores the helper)
    return _executor_spy(monkeypatch)


def test_the_executor_spy_set_again_replaces_itself(smollm2, monkeypatch):
    """A spy set a second time on the same patch (as every example of a randomized test does)
    replaces the first instead of wrapping it: calls reach the library's function through
    one spy, however many examples ran before."""
    first = _route("executor", monkeypatch)
    for _ in range(3):
        latest = _executor_spy(monkeypatch)
    requests, draft = _requests(smollm2, 49157)
    ps.build_host_bitmask([r.native() for r in requests], ps.GrammarTree.from_linear_chain(draft),
                          32 * WORDS)  # fmt: skip
    assert (first, latest) == ([], [3])


def _requests(smollm2, size):
    """Three requests of the JSON schema inside a string (where every ordinary token is
    allowed), each chain holding a draft past the vocabulary: first, in the middle, last."""
    tokenizer = samples.llguidance_tokenizer(size)
    text = samples.load_tokenizer().encode('{"name": "')
    requests = [
        LLRequest(samples.llguidance_grammar("json_schema"), list(text), tokenizer, smollm2.eos)
        for _ in range(3)
    ]
    a, b = samples.load_tokenizer().encode("ab")[:1], samples.load_tokenizer().encode("x")
    past = [size, 32 * WORDS - 1, size + 1]
    drafts = [
        [0, past[0], *a, *b],
        [0, *a, past[1], *b],
        [0, *a, *b, past[2]],
    ]
    return requests, np.array(drafts, dtype=np.int64)


@pytest.mark.parametrize("logits", [32 * WORDS, 32 * WORDS + 40])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_draft_past_the_vocabulary_is_a_refused_node(smollm2, route, shape, logits, monkeypatch):
    """On each route: the rows and valid flags are the replay's (the draft refused, its row and
    everything below it all-allowed), the node counts too, every matcher where it started and
    none in its error state."""
    if compiled.native is None and route not in ("python", "executor", "compact"):
        pytest.skip("the compiled helper is not built")
    if shape == "tree" and route in ("executor", "compact"):
        pytest.skip("the executor fills chains")
    size = 49157
    requests, draft = _requests(smollm2, size)
    matchers = [r.native() for r in requests]
    nodes = draft.shape[1]
    if shape == "chain":
        tree = ps.GrammarTree.from_linear_chain(draft)
        nt = np.tile(np.array([*range(1, nodes), -1], dtype=np.int64), (3, 1))
        ns = np.full((3, nodes), -1, dtype=np.int64)
    else:  # root -> 1, 2 (siblings); 1 -> 3
        nt = np.tile(np.array([1, 3, -1, -1], dtype=np.int64), (3, 1))
        ns = np.tile(np.array([-1, 2, -1, -1], dtype=np.int64), (3, 1))
        tree = ps.GrammarTree.from_host(nt, ns, draft)
    before = matcher_prints(matchers, WORDS, PROBE)
    real = compiled.native
    try:
        executor = _route(route, monkeypatch)
        reset_grammar_stats()
        if route == "compact":
            mask, valid = (
                ps.build_host_bitmask(matchers, tree, logits, layout="compact").to_dense(),
                None,
            )
        else:
            mask, valid = ps.build_host_bitmask(matchers, tree, logits, return_valid=True)
        stats = ps.grammar_stats()
    finally:
        compiled.use(real)
    assert bool(executor) == (route in ("executor", "compact")), executor
    assert not any(m.is_error() for m in matchers)
    assert matcher_prints(matchers, WORDS, PROBE) == before
    case = SimpleNamespace(requests=requests, next_token=nt, next_sibling=ns, draft=draft,
                           vocab_size=logits)  # fmt: skip
    assert_mask_matches(case, WORDS, mask)
    arrays = (nt, ns, draft)
    if valid is not None:
        np.testing.assert_array_equal(valid, expected_valid(requests, *arrays, logits, WORDS))
        counts = expected_node_counts(requests, *arrays, logits, WORDS)
        assert (stats["checked_nodes"], stats["rejected_nodes"]) == counts


@pytest.mark.parametrize("route", ["default", "general"])
def test_many_chains_with_padding_drafts_leave_every_matcher_usable(smollm2, route, monkeypatch):
    """130 chain requests under logits wider than the tokenizer, each chain with a padding id
    past the tokenizer's vocabulary, by the route the table picks and by the general build
    (there, at the route table's own thresholds, llguidance's executor: the batch is past
    EXECUTOR_WORK): the replay's rows, and every matcher still usable where it started."""
    size, logits = 49157, 32 * WORDS
    requests, draft = _requests(smollm2, size)
    requests = [requests[b % 3] for b in range(130)]
    draft = draft[np.arange(130) % 3]
    matchers = [r.native() for r in requests]
    if route == "general":
        monkeypatch.setattr(small_llguidance, "in_place", lambda *args: None)
        assert routes.work(draft.size, WORDS) >= routes.EXECUTOR_WORK  # the case of the defect
    executor = _executor_spy(monkeypatch)
    mask, valid = ps.build_host_bitmask(
        matchers, ps.GrammarTree.from_linear_chain(draft), logits, return_valid=True
    )
    if route == "general":
        assert executor == [130], executor
    assert not any(m.is_error() for m in matchers)
    nodes = draft.shape[1]
    nt = np.tile(np.array([*range(1, nodes), -1], dtype=np.int64), (130, 1))
    ns = np.full((130, nodes), -1, dtype=np.int64)
    case = SimpleNamespace(requests=requests, next_token=nt, next_sibling=ns, draft=draft,
                           vocab_size=logits)  # fmt: skip
    assert_mask_matches(case, WORDS, mask)
    np.testing.assert_array_equal(valid, expected_valid(requests, nt, ns, draft, logits, WORDS))


# -- randomized: the compiled helper against the Python fallback -------------------------------
@pytest.mark.parametrize(
    "shape,route", [("tree", "default"), ("chain", "default"), ("chain", "executor"),
                    ("chain", "compact")]
)  # fmt: skip
@SETTINGS
@given(data=st.data())
def test_compiled_equals_fallback_with_drafts_past_the_vocabulary(smollm2, shape, route, data):
    """Random batches (grammar-valid, refused, end-token, negative, past-the-tokenizer and
    past-the-logits drafts; logits as wide as the tokenizer or wider; tokenizers of 49153,
    49157 and 49183 tokens) built with the compiled helper and with the Python fallback: the
    same rows, valid flags and node counts, each the replay's; every matcher where it started,
    none in its error state."""
    if compiled.native is None:
        pytest.skip("the compiled helper is not built")
    size = data.draw(st.sampled_from(SIZES), label="tokenizer vocabulary")
    make, kinds = _make(smollm2, size)
    case = draw_case(
        data, _vocab(smollm2, size), kinds=kinds, make_request=make, protocol=False, max_batch=5
    )
    if shape == "chain":
        nodes = case.draft.shape[1]
        case.next_token[:] = np.arange(1, nodes + 1)
        case.next_token[:, -1] = -1
        case.next_sibling[:] = -1
        tree = lambda: ps.GrammarTree.from_linear_chain(case.draft)  # noqa: E731
    else:
        tree = lambda: ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)  # noqa: E731
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone after each example
        if route in ("executor", "compact"):
            monkeypatch.setattr(small_llguidance, "in_place", lambda *args: None)
            monkeypatch.setattr(routes, "EXECUTOR_WORK", 1)
        executor = _executor_spy(monkeypatch)
        before = matcher_prints(case.matchers, WORDS, PROBE)
        built = []
        real = compiled.native
        for helper in (real, None):
            compiled.use(helper)
            try:
                reset_grammar_stats()
                if route == "compact":
                    out = ps.build_host_bitmask(
                        case.matchers, tree(), case.vocab_size, layout="compact"
                    )
                    built.append((None if out is None else out.to_dense(), None, None))
                else:
                    mask, valid = ps.build_host_bitmask(
                        case.matchers, tree(), case.vocab_size, return_valid=True
                    )
                    stats = ps.grammar_stats()
                    built.append((mask, valid, (stats["checked_nodes"], stats["rejected_nodes"])))
            finally:
                compiled.use(real)
            assert not any(m is not None and m.is_error() for m in case.matchers)
            assert matcher_prints(case.matchers, WORDS, PROBE) == before
        (mask, valid, counts), (mask_py, valid_py, counts_py) = built
        if route in ("executor", "compact") and any(m is not None for m in case.matchers):
            assert executor, "llguidance's executor did not run"
        assert (mask is None) == (mask_py is None)
        if mask is not None:
            np.testing.assert_array_equal(mask, mask_py)
        assert_mask_matches(case, WORDS, mask)
        if valid is not None:
            np.testing.assert_array_equal(valid, valid_py)
            arrays = (case.next_token, case.next_sibling, case.draft)
            want = expected_valid(case.requests, *arrays, case.vocab_size, WORDS)
            np.testing.assert_array_equal(valid, want)
            if mask is not None:
                assert counts == counts_py
                assert counts == expected_node_counts(
                    case.requests, *arrays, case.vocab_size, WORDS
                )


# -- a tokenizer of many end tokens -------------------------------------------------------------
def _many_ends_tokenizer():
    """SmolLM2's tokenizer with twelve end tokens, each in its own 32-token mask word
    (``<|im_end|>`` and eleven others made end tokens): the row after an end token allows
    twelve words' worth of tokens."""
    eos = samples.load_tokenizer().eos_id
    ends = [eos, *(32 * 131 * j + 7 for j in range(1, 12))]
    tokenizer = llguidance.LLTokenizer(samples.load_tokenizer().backend_json(), eos_token=ends)
    assert sorted(tokenizer.eos_tokens) == sorted(ends)
    assert len({t >> 5 for t in ends}) == 12
    return tokenizer, ends


def test_the_probe_reads_every_end_token(smollm2):
    """The probe lists the tokenizer's end tokens (all twelve, or SmolLM2's one), wherever
    the matcher is, and moves nothing."""
    tokenizer, ends = _many_ends_tokenizer()
    text = samples.load_tokenizer().encode("-0.00")
    for tok, want in ((tokenizer, sorted(ends)), (samples.llguidance_tokenizer(), [smollm2.eos])):
        for prefix in ([], text):
            matcher = llguidance.LLMatcher(tok, samples.llguidance_grammar("builtin_json"),
                                           log_level=0)  # fmt: skip
            assert matcher.try_consume_tokens(prefix) == len(prefix)
            before = matcher_prints([matcher], 1536, PROBE)
            info = probe_llguidance(matcher, 1536)
            assert info.end_ids is not None and info.end_ids.tolist() == want
            assert matcher_prints([matcher], 1536, PROBE) == before and not matcher.is_error()


@pytest.mark.parametrize("route", ["small", "batch", "batch-numpy", "compact", "compact-batch"])
def test_end_tokens_spanning_many_words_end_the_chain_on_every_route(smollm2, route):
    """JSON values at ``-0.00`` (they may end or go on) whose chains draft end tokens of a
    tokenizer with twelve of them, in twelve mask words: an end token's node is terminated
    (all-allowed rows from it on, the next draft not valid) on every route, so that no row
    depends on the batch size or the route. "small": three requests (the compiled small
    build); "batch": 130 of them, past EXECUTOR_WORK (llguidance's executor), with the
    compiled pass over its rows or ("batch-numpy") the numpy one; the compact layout at both
    sizes. Against the per-node replay on fresh matchers."""
    tokenizer, ends = _many_ends_tokenizer()
    encode = samples.load_tokenizer().encode
    digit, space = encode("1")[0], encode(" ")[0]
    grammar = samples.llguidance_grammar("builtin_json")
    prefix = encode("-0.00")
    chains = [
        [0, ends[0], ends[5], digit, digit, space, digit, digit],  # an end token, another
        [0, ends[7], digit, digit, digit, digit, digit, digit],  # one not the first
        [0, digit, ends[11], ends[0], digit, digit, space, digit],  # a digit, then two
        [0, digit, digit, digit, digit, digit, ends[3], ends[4]],  # the last two drafts
    ]
    batch = 130 if route in ("batch", "batch-numpy", "compact-batch") else len(chains)
    draft = np.array([chains[b % len(chains)] for b in range(batch)], dtype=np.int64)
    requests = [LLRequest(grammar, list(prefix), tokenizer, ends[0]) for _ in range(batch)]
    matchers = [r.native() for r in requests]
    nodes = draft.shape[1]
    if batch == 130:
        assert routes.work(draft.size, 1536) >= routes.EXECUTOR_WORK
    before = matcher_prints(matchers, 1536, PROBE)
    tree = ps.GrammarTree.from_linear_chain(draft)
    calls: list[int] = []
    real = compiled.native
    with pytest.MonkeyPatch.context() as patch:
        calls = _executor_spy(patch)
        if route == "batch-numpy":
            compiled.use(None)
        try:
            if route.startswith("compact"):
                mask = ps.build_host_bitmask(matchers, tree, smollm2.size, layout="compact")
                mask, valid = mask.to_dense(), None
            else:
                mask, valid = ps.build_host_bitmask(matchers, tree, smollm2.size,
                                                    return_valid=True)  # fmt: skip
        finally:
            compiled.use(real)
    assert bool(calls) == (batch == 130), calls
    assert matcher_prints(matchers, 1536, PROBE) == before
    assert not any(m.is_error() for m in matchers)
    nt = np.tile(np.array([*range(1, nodes), -1], dtype=np.int64), (batch, 1))
    ns = np.full((batch, nodes), -1, dtype=np.int64)
    case = SimpleNamespace(requests=requests, next_token=nt, next_sibling=ns, draft=draft,
                           vocab_size=smollm2.size)  # fmt: skip
    assert_mask_matches(case, 1536, mask)
    want = expected_valid(requests, nt, ns, draft, smollm2.size, 1536)
    assert want[:4].tolist() == [  # the replay's: valid up to the first end token, itself too
        [True, True, False, False, False, False, False, False],
        [True, True, False, False, False, False, False, False],
        [True, True, True, False, False, False, False, False],
        [True, True, True, True, True, True, True, False],
    ]
    if valid is not None:
        np.testing.assert_array_equal(valid, want)
