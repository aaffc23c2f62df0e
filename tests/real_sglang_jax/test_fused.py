"""The overlap schedule's fused verify with the integration, piece by piece on JAX CPU (the
fused step itself needs sglang-jax's FlashAttention kernels, which do not run here):

* the chains the fused step verifies, computed by the integration with sglang-jax's own
  functions, are the ones sglang-jax builds (relay buffers and a direct chain);
* a grammar mask carried in the step's logits metadata masks the target verify logits inside
  sglang-jax's own ``LogitsProcessor``, under ``jit``, compiled once for every step's mask;
* those masked logits, verified by sglang-jax's own fused greedy verification
  (``_verify_greedy``), commit the independent masked greedy walk of each chain (and not
  without the mask);
* in the overlap loop, a speculative decode batch with a grammar has the previous result
  processed first, and a no-op entry left in the loop's queue.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sgl_jax")

import _sgl as S
import jax
import jax.numpy as jnp

import portable_spec as ps
from portable_spec.integrations import sglang_jax as integration
from portable_spec.integrations.sglang_jax import fixes, fused

STEPS, NODES = 3, 4


@pytest.fixture(scope="module")
def case():
    kinds = ["json", "regex", None, "ebnf"]
    prefixes = [S.encode('{"name": "'), S.encode("20"), [28, 29], S.encode("{")]
    return S.build_case(kinds, prefixes, 1, STEPS, NODES, seed=7)


@pytest.fixture
def on():
    assert integration.install()
    yield
    integration.uninstall()


def chains_of(case):
    """The case's chain inputs as the fused step gets them: last committed token, drafts."""
    return case.draft[:, 0].astype(np.int32), case.draft[:, 1:].astype(np.int32)


def test_the_chains_are_the_ones_sglang_jax_verifies(case):
    verified, tokens = chains_of(case)
    seq_lens = jnp.full(case.batch, 16, jnp.int32)
    with S.interpret():
        direct = fused.chain_tokens(
            jnp.asarray(verified), jnp.asarray(tokens), None, None, None, seq_lens,
            nodes=NODES, dp_size=1, batch=case.batch,
        )  # fmt: skip
        # the same chains through relay buffers, as the overlap loop keeps them
        from sgl_jax.srt.speculative.relay_buffer import SpecRelayBuffers

        capacity = 8
        future = np.array([5, 2, 7, 0], dtype=np.int32)[: case.batch]
        topk = np.zeros((1, capacity, STEPS), np.int32)
        ids = np.zeros((1, capacity), np.int32)
        topk[0, future] = tokens
        ids[0, future] = verified
        relay = SpecRelayBuffers(
            topk_index=jnp.asarray(topk),
            hidden_states=jnp.zeros((1, capacity, 8), jnp.float32),
            verified_id=jnp.asarray(ids),
            new_seq_lens=jnp.zeros((1, capacity), jnp.int32),
        )
        relayed = fused.chain_tokens(
            jnp.zeros_like(jnp.asarray(verified)), jnp.zeros_like(jnp.asarray(tokens)), None,
            relay, jnp.asarray(future), seq_lens, nodes=NODES, dp_size=1, batch=case.batch,
        )  # fmt: skip
    assert np.array_equal(np.asarray(direct), case.draft)
    assert np.array_equal(np.asarray(relayed), case.draft)


def processor_and_head(hidden: int = 16):
    from sgl_jax.srt.layers.embeddings import Embed
    from sgl_jax.srt.layers.logits_processor import LogitsProcessor

    with jax.set_mesh(S.mesh_1()):
        head = Embed(S.VOCAB, hidden, dtype=jnp.float32, param_dtype=jnp.float32, mesh=S.mesh_1())
        processor = LogitsProcessor(S.VOCAB, S.mesh_1())
    return processor, head


def verify_metadata(mask=None):
    from sgl_jax.srt.layers.logits_processor import LogitsMetadata
    from sgl_jax.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    metadata = LogitsMetadata(
        forward_mode=ForwardMode.TARGET_VERIFY, capture_hidden_mode=CaptureHiddenMode.FULL
    )
    return metadata if mask is None else fused.masked_logits_metadata().of(metadata, mask)


