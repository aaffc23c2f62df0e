"""(d) The chain path DFlash and DSpark take: ``GrammarTree.from_linear_chain`` (sglang's own
constructor, wrapped by the plugin to mark its trees as chains, which the library builds
without walking links), against sglang's own rows over the links that constructor makes.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sglang")

import _sgl
from test_masks import _maker, check_step

from portable_spec.integrations import sglang as plugin


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_chain_steps(backend):
    rng = np.random.default_rng(31 if backend == "xgrammar" else 37)
    make = _maker(backend, _sgl.VOCAB, none=0.15, end=0.1)
    plugin.reset_stats()
    constrained = 0
    for _ in range(6):
        batch = int(rng.integers(1, 6))
        nodes = int(rng.choice([1, 2, 4, 8, 16]))
        reqs, tree = _sgl.random_step(rng, make, batch, nodes, _sgl.VOCAB, chain=True)
        check_step(reqs, tree, _sgl.VOCAB, chain=True)
        constrained += any(r.grammar is not None for r in reqs)
    assert plugin.integration_stats()["built"] == constrained > 0
    plugin.reset_stats()


def test_reasoning_chains():
    """Reasoning requests on chains: the grammar starts after the end token, mid-chain."""
    vocab = _sgl.VOCAB
    end = (int(_sgl.tokenizer().convert_tokens_to_ids("<|im_end|>")),)

    def make(rng):
        inner = _sgl.grammar("xgrammar", "json_schema")
        return _sgl.reasoner(inner, end, thinking=bool(rng.random() < 0.7))

    rng = np.random.default_rng(41)
    for _ in range(6):
        reqs, tree = _sgl.random_step(rng, make, 3, 8, vocab, chain=True)
        check_step(reqs, tree, vocab, chain=True)
