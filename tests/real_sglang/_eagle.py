"""sglang's EAGLE draft tree and verify step on CPU, around a fake target model.

The tree is sglang's own: ``select_top_k_tokens`` over the draft steps, then
``organize_draft_results`` and ``build_eagle_verify_input`` (``build_tree_kernel_efficient``,
its Triton kernel under Triton's interpreter). The draft model is a stand-in whose logits
favour, at every depth, the next token of a grammatical continuation of each request (so the
trees hold grammatical paths beside random ones).

The verify step is sglang's ``run_eagle_verify``: its target forward returns the given logits,
its KV pool records moves, and ``eagle_prepare_for_verify`` (which builds a model
``ForwardBatch`` for the real attention backends) is replaced by a stand-in that sets the
batch fields the step reads (``input_ids``, ``out_cache_loc``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace as NS
from typing import Any

import _sgl
import numpy as np
import torch


@contextlib.contextmanager
def server_args(**fields: Any) -> Iterator[None]:
    """sglang's server arguments for this process (its own test hook)."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(**fields)
    override.install()
    try:
        yield
    finally:
        override.restore()


def continuation(grammar: Any, length: int, rng: np.random.Generator) -> list[int]:
    """``length`` tokens the grammar accepts from its state (never its end token), chosen on a
    copy of its matcher; shorter if the grammar completes."""
    words = (_sgl.VOCAB + 31) // 32
    tokens: list[int] = []
    for _ in range(length):
        allowed = _sgl.allowed(grammar, words)
        allowed = allowed[(allowed != _sgl.eos()) & (allowed < _sgl.VOCAB)]
        if len(allowed) == 0:
            break
        token = int(rng.choice(allowed))
        grammar.accept_token(token)
        tokens.append(token)
    if tokens:
        grammar.rollback(len(tokens))
    return tokens


def draft_tree(
    grammars: list, topk: int, steps: int, nodes: int, vocab_size: int, rng: np.random.Generator
) -> Any:
    """sglang's ``EagleVerifyInput`` for the batch, from its own draft-tree code."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.eagle_utils import TreeMaskMode, organize_draft_results
    from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input
    from sglang.srt.speculative.spec_utils import select_top_k_tokens
    from sglang.srt.utils.common import fast_topk

    bs = len(grammars)
    paths = [continuation(g, steps, rng) if g is not None else [] for g in grammars]
    seed = int(rng.integers(0, 2**31))

    def draft_probs(rows: int, depth: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed + depth)
        logits = torch.randn(bs * rows, vocab_size, generator=generator)
        for b, path in enumerate(paths):
            if depth < len(path):
                logits[b * rows : (b + 1) * rows, path[depth]] += 6.0
        return torch.softmax(logits, dim=-1)

    scores_, tokens_, parents_ = [], [], []
    topk_p, topk_index = fast_topk(draft_probs(1, 0), topk, dim=-1)
    hidden = scores = None
    for i in range(steps):
        _, hidden, scores, info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        scores_.append(info[0])
        tokens_.append(info[1])
        parents_.append(info[2])
        if i < steps - 1:
            topk_p, topk_index = fast_topk(draft_probs(topk, i + 1), topk, dim=-1)
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        scores_, tokens_, parents_, nodes
    )
    batch = NS(forward_mode=ForwardMode.DECODE, seq_lens=torch.full((bs,), 32), seq_lens_sum=None)
    bonus = torch.from_numpy(rng.integers(0, vocab_size, bs).astype(np.int32))
    target = NS(model_runner=NS(attn_backend=NS(verify_mask=None, max_context_len=4096)))
    return build_eagle_verify_input(
        batch, EagleDraftInput(bonus_tokens=bonus), parent_list, top_scores_index, draft_tokens,
        None, target_worker=target, topk=topk, num_steps=steps, num_draft_tokens=nodes,
        tree_mask_mode=TreeMaskMode.QLEN_ONLY, device="cpu",
    )  # fmt: skip


def tree_of(verify_input: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = verify_input.retrieve_next_token.shape
    return (
        verify_input.retrieve_next_token,
        verify_input.retrieve_next_sibling,
        verify_input.draft_token.view(shape),
    )


def _clone(verify_input: Any) -> Any:
    import dataclasses

    return dataclasses.replace(
        verify_input,
        **{
            f.name: getattr(verify_input, f.name).clone()
            for f in dataclasses.fields(verify_input)
            if isinstance(getattr(verify_input, f.name), torch.Tensor)
        },
    )


def run_verify(
    verify_input: Any, reqs: list, logits: torch.Tensor, *, topk: int, grammar: bool = True
) -> Any:
    """sglang's ``run_eagle_verify`` on the step (a fresh batch and copies of its inputs):
    its ``GenerationBatchResult``. ``grammar=False`` runs it as if no request had one."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative import eagle_worker_common
    from transformers import LlamaConfig

    verify_input = _clone(verify_input)
    bs, nodes = verify_input.retrieve_next_token.shape

    def prepare(verify_input: Any, req_to_token_pool: Any, batch: Any, target_worker: Any):
        batch.input_ids = verify_input.draft_token
        batch.out_cache_loc = torch.arange(bs * nodes, dtype=torch.int64) + 1000
        return NS(), False

    def forward(batch=None, forward_batch=None, is_verify=False, pp_proxy_tensors=None):
        output = NS(next_token_logits=logits.clone(), hidden_states=None)
        return NS(logits_output=output, routed_experts_output=None, indexer_topk_output=None)

    model_runner = NS(
        attn_backend=NS(verify_mask=None, max_context_len=4096),
        watermark_state=None,
        model_config=NS(
            hf_config=LlamaConfig(), is_draft_model=False, linear_attn_registry_result=None
        ),
        spec_algorithm=NS(is_standalone=lambda: False),
    )
    sampling = NS(
        vocab_size=logits.shape[1], grammar_mask=None, acc_additive_penalties=None,
        acc_scaling_penalties=None, logit_bias=None, is_all_greedy=True,
        has_watermark_candidates=False,
    )  # fmt: skip
    batch = NS(
        spec_info=verify_input, seq_lens=torch.full((bs,), 32), req_pool_indices=torch.arange(bs),
        input_ids=None, out_cache_loc=None, has_grammar=grammar, reqs=reqs,
        sampling_info=sampling, device="cpu", forward_mode=ForwardMode.DECODE,
        return_logprob=False, hisparse_coordinator=None, mamba_track_indices=None,
        tree_cache=NS(page_size=1),
    )  # fmt: skip
    kv = NS(move_kv_cache=lambda target, source: None)
    real = eagle_worker_common.eagle_prepare_for_verify
    eagle_worker_common.eagle_prepare_for_verify = prepare
    try:
        return eagle_worker_common.run_eagle_verify(
            batch, target_worker=NS(model_runner=model_runner, forward_batch_generation=forward),
            req_to_token_pool=NS(), token_to_kv_pool_allocator=NS(get_kvcache=lambda: kv),
            plan_stream=None, plan_stream_ctx=contextlib.nullcontext(), topk=topk,
            num_draft_tokens=nodes, device="cpu", metadata_ready_pre_pad=False,
            finalize_tree_path=True,
        )  # fmt: skip
    finally:
        eagle_worker_common.eagle_prepare_for_verify = real
