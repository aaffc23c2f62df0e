"""After a speculative step: sglang-jax's scheduler hands the accepted tokens, a list, to its
own ``GuidanceGrammar.accept_token`` and resolves them with its own
``resolve_spec_decode_token_ids``. With the integration the list advances the matcher exactly
as far as verify accepted, and a grammar that ends inside the list ends the request there."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sgl_jax")

import _sgl as S

from portable_spec.integrations import sglang_jax as integration


@pytest.fixture
def on():
    assert integration.install()
    yield
    integration.uninstall()


def mask_of(matcher):
    return bytes(matcher.compute_bitmask())


def test_a_list_advances_the_grammar_as_far_as_verify_accepted(on):
    prefix = S.encode('{"name": "')
    step = S.encode('Ana", "age": 3')
    g = S.grammar("json", prefix)
    g.accept_token(step)
    reference = S.Oracle.of(g, [*prefix, *step]).fresh()
    assert mask_of(g.ll_matcher) == mask_of(reference)
    assert not g.finished and not g.ll_matcher.is_error()


def test_without_the_integration_a_list_raises_type_error():
    integration.uninstall()
    g = S.grammar("json", S.encode("{"))
    with pytest.raises(TypeError):
        g.accept_token(S.encode('"name'))


def scheduler_batch(reqs):
    return SimpleNamespace(
        per_dp_bs_size=len(reqs), dp_size=1, reqs_info=[SimpleNamespace(reqs=reqs)]
    )


class Req:
    """The parts of sglang-jax's Req that its resolve step reads."""

    def __init__(self, grammar):
        self.grammar = grammar
        self.to_finish = None

    def finished(self):
        return False


def resolve(reqs, tokens, nodes):
    from sgl_jax.srt.speculative import overlap_utils

    predict = np.zeros(len(reqs) * nodes + 1, np.int32)
    for i, t in enumerate(tokens):
        predict[i * nodes : i * nodes + len(t)] = t
    result = SimpleNamespace(next_token_ids=predict, accept_lens=np.array([len(t) for t in tokens]))
    return overlap_utils.resolve_spec_decode_token_ids(result, scheduler_batch(reqs), nodes)


def test_a_grammar_ending_inside_the_accepted_path_ends_the_request_there(on):
    from sgl_jax.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN

    date = S.encode("2024-05-1")
    g = S.grammar("regex", date)
    tail = S.encode("7")
    extra = S.encode("xyz")
    accepted = [*tail, S.eos(), *extra]  # verify accepted past the end (all-allowed rows)
    free = Req(None)
    other = Req(S.grammar("regex", S.encode("20")))
    reqs = [Req(g), free, other]
    before = mask_of(g.ll_matcher)
    integration.reset_stats()
    tokens, lens = resolve(reqs, [accepted, [5, 6, 7], S.encode("24")], nodes=8)
    assert tokens[0] == [*tail, S.eos()] and lens[0] == len(tail) + 1
    stats = integration.integration_stats()  # what the two grammar requests commit, no more
    assert (stats["accepted_tokens"], stats["constrained_verifies"]) == (
        len(tail) + 1 + len(S.encode("24")),
        2,
    )
    assert isinstance(reqs[0].to_finish, FINISH_MATCHED_TOKEN)
    assert tokens[1] == [5, 6, 7] and tokens[2] == S.encode("24")
    assert free.to_finish is None and other.to_finish is None
    assert mask_of(g.ll_matcher) == before  # resolving moved no matcher
    g.accept_token(tokens[0])  # what the scheduler does next
    assert g.finished and not g.ll_matcher.is_error()


def test_without_the_integration_tokens_after_the_end_are_committed():
    integration.uninstall()
    g = S.grammar("regex", S.encode("2024-05-1"))
    accepted = [*S.encode("7"), S.eos(), *S.encode("xyz")]
    tokens, _ = resolve([Req(g)], [accepted], nodes=8)
    assert tokens[0] == accepted


def scheduler_grammars(backend, key) -> list:
    """Four requests with one grammar, as sglang-jax's scheduler gets their grammar objects:
    two while it compiles (``get_cached_or_future_value`` before ``set_cache``), then the
    first's result cached as a copy, then two cache hits."""
    first, hit = backend.get_cached_or_future_value(key)
    second, _ = backend.get_cached_or_future_value(key)
    assert not hit
    grammars = [first.result(timeout=60), second.result(timeout=60)]
    backend.set_cache(key, grammars[0].copy())  # what move_ready_grammar_requests does
    for _ in range(2):
        value, hit = backend.get_cached_or_future_value(key)
        assert hit
        grammars.append(value)
    return grammars


@pytest.mark.parametrize("integrated", [True, False])
def test_every_request_gets_a_grammar_object_of_its_own(integrated):
    from sgl_jax.srt.constrained.llguidance_backend import get_guidance_backend

    if integrated:
        assert integration.install()
    else:
        integration.uninstall()
    try:
        backend = get_guidance_backend(tokenizer=S.hf_tokenizer(), n_vocab=S.VOCAB, num_threads=1)
        grammars = scheduler_grammars(backend, S.GRAMMARS["json"])
    finally:
        integration.uninstall()
    fresh = mask_of(S.grammar("json").ll_matcher)
    for g in grammars[0::2]:  # the first compiling request and the first cache hit advance
        g.ll_matcher.try_consume_tokens(S.encode('{"name": "'))
    untouched = [mask_of(g.ll_matcher) == fresh for g in grammars[1::2]]
    distinct = len({id(g.ll_matcher) for g in grammars}) == len(grammars)
    # sglang-jax's own: the two compiling requests share one object, the cache hits another
    assert (untouched, distinct) == (
        ([True, True], True) if integrated else ([False, False], False)
    )
