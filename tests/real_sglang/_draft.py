"""What the drafting tests and ``scripts/bench-sglang-drafting.py`` share: JSON documents of the
library's schema workloads, a scripted target model that writes them, a stand-in EAGLE draft
head, and sglang's EAGLE v2 draft worker driven step by step on CPU.

The draft worker is sglang's own ``EagleDraftWorker`` (its ``draft``, ``draft_forward``,
``select_top_k_tokens``, ``organize_draft_results``, ``build_eagle_verify_input`` with its
Triton kernel interpreted, and ``_draft_extend_for_decode``), built without its model: the
draft head is a stand-in whose logits are given (random, seeded), and the two batch
preparations that build sglang's model ``ForwardBatch`` (``prepare_for_draft``,
``prepare_for_draft_extend``) are replaced by stand-ins setting the fields the worker reads.
The verify step is sglang's ``run_eagle_verify`` (:func:`_eagle.run_verify`).
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace as NS
from typing import Any

import _eagle
import _sgl
import numpy as np
import torch

from portable_spec.testing import SCHEMA_WORKLOADS

#: three documents per workload of ``portable_spec.testing.SCHEMA_WORKLOADS`` (six in all),
#: in each schema's property order
DOCUMENTS: dict[str, list[dict[str, Any]]] = {
    "invoice": [
        {
            "invoice_number": "INV-204817",
            "issue_date": "2026-03-14",
            "currency_code": "USD",
            "payment_status": "pending",
            "billing_customer": {
                "customer_full_name": "Jane Doe",
                "customer_email_address": "jane.doe@example.com",
                "customer_account_type": "personal",
            },
            "invoice_line_items": [
                {
                    "item_description": "Plumbing work (hours)",
                    "item_quantity": 2,
                    "item_unit_price": 85.5,
                }
            ],
            "total_amount_due": 171.0,
        },
        {
            "invoice_number": "INV-000931",
            "issue_date": "2025-11-02",
            "currency_code": "EUR",
            "payment_status": "paid",
            "billing_customer": {
                "customer_full_name": "Marta Kowalska",
                "customer_email_address": "marta@kowalska.pl",
                "customer_account_type": "business",
            },
            "invoice_line_items": [
                {"item_description": "Pipe fittings", "item_quantity": 12, "item_unit_price": 3.2},
                {"item_description": "Call-out fee", "item_quantity": 1, "item_unit_price": 40},
            ],
            "total_amount_due": 78.4,
        },
        {
            "invoice_number": "INV-551203",
            "issue_date": "2026-01-30",
            "currency_code": "GBP",
            "payment_status": "overdue",
            "billing_customer": {
                "customer_full_name": "Tom Okafor",
                "customer_email_address": "tom.okafor@mail.co.uk",
                "customer_account_type": "personal",
            },
            "invoice_line_items": [
                {"item_description": "Boiler service", "item_quantity": 1, "item_unit_price": 120},
                {"item_description": "Valve", "item_quantity": 3, "item_unit_price": 14.75},
                {"item_description": "Labour (hours)", "item_quantity": 2, "item_unit_price": 60},
            ],
            "total_amount_due": 284.25,
        },
    ],
    "tool_call": [
        {
            "tool_call_type": "function",
            "function_name": "get_current_weather",
            "function_arguments": {
                "location_city_name": "Paris",
                "temperature_unit": "celsius",
                "include_hourly_forecast": False,
                "forecast_days_ahead": 3,
            },
        },
        {
            "tool_call_type": "function",
            "function_name": "get_current_weather",
            "function_arguments": {
                "location_city_name": "Buenos Aires",
                "temperature_unit": "fahrenheit",
                "include_hourly_forecast": True,
                "forecast_days_ahead": 10,
            },
        },
        {
            "tool_call_type": "function",
            "function_name": "get_current_weather",
            "function_arguments": {
                "location_city_name": "Osaka",
                "temperature_unit": "celsius",
                "include_hourly_forecast": True,
                "forecast_days_ahead": 1,
            },
        },
    ],
}


#: other documents of the same schemas: the n-gram corpus of the "with a corpus" runs
CORPUS_DOCUMENTS: dict[str, list[dict[str, Any]]] = {
    "invoice": [
        {
            "invoice_number": "INV-310442",
            "issue_date": "2026-02-09",
            "currency_code": "EUR",
            "payment_status": "cancelled",
            "billing_customer": {
                "customer_full_name": "Luc Martin",
                "customer_email_address": "luc.martin@example.fr",
                "customer_account_type": "business",
            },
            "invoice_line_items": [
                {"item_description": "Drain cleaning", "item_quantity": 1, "item_unit_price": 95},
            ],
            "total_amount_due": 95.0,
        },
        {
            "invoice_number": "INV-782215",
            "issue_date": "2025-12-21",
            "currency_code": "JPY",
            "payment_status": "paid",
            "billing_customer": {
                "customer_full_name": "Aiko Tanaka",
                "customer_email_address": "aiko.tanaka@example.jp",
                "customer_account_type": "personal",
            },
            "invoice_line_items": [
                {"item_description": "Faucet", "item_quantity": 2, "item_unit_price": 4800},
                {"item_description": "Installation", "item_quantity": 1, "item_unit_price": 6000},
            ],
            "total_amount_due": 15600,
        },
    ],
    "tool_call": [
        {
            "tool_call_type": "function",
            "function_name": "get_current_weather",
            "function_arguments": {
                "location_city_name": "Nairobi",
                "temperature_unit": "celsius",
                "include_hourly_forecast": False,
                "forecast_days_ahead": 7,
            },
        },
        {
            "tool_call_type": "function",
            "function_name": "get_current_weather",
            "function_arguments": {
                "location_city_name": "Denver",
                "temperature_unit": "fahrenheit",
                "include_hourly_forecast": True,
                "forecast_days_ahead": 2,
            },
        },
    ],
}


@dataclass
class Writer:
    """A request the scripted target writes: its document's tokens, its grammar (sglang's
    object, moved by the scheduler's part: :meth:`commit`) and what it committed so far."""

    rid: str
    workload: str
    prompt: list[int]
    document: list[int]
    grammar: Any
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False

    @property
    def origin_input_ids_unpadded(self) -> list[int]:  # what sglang's NGRAM worker reads
        return self.prompt

    def commit(self, tokens: list[int]) -> list[int]:
        """The scheduler's advance: the grammar accepts the step's tokens up to its end;
        the request finishes at its end token. Returns the tokens kept."""
        kept = []
        for token in tokens:
            if self.finished:
                break
            kept.append(token)
            if self.grammar is not None:
                self.grammar.accept_token(token)
                if self.grammar.is_terminated():
                    self.finished = True
            if token == _sgl.eos():
                self.finished = True
        self.output_ids.extend(kept)
        return kept


