"""One structured-output step of tpu-inference's runner, from tpu-inference's and vLLM's code.

The runner is tpu-inference's ``TPUModelRunner`` class with the attributes its constructor
would compute for this configuration (``object.__new__``: the constructor itself loads a
model and claims TPU devices); its input batch is tpu-inference's ``InputBatch`` holding
``CachedRequestState`` records. A step's layout comes from tpu-inference's own functions:
``TPUModelRunner._prepare_input_metadata`` (requests per data-parallel rank, paddings) and
``SpeculativeDecodingManager.get_spec_decode_metadata`` (logits indices, draft targets,
bonus rows), fed as ``_prepare_inputs`` feeds them. The grammar rows come from vLLM 0.32's
own ``StructuredOutputManager.grammar_bitmask`` over vLLM's xgrammar wrappers, on SmolLM2's
tokenizer. Only the logits are made up (random, with chosen tokens raised).
"""

from __future__ import annotations

import json
import os
import random
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.environ.get("PORTABLE_SPEC_VLLM_MODEL", os.path.join(ROOT, ".vllm-model"))
VOCAB = 49152  # SmolLM2's logits width, a multiple of 32
EOS = 0  # SmolLM2's <|endoftext|>
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        },
        "required": ["ok", "tags"],
        "additionalProperties": False,
    },
]
REGEX = r"(yes|no), [0-9]{1,3}\."


@dataclass
class Grammars:
    """xgrammar over SmolLM2's tokenizer: the compiled grammars (JSON schemas and a regex)."""

    info: Any
    compiled: list[Any]
    stops: frozenset[int]  # the tokenizer's stop tokens (EOS among them)


def grammars() -> Grammars:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info)
    compiled = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in SCHEMAS]
    compiled.append(compiler.compile_regex(REGEX))
    return Grammars(info, compiled, frozenset(info.stop_token_ids) | {EOS})


@dataclass
class Req:
    """A request of the step: its grammar's state (``prefix``: the tokens it consumed), the
    drafts scheduled for it, and its prompt (a request still prefilling has no drafts and
    ``prefill`` scheduled tokens)."""

    req_id: str
    compiled: Any | None  # None: no grammar
    prefix: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    prefill: int = 0
    wrapper: Any = None  # vLLM's XgrammarGrammar, in the state after ``prefix``


