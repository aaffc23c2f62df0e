"""(c) sglang's ``NGRAMWorker.forward_batch_generation`` with the plugin on and off.

sglang's own worker drafts from its n-gram corpus (JSON documents, some of them breaking the
schema), derives the verify tree on the host and builds the mask through
``build_grammar_vocab_mask(tree=GrammarTree.from_host(...))``; a fake target model attacks
the grammar. Over several steps (requests advanced by what they commit, as sglang's scheduler
does), the step's outputs must be identical with the plugin on and off, every committed token
grammatical, and without a mask some commit must be ungrammatical. (Drafting is off here: its
trees differ from sglang's by design; test_drafting.py tests them.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("sglang")

import _eagle
import _ngram
import _sgl
import _verify
import torch

from portable_spec.integrations import sglang as plugin

NODES = 8
DOCS = [
    {"name": "Ada", "age": 36, "address": {"street": "Main St", "city": "Paris", "zip": "75001"}},
    {
        "name": "Bob",
        "age": 7,
        "address": {"street": "Elm Rd", "city": "Oslo", "zip": "01234"},
        "tags": ["x", "y"],
    },
    {"name": "Cy", "age": "old", "address": {"street": 5, "city": "Rome"}},  # breaks the schema
]


@_sgl.cpu_only
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_ngram_worker(backend):
    encode = _sgl.tokenizer().encode
    docs = [encode(json.dumps(d), add_special_tokens=False) for d in DOCS]
    prompt = encode("Give me a person as JSON:", add_special_tokens=False)
    corpus = [prompt + d for d in docs]
    words = (_sgl.VOCAB + 31) // 32
    rng = np.random.default_rng(29)
    ungrammatical = 0
    with _eagle.server_args(
        speculative_algorithm="NGRAM", speculative_num_draft_tokens=NODES,
        speculative_ngram_max_trie_depth=8, speculative_ngram_capacity=100_000,
        disable_overlap_schedule=True, device="cpu",
    ):  # fmt: skip
        reqs = []
        for b in range(4):
            grammar = None if b == 3 else _sgl.grammar(backend, "json_schema")
            doc = docs[b % 2]
            start = int(rng.integers(1, 6))
            if grammar is not None:
                for token in doc[:start]:
                    grammar.accept_token(token)
            reqs.append(_ngram.request(f"r{b}", grammar, prompt, doc[:start]))
        for step in range(3):
            before = [_sgl.fingerprint(r.grammar, words) for r in reqs]
            own_worker = _ngram.worker(step, corpus)
            own = _ngram.step(own_worker, reqs)
            with _sgl.plugin_on():
                plugin.set_drafting(False)
                our_worker = _ngram.worker(step, corpus)
                ours = _ngram.step(our_worker, reqs)
                assert plugin.integration_stats()["built"] == 1
                plugin.set_drafting(True)
            bare = _ngram.step(_ngram.worker(step, corpus), reqs, grammar=False)
            assert [_sgl.fingerprint(r.grammar, words) for r in reqs] == before
            for mine, theirs in zip(our_worker.trees[0], own_worker.trees[0], strict=True):
                assert torch.equal(mine, theirs)
            for name in ("next_token_ids", "accept_lens", "new_seq_lens"):
                assert torch.equal(getattr(own, name), getattr(ours, name)), name
            assert torch.equal(
                own.next_draft_input.accept_tokens, ours.next_draft_input.accept_tokens
            )
            commits = _ngram.committed(ours, len(reqs))
            for r, tokens in zip(reqs, commits, strict=True):
                assert _verify.grammatical(r.grammar, tokens), tokens
            _sgl.COUNTS["ngram steps compared"] += 1
            _sgl.COUNTS["committed tokens checked"] += sum(map(len, commits))
            loose = _ngram.committed(bare, len(reqs))
            ungrammatical += sum(
                not _verify.grammatical(r.grammar, t) for r, t in zip(reqs, loose, strict=True)
            )
            for r, tokens in zip(reqs, commits, strict=True):  # the scheduler's advance
                for token in tokens:
                    if r.grammar is not None and not r.grammar.is_terminated():
                        r.grammar.accept_token(token)
                r.output_ids.extend(tokens)
            plugin.reset_stats()
    assert ungrammatical > 0, "without the mask every commit was grammatical: no attack"
