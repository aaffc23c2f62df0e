"""The sglang integration's check that a verify tree is the drafted one (its verify mask is then
gathered from the draft rows, else built afresh), on real draft sessions over SmolLM2's
vocabulary: the compiled check and the numpy one agree, on the drafted tree and on trees that
differ from it in one token, one link or one padding node; sglang itself is not needed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import xgrammar as xgr

import portable_spec as ps
from portable_spec import native
from portable_spec.integrations.sglang import drafting


def _session_step(smollm2, tok, rng):
    """A draft session of three requests (two grammars, one unconstrained) grown two levels
    of random tokens, a selection of its nodes closed under parents (padding at the end), and
    the staged step with its plan."""
    grammar = smollm2.grammars["json_schema"]
    matchers = [xgr.GrammarMatcher(grammar), None, xgr.GrammarMatcher(grammar)]
    for t in tok.encode('{"name": "'):
        assert matchers[2].accept_token(t)
    session = ps.DraftSession(matchers, smollm2.size)
    batch = len(matchers)
    session.extend(np.zeros((batch, 3), np.int64), rng.integers(0, smollm2.size, (batch, 3)))
    session.extend(
        rng.integers(0, 4, (batch, 4)), rng.integers(0, smollm2.size, (batch, 4)), masks=False
    )
    parents, _ = session.tree()
    select = np.full((batch, 6), -1, np.int64)
    for b in range(batch):
        chosen = [0]
        for v in range(1, session.nodes):
            if parents[b, v] in chosen and rng.random() < 0.6 and len(chosen) < 6:
                chosen.append(v)
        select[b, : len(chosen)] = chosen
    grammars = tuple(object() if m is not None else None for m in matchers)
    step = drafting.Drafted(session, grammars, tuple(matchers), select, "eagle")
    plan = SimpleNamespace(
        end_token=None, own=False, whole_step=False, grammars=grammars, matchers=matchers
    )
    return step, plan


def _verify_arrays(step) -> list[np.ndarray]:
    tree = step.session.verify_tree(step.select)
    return [np.array(a, dtype=np.int64) for a in tree.resolve()]


@pytest.mark.skipif(native.native is None, reason="portable_spec._native is not built here")
@pytest.mark.parametrize("spoil", ["none", "token", "link", "padding", "root token"])
def test_drafted_tree_check_agrees_with_numpy(smollm2, tok, monkeypatch, spoil):
    rng = np.random.default_rng(["none", "token", "link", "padding", "root token"].index(spoil))
    seen = set()
    for _ in range(8):
        step, plan = _session_step(smollm2, tok, rng)
        try:
            nt, ns, draft = _verify_arrays(step)
            width = (step.select >= 0).sum(axis=1)
            b = int(np.argmax(width))
            if spoil == "token" and width[b] > 1:
                draft[b, int(width[b]) - 1] += 1
            elif spoil == "link" and (ns[b] >= 0).any():
                ns[b, int(np.argmax(ns[b] >= 0))] = -1  # a sibling list cut: its tail orphaned
            elif spoil == "padding":
                pad = int(width[b]) if width[b] < step.select.shape[1] else None
                if pad is not None:  # a padding node linked in as the root's last child
                    last = nt[b, 0]
                    while ns[b, last] >= 0:
                        last = ns[b, last]
                    if last >= 0:
                        ns[b, last] = pad
            elif spoil == "root token":
                draft[b, 0] += 7  # the root's token is the committed one: not compared
            arrays = [nt, ns, draft]
            compiled = drafting._matches(step, plan, arrays, smollm2.size)
            monkeypatch.setattr(native, "tree_matches", lambda *args: None)
            numpy_path = drafting._matches(step, plan, arrays, smollm2.size)
            monkeypatch.undo()
            assert compiled is numpy_path
            seen.add(compiled)
            if spoil in ("none", "root token"):
                assert compiled is True
        finally:
            step.close()
    if spoil in ("token", "link", "padding"):
        assert False in seen  # the spoilt trees are told apart
