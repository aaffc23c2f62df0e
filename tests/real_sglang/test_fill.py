"""(f) The plain batch fill: sglang's own ``SamplingBatchInfo.update_regex_vocab_mask`` (the
mask of every step with a grammar request, speculative or not), with the plugin on and off.

Batches of 1 to 64 requests: xgrammar grammars in random states, requests without a grammar,
ended ones (which sglang leaves out of the fill), reasoners reasoning (whose fill writes
nothing) and answering, llguidance grammars (llguidance's own parallel fill, which the plugin
leaves alone) mixed in. The masks must be equal, rows sglang does not list untouched, every
grammar in its state afterwards.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

pytest.importorskip("sglang")

import _sgl
import torch

from portable_spec.integrations import sglang as plugin
from portable_spec.integrations.sglang import plain


@pytest.fixture(autouse=True)
def _every_size_batched(monkeypatch):
    """The batched fill from two rows (it starts at ``plain.MIN_ROWS`` for speed): the rows
    must be sglang's at every size."""
    monkeypatch.setattr(plain, "MIN_ROWS", 2)


def update(grammars: list, vocab_size: int):
    """sglang's own ``update_regex_vocab_mask`` on a batch holding ``grammars``."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    info = NS(grammars=grammars, vocab_size=vocab_size, device="cpu", grammar_mask=None,
              temperatures=torch.ones(len(grammars), 1))  # fmt: skip
    SamplingBatchInfo.update_regex_vocab_mask(info)
    return info.grammar_mask


def _batch(rng, size: int, mix: str) -> list:
    words = (_sgl.VOCAB + 31) // 32
    end = (int(_sgl.tokenizer().convert_tokens_to_ids("<|im_end|>")),)
    kinds = sorted(_sgl.GRAMMARS)
    grammars = []
    for b in range(size):
        r = rng.random()
        backend = (
            "llguidance" if mix == "llguidance" or (mix == "mixed" and r < 0.2) else "xgrammar"
        )
        made = _sgl.grammar(backend, kinds[int(rng.integers(0, len(kinds)))])
        _sgl.advance(made, int(rng.integers(0, 25)), rng, words, end=0.1)
        if b and r > 0.9:
            made = None
        elif mix == "mixed" and 0.75 < r <= 0.9:
            made = _sgl.reasoner(made, end, thinking=r < 0.83)
        grammars.append(made)
    if all(g is None for g in grammars):
        grammars[0] = _sgl.grammar("xgrammar", "json_schema")
    return grammars


@pytest.mark.parametrize("mix", ["xgrammar", "mixed", "llguidance"])
def test_update_regex_vocab_mask(mix):
    rng = np.random.default_rng({"xgrammar": 43, "mixed": 47, "llguidance": 53}[mix])
    words = (_sgl.VOCAB + 31) // 32
    plugin.reset_stats()
    for size in (1, 2, 5, 16, 64):
        grammars = _batch(rng, size, mix)
        before = [_sgl.fingerprint(g, words) for g in grammars]
        own = update(grammars, _sgl.VOCAB)
        with _sgl.plugin_on():
            ours = update(grammars, _sgl.VOCAB)
        assert [_sgl.fingerprint(g, words) for g in grammars] == before
        assert ours.grammar is own.grammar
        assert torch.equal(ours.vocab_mask, own.vocab_mask)
        _sgl.COUNTS["plain rows compared"] += size
    built = plugin.integration_stats()["fills_built"]
    assert built == 0 if mix == "llguidance" else built >= 3
    plugin.reset_stats()


def test_unlisted_rows_untouched():
    """``fill_vocab_mask_batched`` writes the listed rows only (here into a buffer holding a
    pattern, rows listed out of order, with gaps)."""
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject, GrammarRow

    rng = np.random.default_rng(59)
    words = (_sgl.VOCAB + 31) // 32
    grammars = _batch(rng, 12, "xgrammar")
    rows = [9, 2, 3, 4, 11, 0, 7]
    entries = [GrammarRow(row, grammars[i]) for i, row in enumerate(rows)
               if grammars[i] is not None and not grammars[i].is_terminated()]  # fmt: skip
    pattern = torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, (12, words), dtype=np.int32))
    own = pattern.clone()
    BaseGrammarObject.fill_vocab_mask_batched(entries, own)
    ours = pattern.clone()
    with _sgl.plugin_on():
        BaseGrammarObject.fill_vocab_mask_batched(entries, ours)
        assert plugin.integration_stats()["fills_built"] == 1
    assert torch.equal(ours, own)
    listed = {e.row for e in entries}
    for row in range(12):
        if row not in listed:
            assert torch.equal(ours[row], pattern[row])
    plugin.reset_stats()


def test_shadow_fill_and_ended_matchers():
    """Shadow mode: sglang's rows used, the batched fill's compared (none differ). A terminated
    matcher listed (sglang's caller leaves them out): sglang's own loop and its error."""
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject, GrammarRow

    rng = np.random.default_rng(61)
    words = (_sgl.VOCAB + 31) // 32
    grammars = [g for g in _batch(rng, 16, "xgrammar") if g is not None and not g.is_terminated()]
    entries = [GrammarRow(row, g) for row, g in enumerate(grammars)]
    own = torch.full((len(grammars), words), -1, dtype=torch.int32)
    BaseGrammarObject.fill_vocab_mask_batched(entries, own)
    plugin.reset_stats()
    ours = torch.full_like(own, -1)
    with _sgl.plugin_on("shadow"):
        BaseGrammarObject.fill_vocab_mask_batched(entries, ours)
    stats = plugin.integration_stats()
    assert torch.equal(ours, own)
    assert stats["rows_compared"] == len(grammars) and stats["rows_differing"] == 0

    ended = _sgl.grammar("xgrammar", "words")
    _sgl.advance(ended, 200, rng, words, end=1.0)
    assert ended.is_terminated()
    entries.insert(1, GrammarRow(len(grammars), ended))
    own = torch.full((len(grammars) + 1, words), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError) as theirs:
        BaseGrammarObject.fill_vocab_mask_batched(entries, own)
    ours = torch.full_like(own, -1)
    with _sgl.plugin_on(), pytest.raises(type(theirs.value)):
        BaseGrammarObject.fill_vocab_mask_batched(entries, ours)
    assert torch.equal(ours, own)
    plugin.reset_stats()
