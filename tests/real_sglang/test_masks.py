"""(a) The plugin's ``build_grammar_vocab_mask`` against sglang's own ``generate_token_bitmask``.

Random steps over sglang's grammar objects (xgrammar, llguidance, the reasoner wrapper in both
phases; outlines' and unknown objects, which stay sglang's): requests advanced into random
states (ended ones included), requests without a grammar, random trees whose drafts mix
tokens the grammar allows, end tokens, ids past the vocabulary and random ids, with the
model's vocabulary equal to the tokenizer's or padded past it. Every row must equal sglang's,
the rest of sglang's contract must hold (barrier first and once, ``None`` exactly when sglang
returns it, the batch's grammar in the ``GrammarMask``, the sampler's stale mask cleared),
and every grammar object must be in its state afterwards.
"""

from __future__ import annotations

import logging
import zlib

import numpy as np
import pytest

pytest.importorskip("sglang")

import _sgl
import torch

import portable_spec as ps
from portable_spec.integrations import sglang as plugin

DEVICE = _sgl.DEVICE


def _fingerprints(reqs: list, words: int) -> list:
    return [_sgl.fingerprint(r.grammar, words) for r in reqs]


def check_step(reqs, tree, vocab_size, *, chain=False, mode="on", sglang_tree=None):
    """The plugin's build of one step against sglang's own; returns the plugin's mask."""
    words = (vocab_size + 31) // 32
    spec = _sgl.spec_utils()
    if chain:  # sglang's own chain links
        tree = spec.GrammarTree.from_linear_chain(tree[2]).resolve()
    before = _fingerprints(reqs, words)
    expected = _sgl.sglang_rows(reqs, tree, vocab_size)
    assert _fingerprints(reqs, words) == before
    if sglang_tree is None and not chain:
        sglang_tree = spec.GrammarTree.from_host(*tree)
    info = _sgl.SamplingInfo(vocab_size)
    barriers = []
    with _sgl.plugin_on(mode):
        if chain:  # the wrapped constructor marks its trees
            sglang_tree = spec.GrammarTree.from_linear_chain(tree[2])
            assert getattr(sglang_tree, "_portable_spec_chain", False)
        got = spec.build_grammar_vocab_mask(
            reqs=reqs, tree=sglang_tree, sampling_info=info, device=DEVICE,
            barrier=lambda: barriers.append(1),
        )  # fmt: skip
    assert barriers == [1]
    assert _fingerprints(reqs, words) == before, "a grammar object was left moved"
    _sgl.COUNTS["steps"] += 1
    if expected is None:
        assert got is None
        assert info.grammar_mask == "left from the extend step"
        return None
    assert info.grammar_mask is None
    assert got.grammar is [r.grammar for r in reqs if r.grammar is not None][-1]
    mask = got.vocab_mask
    assert mask.device.type == DEVICE.type and mask.dtype == expected.dtype == torch.int32
    assert tuple(mask.shape) == tuple(expected.shape)
    mask = mask.cpu()
    differing = np.flatnonzero((mask.numpy() != expected.numpy()).any(axis=1))
    _sgl.COUNTS["rows compared"] += expected.shape[0]
    _sgl.COUNTS["rows differing"] += len(differing)
    nodes = tree[2].shape[1]
    assert not len(differing), [
        (int(r) // nodes, int(r) % nodes, int(tree[2][int(r) // nodes, int(r) % nodes]))
        for r in differing[:10]
    ]
    return mask


def _maker(backend: str, vocab_size: int, *, none: float = 0.2, end: float = 0.15):
    words = (vocab_size + 31) // 32
    kinds = sorted(_sgl.GRAMMARS)

    def make(rng):
        if rng.random() < none:
            return None
        made = _sgl.grammar(backend, kinds[int(rng.integers(0, len(kinds)))], vocab_size)
        _sgl.advance(made, int(rng.integers(0, 30)), rng, words, end=end)
        return made

    return make


@pytest.mark.parametrize("vocab_size", [_sgl.VOCAB, _sgl.PADDED], ids=["vocab", "padded"])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_random_steps(backend, vocab_size):
    rng = np.random.default_rng(zlib.crc32(f"{backend}{vocab_size}".encode()))  # the same every run
    make = _maker(backend, vocab_size)
    for _ in range(12):
        batch = int(rng.integers(1, 6))
        nodes = int(rng.choice([1, 2, 5, 8, 16, 24]))
        reqs, tree = _sgl.random_step(rng, make, batch, nodes, vocab_size)
        check_step(reqs, tree, vocab_size)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_ended_grammars(backend):
    """Grammars ended before the step (xgrammar terminated, llguidance finished) and ones
    whose end token the matcher consumed without stopping first (llguidance)."""
    rng = np.random.default_rng(7)
    make = _maker(backend, _sgl.VOCAB, none=0.0, end=0.6)
    for _ in range(10):
        reqs, tree = _sgl.random_step(rng, make, 4, 8, _sgl.VOCAB)
        check_step(reqs, tree, _sgl.VOCAB)


def test_no_grammar_returns_none():
    rng = np.random.default_rng(1)
    reqs, tree = _sgl.random_step(rng, lambda rng: None, 3, 8, _sgl.VOCAB)
    assert check_step(reqs, tree, _sgl.VOCAB) is None


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_reasoner_steps(backend, caplog):
    """sglang's reasoner wrapper: answering, reasoning with a one-token end (the library), a
    multi-token end and a strict-thinking filter (sglang's own walk), no inner grammar."""
    vocab = _sgl.VOCAB
    words = (vocab + 31) // 32
    end_one = (int(_sgl.tokenizer().convert_tokens_to_ids("<|im_end|>")),)
    end_two = tuple(_sgl.tokenizer().encode("</think>", add_special_tokens=False))
    assert len(end_two) > 1
    xgr_backend = _sgl.backend("xgrammar")
    kinds = sorted(_sgl.GRAMMARS)

    def make(rng):
        r = rng.random()
        inner = _sgl.grammar(backend, kinds[int(rng.integers(0, len(kinds)))])
        if r < 0.1:
            return None
        if r < 0.35:  # answering: the inner grammar advanced
            made = _sgl.reasoner(inner, end_one, thinking=False)
            _sgl.advance(made, int(rng.integers(0, 10)), rng, words)
            return made
        if r < 0.7:
            made = _sgl.reasoner(inner, end_one, thinking=True)
        elif r < 0.8:
            made = _sgl.reasoner(inner, end_two, thinking=True)
        elif r < 0.9:
            made = _sgl.reasoner(
                inner, end_one, thinking=True, think_excluded_token_ids=[13, 28],
                enable_token_filter=True, token_filter_fn=xgr_backend.set_token_filter,
            )  # fmt: skip
        else:
            made = _sgl.reasoner(None, end_one, thinking=True)
        for _ in range(int(rng.integers(0, 4))):  # thinking tokens before the step
            made.accept_token(int(rng.integers(100, 1000)))
        return made

    rng = np.random.default_rng(11)
    with caplog.at_level(logging.WARNING, logger="sglang.portable_spec"):
        for _ in range(14):
            reqs, tree = _sgl.random_step(rng, make, int(rng.integers(1, 6)), 10, vocab)
            check_step(reqs, tree, vocab)
    plugin.reset_stats()


def test_outlines_steps_stay_sglang(caplog):
    """outlines' grammars allocate boolean masks: sglang's own code builds such steps (one
    warning), and its result is what comes back."""
    rng = np.random.default_rng(3)
    words = (_sgl.VOCAB + 31) // 32

    def make(rng):
        made = _sgl.grammar("outlines", "words")
        _sgl.advance(made, int(rng.integers(0, 3)), rng, words)
        return made

    plugin.reset_stats()
    reqs, tree = _sgl.random_step(rng, make, 2, 1, _sgl.VOCAB)  # its walk raises past node 0
    spec = _sgl.spec_utils()
    expected = _sgl.sglang_rows(reqs, tree, _sgl.VOCAB)
    with caplog.at_level(logging.WARNING, logger="sglang.portable_spec"), _sgl.plugin_on():
        for _ in range(2):
            got = spec.build_grammar_vocab_mask(
                reqs=reqs, tree=spec.GrammarTree.from_host(*tree),
                sampling_info=_sgl.SamplingInfo(_sgl.VOCAB), device=DEVICE, barrier=None,
            )  # fmt: skip
            assert got.vocab_mask.dtype == torch.bool
            assert torch.equal(got.vocab_mask.cpu(), expected)
        assert plugin.integration_stats()["whole_steps"] == 2
    warnings = [r for r in caplog.records if "OutlinesGrammar" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    plugin.reset_stats()


def test_unknown_grammar_objects_are_sglangs(caplog):
    """A grammar class the plugin does not know (here a subclass of sglang's xgrammar grammar)
    is walked by sglang's own ``traverse_tree`` for its request, in the library's step."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    class Custom(XGrammarGrammar):
        pass

    rng = np.random.default_rng(5)
    words = (_sgl.VOCAB + 31) // 32

    def make(rng):
        made = _sgl.grammar("xgrammar", "json_schema")
        if rng.random() < 0.5:
            made.__class__ = Custom
        _sgl.advance(made, int(rng.integers(0, 20)), rng, words)
        return made

    plugin.reset_stats()
    with caplog.at_level(logging.WARNING, logger="sglang.portable_spec"):
        for _ in range(4):
            reqs, tree = _sgl.random_step(rng, make, 4, 12, _sgl.VOCAB)
            check_step(reqs, tree, _sgl.VOCAB)
    stats = plugin.integration_stats()
    assert stats["own_requests"] > 0 and stats["built"] == 4
    assert len([r for r in caplog.records if "Custom" in r.getMessage()]) == 1
    plugin.reset_stats()


def test_refused_tree_is_sglangs(caplog):
    """A tree the library refuses (a node with two parents, which sglang's walk visits twice)
    is walked by sglang's own code for its request; the other requests stay the library's."""
    rng = np.random.default_rng(9)
    reqs, tree = _sgl.random_step(rng, _maker("xgrammar", _sgl.VOCAB, none=0.0), 3, 6, _sgl.VOCAB)
    next_token, next_sibling, draft = (t.clone() for t in tree)
    # request 1: node 2 is the first child of node 1 and of node 3 (1's other child)
    next_token[1] = torch.tensor([1, 2, -1, 2, -1, -1])
    next_sibling[1] = torch.tensor([-1, -1, 3, -1, -1, -1])
    plugin.reset_stats()
    with caplog.at_level(logging.WARNING, logger="sglang.portable_spec"):
        check_step(reqs, (next_token, next_sibling, draft), _sgl.VOCAB)
    stats = plugin.integration_stats()
    assert stats["refused_steps"] == 1 and stats["own_requests"] == 1 and stats["built"] == 1
    assert any("refused" in r.getMessage() for r in caplog.records)
    plugin.reset_stats()


def test_barrier_runs_before_any_grammar_is_read():
    """sglang's barrier advances the grammars over the last step's tokens: the rows are those
    after it (rows read before it would be those of the state before)."""
    rng = np.random.default_rng(13)
    vocab = _sgl.VOCAB
    words = (vocab + 31) // 32
    reqs, tree = _sgl.random_step(rng, _maker("xgrammar", vocab, none=0.0, end=0.0), 3, 8, vocab)
    stale = _sgl.sglang_rows(reqs, tree, vocab)
    tokens = [int(_sgl.allowed(r.grammar, words)[-1]) for r in reqs]  # never the end token
    assert _sgl.eos() not in tokens
    for r, t in zip(reqs, tokens, strict=True):
        r.grammar.accept_token(t)
    expected = _sgl.sglang_rows(reqs, tree, vocab)
    for r in reqs:
        r.grammar.rollback(1)
    assert not torch.equal(stale, expected)

    def barrier():
        for r, t in zip(reqs, tokens, strict=True):
            r.grammar.accept_token(t)

    spec = _sgl.spec_utils()
    with _sgl.plugin_on():
        got = spec.build_grammar_vocab_mask(
            reqs=reqs, tree=spec.GrammarTree.from_host(*tree),
            sampling_info=_sgl.SamplingInfo(vocab), device=DEVICE, barrier=barrier,
        )  # fmt: skip
    assert torch.equal(got.vocab_mask.cpu(), expected)


def test_host_tensors_read_in_place(monkeypatch):
    """The tree's host tensors (``from_device``'s copies, or ``from_host``'s) reach the library
    as they are: no copy on the way."""
    rng = np.random.default_rng(17)
    reqs, tree = _sgl.random_step(rng, _maker("xgrammar", _sgl.VOCAB, none=0.0), 2, 8, _sgl.VOCAB)
    seen = []
    real = ps.GrammarTree.from_host

    def spy(*arrays):
        seen.append(arrays)
        return real(*arrays)

    monkeypatch.setattr(ps.GrammarTree, "from_host", staticmethod(spy))
    spec = _sgl.spec_utils()
    sglang_tree = spec.GrammarTree.from_device(*(t.to(DEVICE) for t in tree))
    check_step(reqs, tree, _sgl.VOCAB, sglang_tree=sglang_tree)
    (arrays,) = seen
    for ours, theirs in zip(arrays, sglang_tree.resolve(), strict=True):
        assert np.shares_memory(ours, theirs.numpy())


def test_shadow_mode_uses_sglangs_rows():
    rng = np.random.default_rng(19)
    plugin.reset_stats()
    for backend in ("xgrammar", "llguidance"):
        reqs, tree = _sgl.random_step(rng, _maker(backend, _sgl.VOCAB), 4, 12, _sgl.VOCAB)
        check_step(reqs, tree, _sgl.VOCAB, mode="shadow")
    stats = plugin.integration_stats()
    assert stats["rows_compared"] == 2 * 4 * 12 and stats["rows_differing"] == 0
    assert stats["samples"]["sglang"] and stats["samples"]["portable_spec"]
    plugin.reset_stats()


def test_failing_grammar_leaves_the_others_unmoved():
    """A grammar object that raises inside sglang's own walk (here an unknown class): sglang's
    error comes out, as without the plugin, and the requests the library built are back in
    their state."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    class Broken(XGrammarGrammar):
        def fill_vocab_mask(self, vocab_mask, idx):
            raise RuntimeError("broken grammar")

    rng = np.random.default_rng(23)
    words = (_sgl.VOCAB + 31) // 32
    make = _maker("xgrammar", _sgl.VOCAB, none=0.0, end=0.0)
    reqs, tree = _sgl.random_step(rng, make, 4, 8, _sgl.VOCAB)
    reqs[2].grammar.__class__ = Broken
    before = _fingerprints([r for i, r in enumerate(reqs) if i != 2], words)
    spec = _sgl.spec_utils()
    with _sgl.plugin_on(), pytest.raises(RuntimeError, match="broken grammar"):
        spec.build_grammar_vocab_mask(
            reqs=reqs, tree=spec.GrammarTree.from_host(*tree),
            sampling_info=_sgl.SamplingInfo(_sgl.VOCAB), device=DEVICE, barrier=None,
        )  # fmt: skip
    assert _fingerprints([r for i, r in enumerate(reqs) if i != 2], words) == before
    plugin.reset_stats()


def _plugin_rows(reqs: list, tree: tuple, vocab: int) -> torch.Tensor:
    spec = _sgl.spec_utils()
    with _sgl.plugin_on():
        got = spec.build_grammar_vocab_mask(
            reqs=reqs, tree=spec.GrammarTree.from_host(*tree),
            sampling_info=_sgl.SamplingInfo(vocab), device=DEVICE, barrier=None,
        )  # fmt: skip
    return got.vocab_mask.cpu()


def _chain(*drafts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = len(drafts)
    next_token = torch.tensor([[*range(1, n), -1]], dtype=torch.int64)
    return next_token, torch.full((1, n), -1, dtype=torch.int64), torch.tensor([drafts])


def test_a_negative_draft_id_is_refused_where_sglangs_walk_reads_the_rows_end():
    """The one deliberate difference (docs/sglang.md). sglang 0.5.23's walk reads a negative
    draft id as an index from the row's end: -1 is bit 31 of the row's last word. While a
    ``ReasonerGrammarObject`` is thinking its rows allow every token, so sglang accepts the
    id and walks on below it (an end token there starts the grammar). The plugin refuses it,
    as it refuses a token the grammar does not allow: every row below it all-allowed. With an
    xgrammar grammar whose row has that bit set, sglang's own step raises on the same id,
    where the plugin refuses the node."""
    vocab = _sgl.VOCAB
    words = (vocab + 31) // 32
    end = int(_sgl.tokenizer().convert_tokens_to_ids("<|im_end|>"))
    schema = _sgl.grammar("xgrammar", "json_schema")
    answer_row = torch.full((1, words), -1, dtype=torch.int32)
    schema.fill_vocab_mask(answer_row, 0)  # the grammar's first row
    assert int((answer_row != -1).sum()) > 0  # a row that constrains

    # root, -1, the reasoning's end token, a token: sglang's walk and the plugin's rows
    thinking = _sgl.reasoner(schema, (end,), thinking=True)
    tree = _chain(100, -1, end, 123)
    before = _sgl.fingerprint(thinking, words)
    theirs = _sgl.sglang_rows([_sgl.Req(thinking)], tree, vocab)
    assert torch.equal(theirs[2], answer_row[0]), "sglang no longer accepts a negative id"
    ours = _plugin_rows([_sgl.Req(thinking)], tree, vocab)
    assert _sgl.fingerprint(thinking, words) == before
    assert torch.equal(ours[0], theirs[0])
    assert bool((ours[1:] == -1).all()), "the plugin took the negative id as a token"

    # an xgrammar grammar whose row allows the tokenizer's last token (bit 31, last word)
    inside_a_key = _sgl.grammar("xgrammar", "object")
    for token in _sgl.tokenizer().encode('{"', add_special_tokens=False):
        inside_a_key.accept_token(token)
    assert vocab - 1 in set(_sgl.allowed(inside_a_key, words).tolist())
    tree = _chain(100, -1, 123)
    before = _sgl.fingerprint(inside_a_key, words)
    with pytest.raises(ValueError, match="Tokens not accepted: -1"):  # sglang's own step
        _sgl.sglang_rows([_sgl.Req(inside_a_key)], tree, vocab)
    assert _sgl.fingerprint(inside_a_key, words) == before
    ours = _plugin_rows([_sgl.Req(inside_a_key)], tree, vocab)
    assert _sgl.fingerprint(inside_a_key, words) == before
    assert not bool((ours[0] == -1).all()), "the root's row is the grammar's"
    assert bool((ours[1:] == -1).all())
    _sgl.COUNTS["steps"] += 2
    plugin.reset_stats()
