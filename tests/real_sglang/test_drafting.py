"""(g) Grammar-aware drafting: sglang's EAGLE v2 draft loop and NGRAM worker with drafting on
and off, over JSON documents of the library's schema workloads written by a scripted target.

EAGLE: sglang's own ``EagleDraftWorker`` (``draft``, ``draft_forward``, ``select_top_k_tokens``,
``organize_draft_results``, ``build_eagle_verify_input``, ``_draft_extend_for_decode``) with a
stand-in draft head of random logits, ``run_eagle_verify`` after it, several steps per
request. With drafting on, every drafted node the verify tree holds is one the grammar allows
(replayed with sglang's grammar methods on the request's grammar), except slots where the
grammar allowed fewer tokens than top-k; every verify mask equals sglang's own build of the
same tree; the committed tokens are those of the run with drafting off (each request's
document). With drafting off, the same head drafts tokens the grammar refuses where it allows
many.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator

import pytest

pytest.importorskip("sglang")

import _draft
import _eagle
import _sgl
import _verify
import torch

from portable_spec.integrations import sglang as plugin

EAGLE_SHAPE = (4, 3, 8)  # topk, steps, draft tokens
EAGLE_STEPS = 4  # verify steps per request
#: tokens of each document committed before the first step: inside the invoice number's digits,
#: before a free string (the city), inside a key (forced tokens)
EAGLE_STARTS = (10, 34, 3)


@contextlib.contextmanager
def _spy_build(module_name: str, seen: list) -> Iterator[None]:
    """While the plugin is installed: record, at each verify build the worker module makes,
    the tree, sglang's own rows for it and the mask built (the module's binding restored
    before the plugin is uninstalled)."""
    module = importlib.import_module(module_name)
    build = module.build_grammar_vocab_mask

    def spy(*, reqs, tree, sampling_info, device, barrier):
        host = [t.clone() for t in tree.resolve()]
        theirs, _ = _sgl.spec_utils().generate_token_bitmask(reqs, *host, sampling_info.vocab_size)
        out = build(reqs=reqs, tree=tree, sampling_info=sampling_info, device=device,
                    barrier=barrier)  # fmt: skip
        seen.append((host, theirs, None if out is None else out.vocab_mask.cpu()))
        return out

    module.build_grammar_vocab_mask = spy
    try:
        yield
    finally:
        module.build_grammar_vocab_mask = build


def _refused_drafts(writers, verify_input, topk: int, vocab: int) -> tuple[int, int]:
    """Per step: ``(refused nodes where the parent allowed at least top-k tokens, refused
    nodes where it allowed fewer)``, by replaying every node's path with sglang's grammar
    methods on each request's grammar (rolled back after)."""
    next_token, next_sibling, draft = (t.numpy() for t in _eagle.tree_of(verify_input))
    wasted = dead = 0
    for b, w in enumerate(writers):
        allowed = _verify.node_allowed(w.grammar, next_token[b], next_sibling[b], draft[b], vocab)
        parent = {int(c): p for p in range(len(draft[b])) for c in _children(next_token[b],
                  next_sibling[b], p)}  # fmt: skip
        for j in range(1, len(draft[b])):
            p = parent.get(j)
            if p is None or allowed[j] is not None or allowed[p] is None:
                continue
            if len(allowed[p]) >= topk:
                wasted += 1
            else:
                dead += 1
    return wasted, dead


def _children(next_token, next_sibling, p: int) -> list[int]:
    out, c = [], int(next_token[p])
    while c != -1:
        out.append(c)
        c = int(next_sibling[c])
    return out


def _run_eagle(backend: str, drafting: bool) -> dict:
    topk, steps, nodes = EAGLE_SHAPE
    vocab = _sgl.VOCAB
    words = (vocab + 31) // 32
    writers = _draft.writers(backend, 3, EAGLE_STARTS)
    worker = _draft.draft_worker(topk, steps, nodes, vocab, seed=11)
    seen: list = []
    wasted = dead = committed_total = 0
    plugin.reset_stats()
    with _sgl.plugin_on(), _spy_build("sglang.srt.speculative.eagle_worker_common", seen):
        plugin.set_drafting(drafting)
        spec = _draft.first_draft_input(worker, writers, vocab)
        for _ in range(EAGLE_STEPS):
            before = [_sgl.fingerprint(w.grammar, words) for w in writers]
            verify_input, committed, spec = _draft.eagle_step(worker, writers, spec, vocab)
            assert [_sgl.fingerprint(w.grammar, words) for w in writers] == before
            w_, d_ = _refused_drafts(writers, verify_input, topk, vocab)
            wasted, dead = wasted + w_, dead + d_
            for w, tokens in zip(writers, committed, strict=True):
                assert _verify.grammatical(w.grammar, tokens), tokens
                committed_total += len(w.commit(tokens))
        stats = plugin.integration_stats()
        plugin.set_drafting(True)
    plugin.reset_stats()
    for _, theirs, mine in seen:
        assert mine is not None and torch.equal(mine, theirs)
    _sgl.COUNTS["drafted verify masks compared"] += len(seen)
    return {
        "outputs": [w.output_ids for w in writers],
        "documents": [w.document for w in writers],
        "wasted": wasted,
        "dead": dead,
        "stats": stats,
        "per_step": committed_total / (EAGLE_STEPS * len(writers)),
    }


