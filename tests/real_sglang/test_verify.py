"""(b) sglang's ``run_eagle_verify`` with the plugin on and off.

sglang's EAGLE trees (its draft-tree code, chains and trees), requests with xgrammar and
llguidance grammars and without one, a target model whose logits attack the grammar: the
verify step's outputs (``next_token_ids``, ``accept_lens``, ``accept_index``,
``new_seq_lens``, the bonus tokens) must be identical with the plugin on and off, every
committed token grammatical, and the same step without a mask must commit tokens the grammar
refuses (so the logits do attack, and the mask is what stops them).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

pytest.importorskip("sglang")

import _eagle
import _sgl
import _verify
import torch

from portable_spec.integrations import sglang as plugin

OUTPUTS = ("next_token_ids", "accept_lens", "accept_index", "new_seq_lens")

# (topk, steps, draft tokens): a chain (topk 1) and two trees
SHAPES = [(1, 3, 4), (2, 3, 6), (4, 3, 10)]


@_sgl.cpu_only
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"topk{s[0]}-steps{s[1]}-n{s[2]}")
def test_run_eagle_verify(backend, shape):
    topk, steps, nodes = shape
    vocab = _sgl.VOCAB
    words = (vocab + 31) // 32
    rng = np.random.default_rng(zlib.crc32(f"{backend}{shape}".encode()))  # the same every run
    kinds = ["json_schema", "ebnf", "regex", "words"]
    ungrammatical = 0
    with _eagle.server_args(
        speculative_algorithm="EAGLE", speculative_num_steps=steps,
        speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes,
    ):  # fmt: skip
        for step in range(3):
            grammars = []
            for b in range(3):
                if b == 2 and step == 0:
                    grammars.append(None)  # a request without a grammar in the batch
                    continue
                made = _sgl.grammar(backend, kinds[int(rng.integers(0, len(kinds)))])
                _sgl.advance(made, int(rng.integers(0, 12)), rng, words)
                grammars.append(made)
            reqs = [_sgl.Req(g) for g in grammars]
            verify_input = _eagle.draft_tree(grammars, topk, steps, nodes, vocab, rng)
            tree = _eagle.tree_of(verify_input)
            logits = _verify.attack_logits(reqs, tree, vocab, rng)
            before = [_sgl.fingerprint(g, words) for g in grammars]

            own = _eagle.run_verify(verify_input, reqs, logits, topk=topk)
            with _sgl.plugin_on():
                ours = _eagle.run_verify(verify_input, reqs, logits, topk=topk)
                assert plugin.integration_stats()["built"] == 1
            plugin.reset_stats()
            bare = _eagle.run_verify(verify_input, reqs, logits, topk=topk, grammar=False)
            assert [_sgl.fingerprint(g, words) for g in grammars] == before

            for name in OUTPUTS:
                assert torch.equal(getattr(own, name), getattr(ours, name)), name
            assert torch.equal(
                own.next_draft_input.bonus_tokens, ours.next_draft_input.bonus_tokens
            )
            commits = _verify.committed(ours.next_token_ids, ours.accept_lens, nodes)
            for g, tokens in zip(grammars, commits, strict=True):
                assert _verify.grammatical(g, tokens), tokens
            _sgl.COUNTS["verify steps compared"] += 1
            _sgl.COUNTS["committed tokens checked"] += sum(map(len, commits))
            loose = _verify.committed(bare.next_token_ids, bare.accept_lens, nodes)
            ungrammatical += sum(
                not _verify.grammatical(g, tokens)
                for g, tokens in zip(grammars, loose, strict=True)
            )
    assert ungrammatical > 0, "without the mask every commit was grammatical: no attack"
    plugin.reset_stats()
