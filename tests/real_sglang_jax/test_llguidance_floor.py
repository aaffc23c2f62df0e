"""The library's llguidance floor is the llguidance sglang-jax pins (``~=1.3.0``), and this
environment runs it: the library's rows over sglang-jax's own grammar objects' matchers, for
trees (the iterative walk), small batches of chains (token by token) and 32 chains or more
(llguidance's parallel executor), against the fresh-matcher reference; no matcher moves."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sgl_jax")

import _sgl as S

import portable_spec as ps

ROOT = Path(__file__).resolve().parents[2]


def test_this_environment_runs_the_llguidance_floor():
    floor = re.search(r'"llguidance>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    installed = version("llguidance").split(".")
    assert installed[: len(floor.split("."))] == floor.split(".")


def reference_rows(case: S.Case) -> np.ndarray:
    words = -(-S.VOCAB // 32)
    out = np.full((case.batch * case.nodes, words), -1, dtype=np.int32)
    for b in range(case.batch):
        oracle = case.oracles[b]
        if oracle is None:
            continue
        paths = S.paths_of(case.next_token[b], case.next_sibling[b], case.draft[b])
        for node, path in paths.items():
            row = oracle.row(path)
            if row is not None:
                bits = np.zeros(words * 32, dtype=bool)
                bits[: S.VOCAB] = row
                out[b * case.nodes + node] = np.packbits(bits, bitorder="little").view(np.int32)
    return out


def build(case: S.Case, chain: bool) -> np.ndarray:
    matchers = [g.ll_matcher if g is not None else None for g in case.grammars]
    before = [bytes(m.compute_bitmask()) if m is not None else None for m in matchers]
    if chain:
        tree = ps.GrammarTree.from_linear_chain(case.draft)
    else:
        tree = ps.GrammarTree.from_host(case.next_token, case.next_sibling, case.draft)
    mask = ps.build_host_bitmask(matchers, tree, S.VOCAB)
    after = [bytes(m.compute_bitmask()) if m is not None else None for m in matchers]
    assert before == after  # no matcher moved
    return mask


@pytest.mark.parametrize("topk,steps,nodes", [(4, 3, 8), (2, 4, 6)])
def test_tree_rows_match_the_reference(topk, steps, nodes):
    case = S.build_case(["json", "regex", None, "ebnf"], [S.encode('{"'), [], [], []], topk,
                        steps, nodes, seed=topk)  # fmt: skip
    assert np.array_equal(build(case, chain=False), reference_rows(case))


@pytest.mark.parametrize("requests", [3, 33])
def test_chain_rows_match_the_reference(requests):
    kinds = (["json", "regex", "ebnf"] * requests)[:requests]
    case = S.build_case(kinds, [[]] * requests, 1, 4, 5, seed=requests)
    assert np.array_equal(build(case, chain=True), reference_rows(case))