@_sgl.cpu_only
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_eagle_draft_steps(backend):
    topk, steps, nodes = EAGLE_SHAPE
    with (
        _eagle.server_args(
            speculative_algorithm="EAGLE", speculative_num_steps=steps,
            speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes, device="cpu",
        ),
        _draft.stand_in_preparations(),
    ):  # fmt: skip
        on = _run_eagle(backend, True)
        off = _run_eagle(backend, False)
    # committed tokens: each request's document so far (the scripted target's greedy output,
    # masked or not), with and without drafting; drafting commits more of it per step
    for run in (on, off):
        for output, document in zip(run["outputs"], run["documents"], strict=True):
            assert output == document[: len(output)]
    # drafting on: no drafted node refused where the grammar allowed top-k tokens
    assert on["wasted"] == 0, on
    assert off["wasted"] > 0, off  # the head does draft refused tokens without the masks
    stats = on["stats"]
    assert stats["draft_steps"] == EAGLE_STEPS
    # the batch stays the same: every draft after the first restarts the last one's session
    assert stats["draft_sessions_restarted"] == EAGLE_STEPS - 1
    assert stats["draft_verify_masks"] == EAGLE_STEPS and stats["draft_mismatches"] == 0
    assert stats["draft_rows"] > 0
    assert off["stats"]["draft_steps"] == 0
    assert on["per_step"] > off["per_step"], (on["per_step"], off["per_step"])
    _sgl.COUNTS["drafted EAGLE steps"] += EAGLE_STEPS
    print(json.dumps({"backend": backend, "tokens per request-step": {
        "drafting on": on["per_step"], "drafting off": off["per_step"]}, "dead slots": on["dead"]}))  # fmt: skip


# -- NGRAM ---------------------------------------------------------------------------------------

NGRAM_NODES = 8
NGRAM_STEPS = 6
#: tokens of each document committed before the first step (the JSON's opening, a key, a value)
NGRAM_STARTS = (1, 5, 12, 30)