def test_the_mask_in_the_logits_metadata_masks_the_verify_logits_under_jit(case, on):
    from flax import nnx

    processor, head = processor_and_head()
    rows = case.batch * NODES
    matchers = [g.ll_matcher if g is not None else None for g in case.grammars]
    tree = ps.GrammarTree.from_linear_chain(case.draft)
    mask = ps.build_grammar_vocab_mask(matchers, tree, S.VOCAB, row_capacity=rows)
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((rows, 16), np.float32))
    traces = []

    @nnx.jit
    def step(processor, head, hidden, metadata):
        traces.append(1)
        return processor(hidden, head, metadata).next_token_logits

    with jax.set_mesh(S.mesh_1()):
        free = np.asarray(step(processor, head, hidden, verify_metadata()))
        masked = np.asarray(step(processor, head, hidden, verify_metadata(mask)))
        other = ps.build_grammar_vocab_mask([None, *matchers[1:]], tree, S.VOCAB, row_capacity=rows)
        again = np.asarray(step(processor, head, hidden, verify_metadata(other)))
    bits = np.unpackbits(np.asarray(mask).view(np.uint8), axis=1, bitorder="little")[:, : S.VOCAB]
    assert np.array_equal(masked, np.where(bits.astype(bool), free, -np.inf))
    assert np.array_equal(again[:NODES], free[:NODES])  # request 0 without a grammar now
    assert len(traces) == 2  # one compile without a mask, one for every masked step


def fused_greedy(case, logits):
    """sglang-jax's fused greedy verification of the case's chains over ``logits``, and the
    tokens its scheduler commits."""
    from sgl_jax.srt.speculative.draft_extend_fused import _verify_greedy

    bs, rows = case.batch, case.batch * NODES
    with S.interpret():
        out = _verify_greedy(
            target_hidden=jnp.zeros((rows, 8), jnp.float32),
            positions=jnp.arange(rows, dtype=jnp.int32),
            seq_lens=jnp.full(bs, 16, jnp.int32),
            draft_tokens=jnp.asarray(case.draft.reshape(-1)),
            target_predict=jnp.argmax(logits, axis=-1).astype(jnp.int32),
            speculative_num_steps=STEPS,
            speculative_num_draft_tokens=NODES,
        )
    return S.committed(case, out.predict, out.accept_lens)


def test_sglang_jax_fused_verification_of_masked_logits_commits_the_masked_walk(case, on):
    for seed in (3, 4):
        logits = S.logits_for(case, seed)
        matchers = [g.ll_matcher if g is not None else None for g in case.grammars]
        tree = ps.GrammarTree.from_linear_chain(case.draft)
        mask = ps.build_grammar_vocab_mask(matchers, tree, S.VOCAB, row_capacity=case.batch * NODES)
        masked = ps.apply_vocab_mask(jnp.asarray(logits), mask)
        got = fused_greedy(case, masked)
        want, free = S.expected(case, logits), S.expected(case, logits, masked=False)
        for b, oracle in enumerate(case.oracles):
            reference = want[b] if oracle is not None else free[b]
            end = oracle.end_of(reference) if oracle is not None else None
            if end is not None:
                reference = reference[: end + 1]
            assert got[b] == reference, b
            S.CHECKED["requests"] += 1
            S.CHECKED["rows"] += NODES
            S.CHECKED["tokens"] += len(got[b])
        unmasked = fused_greedy(case, jnp.asarray(logits))
        assert unmasked != got  # without the mask the same chains commit other tokens


def test_the_overlap_loop_processes_the_previous_result_before_a_grammar_step():
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode
    from sgl_jax.srt.speculative.spec_info import SpeculativeAlgorithm

    calls = []

    def launch(self, batch):
        calls.append(("run", batch.name, [entry[0].forward_mode for entry in self.result_queue]))
        return "result"

    def batch(name, grammar):
        reqs = [SimpleNamespace(grammar=None), SimpleNamespace(grammar=grammar)]
        return SimpleNamespace(
            name=name, forward_mode=ForwardMode.DECODE, reqs_info=[SimpleNamespace(reqs=reqs)]
        )

    wrapped = fixes.RUN_ORDER.make(launch)
    previous = SimpleNamespace(name="t-1", forward_mode=ForwardMode.DECODE)
    scheduler = SimpleNamespace(
        enable_overlap=True,
        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
        result_queue=deque([(previous, "result t-1")]),
        process_batch_result=lambda b, r, done: calls.append(("process", b.name, r, done)),
    )
    ended = S.grammar("json")
    ended.finished = True
    for free in (batch("free", None), batch("ended", ended)):
        wrapped(scheduler, free)
        # no active grammar: the loop's own order
        assert calls == [("run", free.name, [ForwardMode.DECODE])]
        calls.clear()
    constrained = batch("t", S.grammar("json"))
    wrapped(scheduler, constrained)
    assert calls == [
        ("process", "t-1", "result t-1", None),
        ("run", "t", [ForwardMode.DUMMY_FIRST]),  # the loop pops a no-op entry instead
    ]
    assert scheduler.result_queue[0][1] is None