# -- the runner ---------------------------------------------------------------------------------
def make_runner(tpu: Any, max_num_reqs: int, num_spec: int) -> Any:
    """tpu-inference's ``TPUModelRunner`` for one CPU device: the attributes its constructor
    computes for ``max_num_seqs = max_num_reqs`` and ``num_spec`` speculative tokens (0: none)."""
    from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES_2D
    from tpu_inference.layers.jax.sample.rejection_sampler import RejectionSampler
    from tpu_inference.runner import utils as runner_utils
    from tpu_inference.runner.input_batch import InputBatch
    from tpu_inference.runner.speculative_decoding_manager import SpeculativeDecodingManager
    from tpu_inference.runner.structured_decoding_manager import StructuredDecodingManager

    runner = object.__new__(tpu.TPUModelRunner)
    runner.mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), MESH_AXIS_NAMES_2D)
    runner.dp_size = 1
    runner.max_num_reqs = max_num_reqs
    runner.vocab_size = VOCAB
    runner.block_size = 16
    runner.max_model_len = 512
    runner.pcp_preprocessor = None
    runner.enable_continue_decode = False
    runner.maybe_forbid_compile = nullcontext()
    runner.speculative_config = (
        SimpleNamespace(num_speculative_tokens=num_spec, method="ngram") if num_spec else None
    )
    runner.num_tokens_paddings = runner_utils.build_token_paddings(
        min_token_size=16, max_token_size=1024, padding_gap=0
    )
    runner.num_tokens_paddings_per_dp = list(runner.num_tokens_paddings)
    runner.max_num_tokens = runner.num_tokens_paddings[-1]
    runner.arange_cpu = np.arange(runner.max_num_tokens, dtype=np.int64)
    runner.num_reqs_paddings = runner_utils.get_req_paddings(
        min_req_size=runner_utils.MIN_NUM_SEQS, max_req_size=max_num_reqs
    )
    runner.num_reqs_paddings_per_dp = list(runner.num_reqs_paddings)
    runner.attn_num_reqs_paddings_per_dp = [max_num_reqs]
    runner.num_logits_paddings = (
        runner_utils.get_token_paddings(
            min_token_size=runner_utils.MIN_NUM_SEQS,
            max_token_size=max_num_reqs * (num_spec + 1),
            padding_gap=0,
        )
        if num_spec
        else None
    )
    runner.grammar_bitmask_cpu = np.zeros((max_num_reqs, -(-VOCAB // 32)), dtype=np.int32)
    runner.require_structured_out_cpu = np.zeros((max_num_reqs, 1), dtype=np.bool_)
    runner.structured_decode_arange = np.arange(0, 32, dtype=np.int32)
    runner.input_batch = InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=runner.max_model_len,
        max_num_batched_tokens=runner.max_num_tokens,
        pin_memory=False,
        vocab_size=VOCAB,
        block_sizes=[runner.block_size],
        is_spec_decode=bool(num_spec),
        num_speculative_tokens=num_spec,
    )
    runner.requests = {}
    runner.execute_model_state = None
    runner._continue_decode_output = None
    runner.rejection_sampler = RejectionSampler(runner.mesh)
    runner.structured_decoding_manager = StructuredDecodingManager(runner)
    runner.speculative_decoding_manager = SpeculativeDecodingManager(runner)
    return runner


# -- vLLM's rows ----------------------------------------------------------------------------------
def vllm_manager(num_spec: int, max_num_seqs: int) -> Any:
    """vLLM 0.32's ``StructuredOutputManager`` (its class and methods; the fields its
    ``grammar_bitmask`` reads)."""
    import torch
    import xgrammar as xgr
    from vllm.v1.structured_output import StructuredOutputManager

    manager = object.__new__(StructuredOutputManager)
    manager.vllm_config = SimpleNamespace(
        num_speculative_tokens=num_spec,
        model_config=SimpleNamespace(is_diffusion=False),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )
    manager.backend = SimpleNamespace(
        allocate_token_bitmask=lambda n: xgr.allocate_token_bitmask(n, VOCAB)
    )
    manager._grammar_bitmask = None
    manager._full_mask = torch.tensor(-1, dtype=torch.int32)
    manager.fill_bitmask_parallel_threshold = 128
    manager.enable_in_reasoning = False
    manager.reasoner_cls = None
    manager.tokenizer = None
    return manager


def vllm_request(req: Req) -> Any:
    """vLLM's view of a request for ``grammar_bitmask``: its ``StructuredOutputRequest``."""
    from vllm.v1.structured_output.request import StructuredOutputRequest

    state = StructuredOutputRequest(params=None)
    state.grammar = req.wrapper
    return SimpleNamespace(
        request_id=req.req_id,
        structured_output_request=state,
        use_structured_output=True,
        is_prefill_chunk=False,
    )


# -- random requests ----------------------------------------------------------------------------
def _allowed(matcher: Any) -> np.ndarray:
    import xgrammar as xgr

    bits = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bits, 0)
    row = bits[0].numpy().view(np.uint32)
    ids = np.flatnonzero((row[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
    return ids[ids < VOCAB]


def random_request(
    rng: random.Random, req_id: str, g: Grammars, num_spec: int, kind: str, full: bool = False
) -> Req:
    """A request in a random state. ``kind``: ``free`` (no grammar), ``prefill`` (a grammar,
    a prompt being prefilled, no drafts), or a grammar with up to ``num_spec`` drafts (with
    ``full``, ``num_spec`` unless the grammar ends first) that the grammar ``valid``-ly
    accepts, ``refused`` (the last one refused), ``eos`` (ending in EOS) or ``padded`` (a
    ``-1`` tail, as vLLM schedules rejected n-gram positions)."""
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    if kind == "free":
        length = rng.randrange(num_spec + 1)
        return Req(req_id, None, drafts=[rng.randrange(1, VOCAB) for _ in range(length)])
    compiled = rng.choice(g.compiled)
    matcher = xgr.GrammarMatcher(compiled)
    prefix: list[int] = []
    for _ in range(rng.randrange(10)):
        allowed = [t for t in _allowed(matcher).tolist() if t not in g.stops]
        if not allowed:
            break
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        prefix.append(token)
    wrapper = XgrammarGrammar(vocab_size=VOCAB, matcher=xgr.GrammarMatcher(compiled), ctx=compiled)
    for token in prefix:
        assert wrapper.accept_tokens(req_id, [token])
    if kind == "prefill":
        return Req(req_id, compiled, prefix, [], rng.randrange(2, 40), wrapper)
    drafts: list[int] = []
    length = num_spec if full else rng.randrange(num_spec + 1)
    while len(drafts) < length and not matcher.is_terminated():
        allowed = _allowed(matcher).tolist()
        if kind == "eos" and EOS in allowed:
            drafts.append(EOS)
            break
        allowed = [t for t in allowed if t not in g.stops]
        if not allowed:
            break
        if kind == "refused" and len(drafts) == length - 1:
            taken = set(allowed)
            drafts.append(next(t for t in rng.sample(range(1, VOCAB), 512) if t not in taken))
            break
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        drafts.append(token)
    if kind == "padded" and drafts:
        cut = rng.randrange(len(drafts))
        drafts = drafts[:cut] + [-1] * (len(drafts) - cut)
    return Req(req_id, compiled, prefix, drafts, 0, wrapper)


KINDS = ("valid", "valid", "refused", "eos", "padded", "free", "prefill")


def random_batch(rng: random.Random, g: Grammars, num_spec: int, size: int) -> list[Req]:
    """``size`` requests with unsorted string ids ("r10" sorts before "r2"), every kind mixed,
    at least one with a grammar."""
    numbers = rng.sample(range(1, 40), size)
    kinds = [rng.choice(KINDS) for _ in range(size)]
    if all(k == "free" for k in kinds):
        kinds[0] = "valid"
    return [
        random_request(rng, f"r{n}", g, num_spec, k) for n, k in zip(numbers, kinds, strict=True)
    ]


# -- the step -------------------------------------------------------------------------------------
@dataclass
class Step:
    """A step ready for ``sample_tokens``: the runner's state, vLLM's grammar output, and for
    every logits row its owner ``(request, position)`` read from tpu-inference's own logits
    indices (position ``j``: the row after ``j`` drafts; None: a padding row)."""

    runner: Any
    reqs: dict[str, Req]
    state: Any  # tpu-inference's ExecuteModelState
    grammar_output: Any  # vLLM's GrammarOutput
    owners: list[tuple[str, int] | None]
    logits: jax.Array  # on the runner's mesh (donated by the patched structured_decode_fn)
    logits_host: np.ndarray  # the same values, kept for the checks
    input_ids: jax.Array


def build_step(
    runner: Any,
    tpu: Any,
    batch: list[Req],
    rng: random.Random,
    mask_source: str = "vllm",
) -> Step:
    """Put ``batch`` in the runner's input batch (in the given order), schedule it in a
    shuffled order (vLLM's), and build the step's state and grammar output as tpu-inference
    and vLLM do. ``mask_source``: ``vllm`` (vLLM's own fill) or ``plugin`` (the vLLM plugin's
    build inside the same ``grammar_bitmask`` call)."""
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata
    from tpu_inference.runner import utils as runner_utils
    from tpu_inference.runner.input_batch import CachedRequestState
    from tpu_inference.utils import device_array
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, GrammarOutput, SchedulerOutput

    ib = runner.input_batch
    for req in batch:  # tpu-inference's persistent batch, in this order
        prompt = [5 + i % 50 for i in range(max(req.prefill, 3))]
        state = CachedRequestState(
            req_id=req.req_id,
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=SamplingParams(temperature=0.0),
            pooling_params=None,
            block_ids=([0],),
            num_computed_tokens=0 if req.prefill else len(prompt),
            lora_request=None,
            output_token_ids=[] if req.prefill else [7],
        )
        runner.requests[req.req_id] = state
        ib.add_request(state)
    vllm_order = list(batch)
    rng.shuffle(vllm_order)  # the scheduler's order, unrelated to the runner's
    scheduled = {r.req_id: (r.prefill or 1 + len(r.drafts)) for r in vllm_order}
    spec_tokens = {r.req_id: list(r.drafts) for r in vllm_order if r.drafts}
    sched = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens=spec_tokens,
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        has_structured_output_requests=True,
    )
    # tpu-inference's own step layout, fed as its _prepare_inputs feeds it
    (
        req_ids_dp,
        req_indices_dp,
        _,
        scheduled_per_rank,
        _,
        padded_tokens_per_rank,
        padded_num_reqs,
        _,
        _,
        padded_reqs_per_rank,
        selector,
        _,
        max_reqs_per_rank,
    ) = runner._prepare_input_metadata(sched)
    n = ib.num_reqs
    query_start_loc = np.zeros(runner.max_num_reqs + 1, dtype=np.int32)
    np.cumsum(scheduled_per_rank[0], out=query_start_loc[1 : n + 1])
    query_start_loc[n + 1 :] = query_start_loc[n]
    input_ids = np.zeros(padded_tokens_per_rank, dtype=np.int32)
    by_id = {r.req_id: r for r in batch}
    for i, req_id in enumerate(req_ids_dp[0]):
        req = by_id[req_id]
        tokens = [5] * req.prefill if req.prefill else [7, *req.drafts]
        input_ids[query_start_loc[i] : query_start_loc[i + 1]] = tokens
    meta = None
    if runner.speculative_config is not None:
        num_drafts = np.zeros(n, dtype=np.int32)
        for req_id, drafts in spec_tokens.items():
            num_drafts[ib.req_id_to_index[req_id]] = len(drafts)
        total = int(sum(num_drafts[req_indices_dp[0]] + 1))
        padded_logits = runner_utils.get_padded_token_len(runner.num_logits_paddings, total)
        meta = runner.speculative_decoding_manager.get_spec_decode_metadata(
            num_draft_tokens_dp=num_drafts,
            dp_size=1,
            req_indices_dp=req_indices_dp,
            req_ids_dp=req_ids_dp,
            query_start_loc=query_start_loc,
            padded_num_reqs_per_dp_rank=padded_reqs_per_rank,
            padded_logits_length_dp_rank=padded_logits,
            max_num_reqs_per_dp_rank=max_reqs_per_rank,
        )
        logits_indices = np.asarray(meta.final_logits_indices)[:total]
    else:
        logits_indices = query_start_loc[1 : n + 1] - 1
    num_logits = padded_logits if meta is not None else padded_num_reqs
    # owner of every logits row, from the input position it reads
    owner_of_position: list[tuple[str, int]] = []
    for i, req_id in enumerate(req_ids_dp[0]):
        count = int(query_start_loc[i + 1] - query_start_loc[i])
        req = by_id[req_id]
        first_sampled = count - 1 - len(req.drafts)  # the row after the last committed token
        owner_of_position += [(req_id, k - first_sampled) for k in range(count)]
    owners: list[tuple[str, int] | None] = [None] * num_logits
    for row, position in enumerate(logits_indices.tolist()):
        owners[row] = owner_of_position[position]
    # vLLM's rows: structured requests in the scheduler's order, as vLLM's scheduler lists them
    structured_ids = [r.req_id for r in vllm_order if r.compiled is not None]
    num_spec = runner.speculative_config.num_speculative_tokens if runner.speculative_config else 0
    manager = vllm_manager(num_spec, runner.max_num_reqs)
    requests = {r.req_id: vllm_request(r) for r in vllm_order if r.compiled is not None}
    bitmask = _vllm_rows(manager, requests, structured_ids, spec_tokens, mask_source)
    grammar_output = GrammarOutput(structured_ids, bitmask)
    # on the runner's mesh, as its compute_logits_fn leaves them (and as its precompilation
    # puts its dummy inputs there)
    # (a copy: the patched structured_decode_fn donates the logits, and on CPU JAX may use
    # the numpy memory in place)
    logits_host = _logits(rng, num_logits, owners, by_id)
    logits, ids_on_mesh = device_array(runner.mesh, (logits_host.copy(), input_ids))
    sampling = TPUSupportedSamplingMetadata.from_input_batch(
        runner.mesh, ib, padded_num_reqs, req_indices_dp=req_indices_dp
    )
    state = tpu.ExecuteModelState(
        scheduler_output=sched,
        attn_metadata=None,
        shared_attn_metadata=None,
        sampling_metadata=sampling,
        input_ids=ids_on_mesh,
        hidden_states=None,
        logits=logits,
        aux_hidden_states=None,
        spec_decode_metadata=meta,
        kv_connector_output=None,
        logits_indices_selector=selector,
        padded_num_reqs=padded_num_reqs,
        req_ids_dp=req_ids_dp,
        padded_num_scheduled_tokens_per_dp_rank=padded_tokens_per_rank,
    )
    return Step(runner, by_id, state, grammar_output, owners, logits, logits_host, ids_on_mesh)


def _vllm_rows(
    manager: Any, requests: dict, ids: list[str], spec: dict, mask_source: str
) -> np.ndarray:
    from vllm.v1.structured_output import StructuredOutputManager

    from portable_spec.integrations import vllm as plugin

    if mask_source == "plugin":
        assert plugin.install("on")
    try:
        rows = StructuredOutputManager.grammar_bitmask(manager, requests, ids, spec)
    finally:
        if mask_source == "plugin":
            plugin.uninstall()
    return np.array(rows, copy=True)  # vLLM reuses its buffer next step; the runner gets a copy


def _logits(rng: random.Random, num_logits: int, owners: list, by_id: dict[str, Req]) -> np.ndarray:
    """Random logits; on each request row, its next draft raised by 8 (so the rejection sampler
    accepts it where the mask allows it) and a random token raised by 6 (which a right mask
    almost always bans)."""
    gen = np.random.default_rng(rng.randrange(1 << 30))
    logits = gen.standard_normal((num_logits, VOCAB), dtype=np.float32)
    for row, owner in enumerate(owners):
        logits[row, gen.integers(1, VOCAB)] += 6.0
        if owner is None:
            continue
        req_id, j = owner
        drafts = by_id[req_id].drafts
        if j < len(drafts) and drafts[j] >= 0:
            logits[row, drafts[j]] += 8.0
    return logits