def _run_ngram(backend: str, drafting: bool | str, corpus: list) -> dict:
    vocab = _sgl.VOCAB
    words = (vocab + 31) // 32
    writers = _draft.writers(backend, len(NGRAM_STARTS), NGRAM_STARTS)
    seen: list = []
    committed_total = steps = 0
    plugin.reset_stats()
    with _sgl.plugin_on(), _spy_build("sglang.srt.speculative.ngram_worker", seen):
        plugin.set_drafting(drafting)
        worker = _draft.ngram_worker(corpus, vocab)
        for _ in range(NGRAM_STEPS):
            active = [w for w in writers if not w.finished]
            before = [_sgl.fingerprint(w.grammar, words) for w in active]
            committed = _draft.ngram_step(worker, active)
            assert [_sgl.fingerprint(w.grammar, words) for w in active] == before
            for w, tokens in zip(active, committed, strict=True):
                assert _verify.grammatical(w.grammar, tokens), tokens
                committed_total += len(w.commit(tokens))
            steps += len(active)
        plugin.set_drafting(True)
        stats = plugin.integration_stats()
    plugin.reset_stats()
    assert len(seen) == len(worker.trees) == NGRAM_STEPS
    for (host, theirs, mine), device_tree in zip(seen, worker.trees, strict=True):
        # the links sglang's kernel derived from the tree mask are the host tree's
        for a, b in zip(host[:2], device_tree[:2], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(host[2], device_tree[2])
        assert mine is not None and torch.equal(mine, theirs)
    _sgl.COUNTS["drafted verify masks compared"] += len(seen)
    return {
        "outputs": [w.output_ids for w in writers],
        "documents": [w.document for w in writers],
        "stats": stats,
        "per_step": committed_total / steps,
        "trees": [t[2] for t in worker.trees],
    }


def _ngram_args():
    return _eagle.server_args(
        speculative_algorithm="NGRAM", speculative_num_draft_tokens=NGRAM_NODES,
        speculative_ngram_max_trie_depth=8, speculative_ngram_capacity=100_000,
        disable_overlap_schedule=True, device="cpu",
    )  # fmt: skip


@_sgl.cpu_only
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_ngram_forced_drafts(backend):
    with _ngram_args():
        on = _run_ngram(backend, True, [])
        off = _run_ngram(backend, False, [])
    for run in (on, off):
        for output, document in zip(run["outputs"], run["documents"], strict=True):
            assert output == document[: len(output)]
    stats = on["stats"]
    assert stats["draft_steps"] == NGRAM_STEPS and stats["draft_verify_masks"] == NGRAM_STEPS
    assert stats["draft_sessions_restarted"] > 0
    assert stats["draft_mismatches"] == 0
    assert stats["ngram_nodes_replaced"] > 0 and stats["forced_tokens_accepted"] > 0
    assert off["stats"]["draft_steps"] == 0 and off["stats"]["ngram_nodes_replaced"] == 0
    assert on["per_step"] > off["per_step"], (on["per_step"], off["per_step"])
    _sgl.COUNTS["drafted NGRAM steps"] += NGRAM_STEPS
    print(json.dumps({"backend": backend, "NGRAM tokens per request-step (empty corpus)": {
        "drafting on": on["per_step"], "drafting off": off["per_step"]}}))  # fmt: skip


@_sgl.cpu_only
def test_ngram_drafting_shadow():
    """Drafting in shadow mode counts only: sglang's own trees and commits, the slots that
    would carry forced tokens counted, the verify masks gathered from the session's rows
    (equal to sglang's own build, as every mask here)."""
    with _ngram_args():
        shadow = _run_ngram("xgrammar", "shadow", [])
        off = _run_ngram("xgrammar", False, [])
    assert shadow["outputs"] == off["outputs"]
    assert all(torch.equal(a, b) for a, b in zip(shadow["trees"], off["trees"], strict=True))
    stats = shadow["stats"]
    assert stats["ngram_nodes_replaced"] > 0 and stats["forced_tokens_accepted"] == 0
    assert stats["draft_verify_masks"] == NGRAM_STEPS and stats["draft_mismatches"] == 0


@_sgl.cpu_only
def test_a_failing_draft_level_leaves_sglangs_drafts(caplog):
    """A level whose rows fail (here: the session raises at the second draft-head call) is
    never the step's failure: the rest of that draft is sglang's own, its verify mask is built
    afresh (still sglang's rows), one warning says so, and the next draft is masked again."""
    from portable_spec.integrations.sglang import eagle_draft

    topk, steps, nodes = EAGLE_SHAPE
    vocab = _sgl.VOCAB
    calls = {"n": 0}
    before_head = eagle_draft.EagleStep.before_head

    def flaky(self, input_ids):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a level that fails")
        return before_head(self, input_ids)

    seen: list = []
    writers = _draft.writers("xgrammar", 2, EAGLE_STARTS)
    worker = _draft.draft_worker(topk, steps, nodes, vocab, seed=3)
    plugin.reset_stats()
    with (
        _eagle.server_args(
            speculative_algorithm="EAGLE", speculative_num_steps=steps,
            speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes, device="cpu",
        ),
        _draft.stand_in_preparations(),
        _sgl.plugin_on(),
        _spy_build("sglang.srt.speculative.eagle_worker_common", seen),
        caplog.at_level("WARNING", logger="sglang.portable_spec"),
    ):  # fmt: skip
        eagle_draft.EagleStep.before_head = flaky
        try:
            spec = _draft.first_draft_input(worker, writers, vocab)
            for _ in range(2):
                _, committed, spec = _draft.eagle_step(worker, writers, spec, vocab)
                for w, tokens in zip(writers, committed, strict=True):
                    w.commit(tokens)
        finally:
            eagle_draft.EagleStep.before_head = before_head
        stats = plugin.integration_stats()
    plugin.reset_stats()
    assert stats["draft_steps"] == 2 and stats["draft_verify_masks"] == 1
    assert ["a level that fails" in r.getMessage() for r in caplog.records].count(True) == 1
    for _, theirs, mine in seen:
        assert mine is not None and torch.equal(mine, theirs)
    for w in writers:
        assert w.output_ids == w.document[: len(w.output_ids)]
