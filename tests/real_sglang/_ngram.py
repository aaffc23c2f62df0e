"""sglang's ``NGRAMWorker`` on CPU, around a fake target model.

The worker is sglang's own: its n-gram corpus (C++, built by sglang's JIT on first use), its
draft trees (``reconstruct_indices_from_tree_mask`` under Triton's interpreter, and the host
tree it derives for the grammar mask), its verify (``eagle_sample``) and KV bookkeeping. The
target model is the fake of :mod:`_verify`, reading the verify tree the worker built; its
memory pools are stand-ins (a request-to-token table, a KV cache recording nothing).
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import _sgl
import _verify
import numpy as np
import torch

MAX_REQUESTS = 8


def worker(seed: int, corpus: list[list[int]]) -> Any:
    """A fresh ``NGRAMWorker`` (sglang's server arguments must say NGRAM) whose corpus holds
    ``corpus``; its fake target draws the step's logits from ``seed``."""
    from sglang.srt.speculative.ngram_worker import NGRAMWorker
    from transformers import LlamaConfig

    req_to_token = torch.arange(MAX_REQUESTS * 512, dtype=torch.int32).view(MAX_REQUESTS, 512)
    kv = NS(move_kv_cache=lambda target, source: None)
    pools = (NS(req_to_token=req_to_token), NS(get_kvcache=lambda: kv))
    trees: list = []

    def forward(batch: Any, pp_proxy_tensors: Any = None, is_verify: bool = False) -> Any:
        verify_input = batch.spec_info
        shape = verify_input.retrieve_next_token.shape
        tree = (
            verify_input.retrieve_next_token.clone(),
            verify_input.retrieve_next_sibling.clone(),
            verify_input.draft_token.view(shape).clone(),
        )
        trees.append(tree)
        rng = np.random.default_rng(seed)
        logits = _verify.attack_logits(batch.reqs, tree, batch.sampling_info.vocab_size, rng)
        return NS(logits_output=NS(next_token_logits=logits, hidden_states=None),
                  can_run_cuda_graph=False)  # fmt: skip

    model_runner = NS(
        max_running_requests=MAX_REQUESTS,
        watermark_state=None,
        model_config=NS(
            hf_config=LlamaConfig(), is_draft_model=False, linear_attn_registry_result=None
        ),
        spec_algorithm=NS(is_standalone=lambda: False),
    )
    target = NS(model_runner=model_runner, get_memory_pool=lambda: pools,
                forward_batch_generation=forward)  # fmt: skip
    made = NGRAMWorker(server_args=None, gpu_id=0, nccl_port=0, target_worker=target)
    made.alloc_memory_pool()
    made.ngram_corpus.batch_put(corpus)
    made.ngram_corpus.synchronize()
    made.trees = trees
    return made


def request(rid: str, grammar: Any, prompt: list[int], output: list[int]) -> Any:
    """What the worker reads of a scheduled request."""
    return NS(rid=rid, grammar=grammar, origin_input_ids_unpadded=list(prompt),
              output_ids=list(output))  # fmt: skip


def step(made: Any, reqs: list, *, grammar: bool = True) -> Any:
    """One decode step of ``made`` over ``reqs``: its ``GenerationBatchResult``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    bs = len(reqs)
    seq_lens = torch.tensor([len(r.origin_input_ids_unpadded) + len(r.output_ids) for r in reqs])
    sampling = NS(
        vocab_size=_sgl.VOCAB, grammar_mask=None, acc_additive_penalties=None,
        acc_scaling_penalties=None, logit_bias=None, is_all_greedy=True,
        has_watermark_candidates=False,
    )  # fmt: skip
    batch = NS(
        reqs=reqs, forward_mode=ForwardMode.DECODE, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(), req_pool_indices=torch.arange(bs),
        req_to_token_pool=made.req_to_token_pool, has_grammar=grammar,
        grammar_needs_sync=lambda: True, spec_info=None, sampling_info=sampling,
        return_logprob=False, device="cpu", input_ids=None, out_cache_loc=None,
        hisparse_coordinator=None, mamba_track_indices=None,
    )  # fmt: skip
    return made.forward_batch_generation(batch)


def committed(result: Any, bs: int) -> list[list[int]]:
    """Per request, the tokens the step commits."""
    ids = result.next_token_ids.view(bs, -1)
    return [ids[b, : int(n)].tolist() for b, n in enumerate(result.accept_lens)]