def document_tokens(document: dict[str, Any]) -> list[int]:
    """A document's tokens as SmolLM2's tokenizer segments its JSON text, then the end
    token."""
    text = json.dumps(document)
    return [*_sgl.tokenizer().encode(text, add_special_tokens=False), _sgl.eos()]


def writers(backend: str, count: int = 6, starts: tuple[int, ...] = ()) -> list[Writer]:
    """``count`` requests, the workloads' documents in turn, each with a fresh sglang grammar
    of its schema from ``backend``; request ``i`` has committed its document's first
    ``starts[i]`` tokens (none past ``starts``)."""
    out = []
    names = list(DOCUMENTS)
    for i in range(count):
        workload = names[i % len(names)]
        schema, prompt = SCHEMA_WORKLOADS[workload]
        made = _sgl.backend(backend).dispatch_json(json.dumps(schema))
        assert made is not None and type(made).__name__ != "InvalidGrammarObject", made
        tokens = _sgl.tokenizer().encode(prompt, add_special_tokens=False)
        document = document_tokens(DOCUMENTS[workload][(i // len(names)) % 3])
        writer = Writer(f"w{i}", workload, tokens, document, made)
        writer.commit(document[: starts[i] if i < len(starts) else 0])
        out.append(writer)
    return out


def corpus() -> list[list[int]]:
    """An n-gram corpus of other documents of the workloads' schemas (each after its prompt)."""
    encode = _sgl.tokenizer().encode
    return [
        encode(SCHEMA_WORKLOADS[name][1], add_special_tokens=False) + document_tokens(doc)
        for name, docs in CORPUS_DOCUMENTS.items()
        for doc in docs
    ]


# -- the scripted target -----------------------------------------------------------------------


def _noise(sequence: list[int], vocab: int) -> np.ndarray:
    """Logits noise that depends only on the sequence's last tokens."""
    seed = zlib.crc32(np.asarray(sequence[-4:], dtype=np.int64).tobytes())
    return np.random.default_rng(seed).standard_normal(vocab).astype(np.float32)


def target_logits(writers_: list[Writer], tree: tuple, vocab: int) -> torch.Tensor:
    """The scripted target's ``[batch * nodes, vocab]`` logits for a step's verify trees: at
    each node, the next token of the request's document (+12) if the committed tokens and the
    node's path are the document so far, over noise that depends only on the sequence. Its
    greedy output, masked or not, is therefore each request's document, whatever was drafted."""
    next_token, next_sibling, draft = (np.asarray(t) for t in tree)
    batch, nodes = draft.shape
    logits = np.empty((batch * nodes, vocab), dtype=np.float32)
    for b, w in enumerate(writers_):
        paths = _paths(next_token[b], next_sibling[b], draft[b])
        for j in range(nodes):
            sequence = [*w.output_ids, *paths[j]]
            row = logits[b * nodes + j]
            row[:] = _noise(sequence, vocab)
            n = len(sequence)
            if n < len(w.document) and sequence == w.document[:n]:
                row[w.document[n]] += 12.0
    return torch.from_numpy(logits)


def _paths(next_token: np.ndarray, next_sibling: np.ndarray, draft: np.ndarray) -> list:
    """Each node's draft tokens from the root (the root's path is empty; unreached: [])."""
    paths: list[list[int]] = [[] for _ in range(len(draft))]
    stack = [0]
    while stack:
        p = stack.pop()
        c = int(next_token[p])
        while c != -1:
            paths[c] = [*paths[p], int(draft[c])]
            stack.append(c)
            c = int(next_sibling[c])
    return paths


# -- sglang's EAGLE v2 draft worker, its model stood in for ---------------------------------------

HIDDEN = 8


class Head:
    """The stand-in draft head: random logits (seeded per call), so that its drafts are random
    tokens, or random tokens among those the grammar allows once its logits are masked."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def forward(self, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        n = int(forward_batch.input_ids.numel())
        self.calls += 1
        logits = torch.from_numpy(self.rng.standard_normal((n, self.vocab)).astype(np.float32))
        output = NS(next_token_logits=logits, hidden_states=torch.zeros(n, HIDDEN))
        return NS(logits_output=output)


def draft_worker(topk: int, steps: int, nodes: int, vocab: int, seed: int) -> Any:
    """sglang's ``EagleDraftWorker`` without its model: the stand-in head, no CUDA graphs."""
    from sglang.srt.speculative.eagle_utils import TreeMaskMode
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    worker = object.__new__(EagleDraftWorker)
    head = Head(vocab, seed)
    worker.draft_runner = NS(
        forward=head.forward,
        model_config=NS(hf_config=NS(architectures=["LlamaForCausalLMEagle"]),
                        model_is_mrope=False),
        canary_manager=None,
        spec_algorithm=NS(is_standalone=lambda: False),
    )  # fmt: skip
    worker.head = head
    worker.topk, worker.speculative_num_steps = topk, steps
    worker.speculative_num_draft_tokens = nodes
    worker.hot_token_id = None
    worker.draft_attn_backend = NS(attn_backends=[None] * steps,
                                   init_forward_metadata=lambda forward_batch: None)  # fmt: skip
    worker.index_share_for_mtp_iteration = False
    worker.seed_dsa_topk_from_draft_extend = False
    worker.cuda_graph_runner = None
    worker.cuda_graph_runner_for_draft_extend = None
    worker.req_to_token_pool = None
    worker.device = "cpu"
    worker.tree_mask_mode = TreeMaskMode.QLEN_ONLY
    worker.plan_stream, worker.plan_stream_ctx = None, contextlib.nullcontext()
    worker.target_worker = NS(model_runner=NS(
        kv_index_translator=None, attn_backend=NS(verify_mask=None, max_context_len=4096)
    ))  # fmt: skip
    worker._topk1_parents_prealloc = torch.zeros(0)
    return worker


@contextlib.contextmanager
def stand_in_preparations() -> Iterator[None]:
    """sglang's model-batch preparations of the draft worker module (``prepare_for_draft``,
    ``prepare_for_draft_extend``, the prefill extend's ``ForwardBatch.init_new``) replaced by
    stand-ins for the test's duration (none is patched by the plugin)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative import eagle_worker_v2 as module

    def prepare_for_draft(draft_input, req_to_token_pool, batch, cuda_graph_runner,
                          draft_model_runner, topk, num_steps, **kwargs):  # fmt: skip
        bs = len(batch.seq_lens)
        forward_batch = NS(
            forward_mode=ForwardMode.DECODE, spec_info=draft_input, batch_size=bs,
            out_cache_loc=torch.arange(bs * topk * num_steps), input_ids=None,
            positions=batch.seq_lens.repeat_interleave(topk), sampling_info=batch.sampling_info,
            mark_forward_metadata_ready=lambda: None, moe_num_token_non_padded=None,
        )  # fmt: skip
        return forward_batch, False, None

    def prepare_for_draft_extend(draft_extend_input, batch, predict, num_draft_tokens,
                                 draft_model_runner, cuda_graph_runner, **kwargs):  # fmt: skip
        return NS(input_ids=predict, spec_info=draft_extend_input,
                  forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=len(batch.seq_lens))  # fmt: skip

    class ForwardBatch:  # the prefill extend's: the last position of each request
        @staticmethod
        def init_new(batch, model_runner, **kwargs):
            ends = torch.tensor(batch.extend_lens).cumsum(0) - 1
            return NS(input_ids=batch.input_ids[ends], forward_mode=ForwardMode.EXTEND,
                      batch_size=len(batch.reqs))  # fmt: skip

    names = ("prepare_for_draft", "prepare_for_draft_extend", "ForwardBatch")
    saved = [getattr(module, name) for name in names]
    for name, value in zip(
        names, (prepare_for_draft, prepare_for_draft_extend, ForwardBatch), strict=True
    ):
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(module, name, value)


def first_draft_input(worker: Any, writers_: list[Writer], vocab: int) -> Any:
    """The draft input the prefill leaves: sglang's ``_draft_extend_for_prefill`` over the
    requests' prompts and committed tokens, the last committed token as the target's
    (stand-in preparations: :func:`stand_in_preparations`)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    texts = [[*w.prompt, *w.output_ids] for w in writers_]
    batch = NS(
        reqs=writers_, forward_mode=ForwardMode.EXTEND, extend_lens=[len(t) - 1 for t in texts],
        input_ids=torch.tensor([t for text in texts for t in text[:-1]]),
        chunked_req_next_prompt_token=None, chunked_req=None,
        seq_lens=torch.tensor([len(t) for t in texts]), has_grammar=True,
        sampling_info=NS(vocab_size=vocab, is_all_greedy=True),
    )  # fmt: skip
    hidden = torch.zeros(int(batch.input_ids.numel()), HIDDEN)
    last = torch.tensor([text[-1] for text in texts], dtype=torch.int64)
    worker.speculative_algorithm = NS(is_standalone=lambda: False)
    return worker._draft_extend_for_prefill(batch, hidden, last)


def decode_batch(writers_: list[Writer], spec: Any, vocab: int) -> Any:
    """What sglang's draft reads of a scheduled decode batch."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    seq_lens = torch.tensor([len(w.prompt) + len(w.output_ids) for w in writers_])
    sampling = NS(vocab_size=vocab, is_all_greedy=True, grammar_mask=None)
    return NS(
        reqs=writers_, spec_info=spec, forward_mode=ForwardMode.DECODE, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(), seq_lens_sum=None, sampling_info=sampling,
        has_grammar=any(w.grammar is not None for w in writers_), device="cpu",
    )  # fmt: skip


def eagle_step(worker: Any, writers_: list[Writer], spec: Any, vocab: int) -> tuple:
    """One EAGLE v2 step of sglang's own code over the batch: ``draft``, the scripted target's
    verify (``run_eagle_verify``), ``_draft_extend_for_decode``. Returns ``(verify_input,
    committed tokens per request, the next draft input)``; the grammars are not moved."""
    batch = decode_batch(writers_, spec, vocab)
    verify_input = worker.draft(batch)
    tree = _eagle.tree_of(verify_input)
    logits = target_logits(writers_, tree, vocab)
    result = _eagle.run_verify(verify_input, writers_, logits, topk=worker.topk)
    nodes = worker.speculative_num_draft_tokens
    committed = _committed(result, nodes)
    result.prepared_draft_extend_inputs = None
    extend_batch = NS(reqs=writers_, seq_lens=batch.seq_lens, forward_mode=batch.forward_mode,
                      has_grammar=batch.has_grammar, sampling_info=batch.sampling_info)  # fmt: skip
    worker._draft_extend_for_decode(extend_batch, result)
    return verify_input, committed, result.next_draft_input


def _committed(result: Any, nodes: int) -> list[list[int]]:
    ids = result.next_token_ids.view(-1, nodes)
    return [ids[b, : int(n)].tolist() for b, n in enumerate(result.accept_lens)]


# -- sglang's NGRAM worker around the scripted target --------------------------------------------


def ngram_worker(corpus_: list[list[int]], vocab: int) -> Any:
    """A fresh sglang ``NGRAMWorker`` (sglang's server arguments must say NGRAM) whose corpus
    holds ``corpus_`` and whose target model is the scripted writer of each batch's
    :class:`Writer` requests (:func:`target_logits`); its memory pools are stand-ins, the
    model's tokenizer SmolLM2's. ``worker.trees`` records the verify trees the worker's
    kernel derived from its tree masks."""
    from sglang.srt.speculative.ngram_worker import NGRAMWorker
    from transformers import LlamaConfig

    slots = 8
    req_to_token = torch.arange(slots * 1024, dtype=torch.int32).view(slots, 1024)
    kv = NS(move_kv_cache=lambda target, source: None)
    pools = (NS(req_to_token=req_to_token), NS(get_kvcache=lambda: kv))
    trees: list = []

    def forward(batch: Any, pp_proxy_tensors: Any = None, is_verify: bool = False) -> Any:
        verify_input = batch.spec_info
        shape = verify_input.retrieve_next_token.shape
        tree = (verify_input.retrieve_next_token.clone(),
                verify_input.retrieve_next_sibling.clone(),
                verify_input.draft_token.view(shape).clone())  # fmt: skip
        trees.append(tree)
        logits = target_logits(batch.reqs, tree, vocab)
        return NS(logits_output=NS(next_token_logits=logits, hidden_states=None),
                  can_run_cuda_graph=False)  # fmt: skip

    model_runner = NS(
        max_running_requests=slots, watermark_state=None,
        model_config=NS(hf_config=LlamaConfig(), is_draft_model=False,
                        linear_attn_registry_result=None),
        spec_algorithm=NS(is_standalone=lambda: False),
    )  # fmt: skip
    target = NS(model_runner=model_runner, get_memory_pool=lambda: pools,
                forward_batch_generation=forward, tokenizer=_sgl.tokenizer())  # fmt: skip
    made = NGRAMWorker(server_args=None, gpu_id=0, nccl_port=0, target_worker=target)
    made.alloc_memory_pool()
    if corpus_:
        made.ngram_corpus.batch_put(corpus_)
    made.ngram_corpus.synchronize()
    made.trees = trees
    return made


def ngram_step(worker: Any, writers_: list[Writer]) -> list[list[int]]:
    """One decode step of sglang's ``NGRAMWorker.forward_batch_generation`` over the
    requests not finished: the tokens each commits (the grammars are not moved)."""
    import _ngram

    result = _ngram.step(worker, writers_)
    return _ngram.committed(result, len(writers_))
