"""The independent reference: each logits row's grammar row by a per-position walk on a fresh
matcher, and tpu-inference's own sampling of the masked logits.

Shares no code with the integration. For a request whose grammar consumed ``prefix`` and
whose drafts are ``d``, the row at position ``j`` (the logits row after ``j`` drafts) follows
vLLM 0.32's rule: with ``p`` the first ``-1`` padding position, rows after ``p`` allow
everything; after the first draft the grammar refuses (at position ``f``), every later row
repeats row ``f``; otherwise row ``j`` is the mask of a fresh matcher that accepted
``prefix + d[:j]`` (everything allowed once that matcher is terminated).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from steps import EOS, VOCAB, Req, Step

ALL_ALLOWED = None  # a row that leaves the logits as they are


def _fresh(req: Req, tokens: list[int]) -> Any:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(req.compiled)
    for token in tokens:
        assert matcher.accept_token(token), f"{req.req_id}: the replay refused {token}"
    return matcher


def _mask(matcher: Any) -> np.ndarray:
    """bool [VOCAB]: the tokens the matcher allows."""
    import xgrammar as xgr

    bits = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bits, 0)
    row = bits[0].numpy().view(np.uint32)
    return ((row[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool).reshape(-1)[:VOCAB]


def expected_rows(req: Req) -> list[np.ndarray | None]:
    """Per position ``0 .. len(drafts)``: the allowed tokens (bool [VOCAB]), or None for a
    row that allows everything."""
    drafts = req.drafts
    k = len(drafts)
    padding = next((i for i, t in enumerate(drafts) if t < 0), k)
    refused = None
    for i in range(padding):
        matcher = _fresh(req, req.prefix + drafts[:i])
        if matcher.is_terminated() or not matcher.accept_token(drafts[i]):
            refused = i
            break
    rows: list[np.ndarray | None] = []
    for j in range(k + 1):
        at = j if refused is None or j <= refused else refused
        if refused is None and at > padding:
            rows.append(ALL_ALLOWED)
            continue
        matcher = _fresh(req, req.prefix + drafts[:at])
        rows.append(ALL_ALLOWED if matcher.is_terminated() else _mask(matcher))
    return rows


def misplaced_rows(step: Step, masked: np.ndarray) -> list[str]:
    """Every logits row whose masked values differ from its own request's row at its own
    position applied to the step's logits (rows of unconstrained requests and padding rows:
    from the logits themselves). Returns one description per wrong row."""
    logits = step.logits_host
    expected_by_req = {
        req_id: expected_rows(req) for req_id, req in step.reqs.items() if req.compiled is not None
    }
    wrong = []
    for row, owner in enumerate(step.owners):
        allowed = None
        what = "padding"
        if owner is not None:
            req_id, j = owner
            what = f"request {req_id!r} position {j}"
            if req_id in expected_by_req:
                allowed = expected_by_req[req_id][j]
            else:
                what += " (no grammar)"
        want = logits[row] if allowed is None else np.where(allowed, logits[row], -np.inf)
        if not np.array_equal(masked[row], want):
            banned = np.isneginf(masked[row]) & ~np.isneginf(want)
            kept = ~np.isneginf(masked[row]) & np.isneginf(want)
            wrong.append(
                f"logits row {row} ({what}): {int(banned.sum())} tokens banned and "
                f"{int(kept.sum())} allowed that its own row does not"
            )
    return wrong


def constrained_rows(step: Step) -> int:
    """How many logits rows belong to a request with a grammar."""
    return sum(
        1 for owner in step.owners if owner is not None and step.reqs[owner[0]].compiled is not None
    )


def sample(step: Step, masked: Any) -> dict[str, list[int]]:
    """tpu-inference's own sampling of the masked logits, as its ``_sample_from_logits`` runs
    it for a greedy batch: bonus tokens by its ``sample`` on the bonus rows, then its
    ``RejectionSampler`` on the draft-target rows with the drafts read from the step's input
    ids, parsed by ``RejectionSampler.parse_output``. Without speculation: ``sample`` on every
    request's row. Returns each request's output tokens.

    tpu-inference compiles ``sample`` with XLA options only the TPU compiler knows (its
    SparseCore all-gather offload switches); here the same function is compiled without
    them (``jax.jit`` of ``sample.__wrapped__``, its source as shipped)."""
    import jax
    from tpu_inference.layers.jax.sample.rejection_sampler import RejectionSampler

    tpu_sample = _sample_on_cpu()

    runner, state = step.runner, step.state
    meta = state.spec_decode_metadata
    key = jax.random.key(0)
    sampling = state.sampling_metadata
    batch_ids = runner.input_batch.req_ids[: runner.input_batch.num_reqs]
    if meta is None:
        tokens, _ = tpu_sample(key, runner.mesh, masked, sampling)
        tokens = np.asarray(tokens)
        return {req_id: [int(tokens[i])] for i, req_id in enumerate(batch_ids)}
    select = type(runner)._select_from_array_fn
    bonus_logits = select(masked, meta.bonus_logits_indices, runner.mesh)
    bonus, _ = tpu_sample(key, runner.mesh, bonus_logits, sampling)
    target_logits = select(masked, meta.target_logits_indices, runner.mesh)
    drafts = runner._extract_draft_token_ids(
        step.input_ids, meta.final_logits_indices, meta.target_logits_indices
    )
    out = runner.rejection_sampler(
        draft_token_ids=drafts,
        num_draft_tokens=meta.draft_lengths,
        draft_probs=None,
        target_logits=target_logits,
        bonus_token_ids=bonus,
        sampling_metadata=sampling,
        key=key,
    )
    parsed = RejectionSampler.parse_output(
        jax.device_get(out),
        VOCAB,
        meta.draft_lengths_cpu,
        len(batch_ids),
        meta.final_logits_indices.shape[0],
        1,
        meta.req_indices_dp,
    )
    return {req_id: parsed[i] for i, req_id in enumerate(batch_ids)}


@functools.cache
def _sample_on_cpu() -> Any:
    import jax
    from tpu_inference.layers.jax.sample import sampling

    return jax.jit(
        sampling.sample.__wrapped__, static_argnames=["mesh", "allow_distributed_sampling"]
    )


def ungrammatical(step: Step, outputs: dict[str, list[int]]) -> list[str]:
    """Requests with a grammar whose output tokens (up to the first EOS) a fresh matcher that
    accepted the request's prefix refuses."""
    bad = []
    for req_id, tokens in outputs.items():
        req = step.reqs[req_id]
        if req.compiled is None:
            continue
        matcher = _fresh(req, req.prefix)
        for i, token in enumerate(tokens):
            if matcher.is_terminated():
                break  # the engine stops the request at its stop token
            if not matcher.accept_token(token):
                bad.append(f"request {req_id!r}: token {i} ({token}) of {tokens}")
                break
            if token == EOS:
                break
    return bad
