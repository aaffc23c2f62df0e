"""sglang-jax's own verify entry points with the integration: ``EagleVerifyInput.sample`` and
``BaseSpecWorker.verify`` over real EAGLE trees (sglang-jax's draft-loop functions and tree
kernel) and chains, with grammars from sglang-jax's own llguidance backend, Pallas kernels in
interpret mode on JAX CPU.

The committed tokens (sglang-jax's own ``resolve_spec_decode_token_ids``) must equal an
independent masked greedy walk of each tree (fresh matchers, tests/real_sglang_jax/_sgl.py),
and a fresh matcher must accept them; requests without a grammar must get the unmasked walk.
With the integration off, the same batches depart from the walk.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sgl_jax")

import _sgl as S
import jax.numpy as jnp
from flax import nnx

from portable_spec.integrations import sglang_jax as integration
from portable_spec.integrations.patching import PatchSet, Revision
from portable_spec.integrations.sglang_jax import internals, patches, state

# (topk, steps, nodes): EAGLE trees, and a chain (EAGLE3 / NEXTN with topk 1)
CONFIGS = {"tree-4x3-8": (4, 3, 8), "tree-2x4-6": (2, 4, 6), "chain-3": (1, 3, 4)}
KINDS = ["json", "regex", None, "ebnf"]
SEEDS = [11, 12]


def prefixes() -> list[list[int]]:
    return [S.encode('{"name": "'), S.encode("20"), [28, 29], S.encode("{")]


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request):
    topk, steps, nodes = CONFIGS[request.param]
    return S.build_case(KINDS, prefixes(), topk, steps, nodes, seed=len(request.param))


@pytest.fixture
def on():
    assert integration.install()
    integration.reset_stats()
    yield
    integration.uninstall()


@pytest.fixture
def off():
    integration.uninstall()
    yield


def run_sample(case, logits, *, greedy=True, rng=0):
    from sgl_jax.srt.layers.logits_processor import LogitsProcessorOutput

    spec = S.verify_input(case)
    batch = S.worker_batch(case, greedy=greedy)
    out = LogitsProcessorOutput(next_token_logits=jnp.asarray(logits))
    with S.interpret():
        predict, _, accept_length, _ = spec.sample(batch, out, nnx.Rngs(rng), S.mesh_1())
    return S.committed(case, predict, accept_length)


class _Target:
    """The target model of the verify step: returns the case's logits (sglang-jax's own
    verify does everything else)."""

    def __init__(self, logits, hidden=8):
        self.logits = logits
        self.hidden = hidden
        backend = SimpleNamespace(get_eagle_forward_metadata=lambda batch: None)
        self.model_runner = SimpleNamespace(attn_backend=backend)

    def forward_batch_generation(self, batch, skip_sample=False, forward_metadata=None):
        from sgl_jax.srt.layers.logits_processor import LogitsProcessorOutput

        rows = self.logits.shape[0]
        return (
            LogitsProcessorOutput(
                next_token_logits=jnp.asarray(self.logits),
                hidden_states=jnp.zeros((rows, self.hidden), jnp.float32),
            ),
            None,
            0,
        )


def run_verify(case, logits):
    from sgl_jax.srt.speculative.base_worker import BaseSpecWorker

    worker = BaseSpecWorker.__new__(BaseSpecWorker)
    worker.server_args = SimpleNamespace(disable_overlap_schedule=True)
    worker.speculative_num_draft_tokens = case.nodes
    worker.speculative_num_steps = case.steps
    worker.topk = case.topk
    worker.mesh = S.mesh_1()
    worker._target_worker = _Target(logits)
    worker._draft_worker = SimpleNamespace(draft_model_runner=SimpleNamespace(rngs=nnx.Rngs(0)))
    batch = S.worker_batch(case)
    batch.spec_info_padded = S.verify_input(case)
    with S.interpret():
        result = worker.verify(batch, np.full(case.batch, 64, np.int32))
    return S.committed(case, result.next_token_ids, result.accept_lens)


def check(case, logits, got):
    """Mismatches against the reference (empty: all good); counts what was checked."""
    want = S.expected(case, logits)
    free = S.expected(case, logits, masked=False)
    problems = []
    for b in range(case.batch):
        oracle = case.oracles[b]
        reference = want[b] if oracle is not None else free[b]
        end = oracle.end_of(reference) if oracle is not None else None
        if end is not None:  # the scheduler keeps the tokens up to the grammar's end
            reference = reference[: end + 1]
        if got[b] != reference:
            problems.append((b, got[b], reference))
        elif oracle is not None and not oracle.accepts(got[b]):
            problems.append((b, got[b], "refused by a fresh matcher"))
        S.CHECKED["requests"] += 1
        S.CHECKED["rows"] += case.nodes
        S.CHECKED["tokens"] += len(got[b])
    return problems


def accepted_depth(got):
    return sum(len(t) for t in got)


@pytest.mark.parametrize("seed", SEEDS)
def test_sample_commits_the_masked_greedy_walk(case, on, seed):
    logits = S.logits_for(case, seed)
    got = run_sample(case, logits)
    assert check(case, logits, got) == []
    stats = integration.integration_stats()
    assert stats["masked_steps"] >= 1 and stats["refused_requests"] == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_commits_the_masked_greedy_walk(case, on, seed):
    logits = S.logits_for(case, seed)
    got = run_verify(case, logits)
    assert check(case, logits, got) == []


def test_masked_walks_accept_drafts(case, on):
    """The cases exercise deep paths, not just the bonus token."""
    got = [run_sample(case, S.logits_for(case, seed)) for seed in SEEDS]
    constrained = [b for b in range(case.batch) if case.oracles[b] is not None]
    drafts = sum(len(g[b]) - 1 for g in got for b in constrained)
    assert drafts >= len(constrained)


@pytest.mark.parametrize("entry", ["sample", "verify"])
def test_without_the_integration_the_same_batches_depart(case, off, entry):
    mismatches = 0
    for seed in SEEDS:
        logits = S.logits_for(case, seed)
        got = run_sample(case, logits) if entry == "sample" else run_verify(case, logits)
        mismatches += len(check(case, logits, got))
    assert mismatches > 0


def test_rejection_sampling_commits_grammar_valid_tokens(case, on):
    for seed in SEEDS:
        logits = S.logits_for(case, seed)
        got = run_sample(case, logits, greedy=False, rng=seed)
        for b, oracle in enumerate(case.oracles):
            if oracle is not None:
                assert oracle.accepts(got[b]), (b, got[b])
                S.CHECKED["requests"] += 1
                S.CHECKED["rows"] += case.nodes
                S.CHECKED["tokens"] += len(got[b])


def test_rejection_sampling_without_the_integration_breaks_grammars(case, off):
    refused = 0
    for seed in SEEDS:
        logits = S.logits_for(case, seed)
        got = run_sample(case, logits, greedy=False, rng=seed)
        refused += sum(
            not oracle.accepts(got[b]) for b, oracle in enumerate(case.oracles) if oracle
        )
    assert refused > 0


# -- bad input ---------------------------------------------------------------------------------
def test_a_refused_grammar_keeps_sglang_jax_verify_for_that_request(on, caplog):
    topk, steps, nodes = CONFIGS["tree-4x3-8"]
    case = S.build_case(KINDS, prefixes(), topk, steps, nodes, seed=5)
    broken = case.grammars[3].ll_matcher
    broken.consume_token(S.eos() + 40000)  # a refused token: llguidance's error state
    assert broken.is_error()
    logits = S.logits_for(case, 7)
    with caplog.at_level(logging.WARNING, logger="sgl_jax.portable_spec"):
        got = run_sample(case, logits)
    want, free = S.expected(case, logits), S.expected(case, logits, masked=False)
    assert got[3] == free[3]  # sglang-jax's own (unmasked) verify
    for b in (0, 1):
        assert got[b] == want[b]
    lines = [r for r in caplog.records if "slot 3" in r.getMessage()]
    assert len(lines) == 1
    assert integration.integration_stats()["refused_requests"] == 1


def test_a_malformed_tree_keeps_sglang_jax_verify_for_that_request(on, caplog):
    topk, steps, nodes = CONFIGS["tree-4x3-8"]
    case = S.build_case(KINDS, prefixes(), topk, steps, nodes, seed=6)
    # a grandchild of the root also linked as the root's last child: two parents (no cycle,
    # so that sglang-jax's own kernel, which the request falls back to, still terminates)
    kids = S.children_of(case.next_token[0], case.next_sibling[0], 0)
    grandchild = next(
        g for k in kids for g in S.children_of(case.next_token[0], case.next_sibling[0], k)
    )
    case.next_sibling[0, kids[-1]] = grandchild
    before = [g.ll_matcher.deep_copy() for g in case.grammars if g is not None]
    logits = S.logits_for(case, 8)
    with caplog.at_level(logging.WARNING, logger="sgl_jax.portable_spec"):
        got = run_sample(case, logits)
    want = S.expected(case, logits)
    assert [got[1], got[3]] == [want[1], want[3]]
    assert len([r for r in caplog.records if "slot 0" in r.getMessage()]) == 1
    after = [g.ll_matcher for g in case.grammars if g is not None]
    for a, b in zip(before, after, strict=True):  # no matcher moved
        assert bytes(a.compute_bitmask()) == bytes(b.compute_bitmask())


def test_an_unknown_revision_logs_once_and_keeps_sglang_jax_code(monkeypatch, caplog):
    from sgl_jax.srt.speculative.eagle_info import EagleVerifyInput

    integration.uninstall()
    own = EagleVerifyInput.sample
    known = {}
    for label, revision in internals.REVISIONS.items():
        sources = dict(revision.sources)
        sources[next(iter(sources))] = "0" * 64  # one function's source differs
        known[label] = Revision(revision.version, sources, revision.fixed)
    patch_set = PatchSet(
        "sglang-jax",
        patches=patches.PATCHES,
        revisions=known,
        version=lambda: "0.0.0.dev0",
        logger=logging.getLogger("sgl_jax.portable_spec"),
    )
    monkeypatch.setattr(state.INTEGRATION, "_patches", patch_set)
    with caplog.at_level(logging.WARNING, logger="sgl_jax.portable_spec"):
        assert integration.install() is False
        assert integration.install() is False
    assert EagleVerifyInput.sample is own and not integration.is_installed()
    lines = [r.getMessage() for r in caplog.records if "is not patched" in r.getMessage()]
    assert len(lines) == 1 and next(iter(known["cddbf6f1"].sources)) in lines[0]
