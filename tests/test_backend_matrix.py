"""One suite, every backend: same inputs, same oracle, bit-identical masks and logits.

Targets (see ``_targets.py``): numpy, torch CPU, torch CUDA, JAX CPU on one device, JAX CPU
with 8 devices (batch-sharded and replicated trees), JAX GPU/TPU. ``pytest --backend=jax``
runs only the JAX targets; the summary at the end says which targets ran or why they were
skipped.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import xgrammar as xgr
from _cases import matrix_case
from _oracle import Request, expected_mask

import portable_spec as ps
from portable_spec.registry import backend_for

BATCH, NODES = 8, 6  # batch divisible by the 8 CPU devices of the sharded targets


@pytest.fixture
def batch_case(smollm2):
    """Eight requests (four grammars, an unconstrained one, one padded tree), EAGLE-like trees
    with real tokens: accepted, rejected, EOS, negative and too-large ids."""
    return matrix_case(smollm2, BATCH, NODES)


def _matchers(requests):
    return [None if r is None else r.fresh() for r in requests]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_stage_and_resolve(target, batch_case, dtype):
    _, nt, ns, dt, _ = batch_case
    tree = ps.GrammarTree.from_device(*(target.put(a.astype(dtype)) for a in (nt, ns, dt)))
    assert tree.backend.name == target.backend
    got = tree.resolve()
    for a, b in zip(got, (nt, ns, dt), strict=True):
        assert a.dtype == np.int64 and a.flags.c_contiguous
        np.testing.assert_array_equal(a, b)
    assert tree.resolve() is got  # cached, no second wait


def test_mask_bits(target, batch_case, smollm2):
    requests, nt, ns, dt, want = batch_case
    tree = ps.GrammarTree.from_device(*(target.put(a) for a in (nt, ns, dt)))
    mask = ps.build_grammar_vocab_mask(
        _matchers(requests), tree, smollm2.size, device=target.device()
    )
    assert backend_for(mask).name == target.backend
    target.check_placement(mask)
    host = target.get(mask)
    assert host.dtype == np.int32
    np.testing.assert_array_equal(host, want)


def test_linear_chain_from_device(target, batch_case, smollm2):
    requests, _, _, dt, _ = batch_case
    tree = ps.GrammarTree.from_linear_chain(target.put(dt))
    chain_nt = np.tile(np.append(np.arange(1, NODES), -1), (BATCH, 1))
    chain_ns = np.full((BATCH, NODES), -1)
    want = expected_mask(requests, chain_nt, chain_ns, dt, smollm2.size, smollm2.words)
    mask = ps.build_grammar_vocab_mask(_matchers(requests), tree, smollm2.size)
    np.testing.assert_array_equal(target.get(mask), want)


def test_row_capacity(target, batch_case, smollm2):
    """Padding goes to the end of every row shard (the whole mask on unsharded targets), so
    that each device keeps its own requests' rows."""
    requests, nt, ns, dt, want = batch_case
    tree = ps.GrammarTree.from_device(*(target.put(a) for a in (nt, ns, dt)))
    mask = ps.build_grammar_vocab_mask(_matchers(requests), tree, smollm2.size, row_capacity=64)
    host = target.get(mask)
    assert host.shape == (64, smollm2.words)
    parts = target.row_parts
    per_shard, own = 64 // parts, BATCH * NODES // parts
    for k in range(parts):
        shard = host[k * per_shard : (k + 1) * per_shard]
        np.testing.assert_array_equal(shard[:own], want[k * own : (k + 1) * own])
        assert (shard[own:] == -1).all()


def _reference_masked(logits: np.ndarray, mask: np.ndarray, vocab_size=None) -> np.ndarray:
    out = logits.astype(np.float64)
    covered = min(out.shape[1], 32 * mask.shape[1])
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :covered]
    out[:, :covered][bits == 0] = -np.inf
    if vocab_size is not None:
        out[:, vocab_size:] = -np.inf  # not tokens: banned in every row
    return out


@pytest.mark.parametrize("vocab", [49152, 49155, 100])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_masked_logits(target, batch_case, smollm2, vocab, dtype):
    """Kept logits are bit-identical, dropped ones -inf; logits padded past the mask (49155
    columns, 49152 tokens) need vocab_size=, and every column past it is -inf."""
    if dtype not in target.float_dtypes:
        pytest.skip(f"{target.name} does not run {dtype} logits")
    requests, nt, ns, dt, want = batch_case
    rng = np.random.default_rng(vocab)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    logits = (rng.standard_normal((BATCH * NODES, vocab)) * 3).astype(np_dtype)
    mask_np = want[:, : -(-vocab // 32)] if vocab < 32 * smollm2.words else want
    tree = ps.GrammarTree.from_device(*(target.put(a) for a in (nt, ns, dt)))
    mask = ps.build_grammar_vocab_mask(_matchers(requests), tree, smollm2.size)
    if vocab < 32 * smollm2.words:
        mask = target.put(mask_np)  # a mask as wide as these (narrow) logits
    padded = vocab > 32 * smollm2.words
    if padded:
        with pytest.raises(ValueError, match="the mask covers only 49152 tokens"):
            ps.apply_vocab_mask(target.put(logits), mask)
    vocab_size = smollm2.size if padded else None
    masked = target.get(ps.apply_vocab_mask(target.put(logits), mask, vocab_size=vocab_size))
    reference = _reference_masked(logits, mask_np, vocab_size)
    assert masked.dtype == logits.dtype
    np.testing.assert_array_equal(masked.astype(np.float64), reference)


def test_mixed_host_and_device_inputs(target, batch_case, smollm2):
    """Some arrays on the host (as engines that synthesize part of the tree there do)."""
    requests, nt, ns, dt, want = batch_case
    tree = ps.GrammarTree.from_device(nt, target.put(ns), target.put(dt))
    assert tree.backend.name == target.backend
    mask = ps.build_grammar_vocab_mask(_matchers(requests), tree, smollm2.size)
    np.testing.assert_array_equal(target.get(mask), want)


def test_masks_survive_later_steps(target, smollm2):
    """Build and upload many steps; every earlier device mask is checked afterwards against
    its own oracle (no step's mask changed by a later one: pinned-buffer reuse, JAX aliasing
    of host memory, pooled numpy buffers)."""
    rng = np.random.default_rng(2)
    compiled = smollm2.grammars["builtin_json"]
    opening = [smollm2.tokens.index(t) for t in ("{", "[", '"', "1", "Ġ")]
    kept = []
    for step in range(12):
        dt = rng.choice(opening, size=(BATCH, NODES))
        dt[:, 0] = 0
        requests = [Request(compiled) for _ in range(BATCH)]
        tree = ps.GrammarTree.from_linear_chain(target.put(dt))
        mask = ps.build_grammar_vocab_mask(_matchers(requests), tree, smollm2.size)
        want = expected_mask(requests, *tree.resolve(), smollm2.size, smollm2.words)
        kept.append((mask, want))
        if step % 3 == 0:
            kept.pop(0)  # some masks die, so their buffers are reused by later steps
    for mask, want in kept:
        np.testing.assert_array_equal(target.get(mask), want)


def test_bad_mask_for_logits(target):
    logits = target.put(np.zeros((8, 64), np.float32))
    with pytest.raises(ValueError, match="same rows"):
        ps.apply_vocab_mask(logits, target.put(np.zeros((16, 2), np.int32)))
    with pytest.raises(TypeError, match="int32"):
        ps.apply_vocab_mask(logits, target.put(np.zeros((8, 2), np.float32)))


def test_every_target_agrees(batch_case, smollm2, request):
    """The same batch through every available target gives one and the same mask."""
    from _targets import TARGETS

    requests, nt, ns, dt, want = batch_case
    results = {}
    for t in TARGETS:
        if t.skip_reason():
            continue
        tree = ps.GrammarTree.from_device(*(t.put(a) for a in (nt, ns, dt)))
        results[t.name] = t.get(
            ps.build_grammar_vocab_mask(_matchers(requests), tree, smollm2.size)
        )
    assert len(results) >= 3
    for name, got in results.items():
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_xgrammar_matchers_only_once_per_request(batch_case, smollm2):
    """Sanity: the oracle's requests compile real grammars (guards the fixture itself)."""
    requests, *_, want = batch_case
    assert sum(r is not None for r in requests) == 7
    assert (want != -1).any(axis=1).sum() >= 10
    assert isinstance(requests[0].fresh(), xgr.GrammarMatcher)


def test_reasoning_and_valid_nodes(target, batch_case, smollm2):
    """Reasoning requests and the valid-node array through every target: the same bits as
    the host build, and the valid array on the host."""
    requests, nt, ns, dt, _ = batch_case
    end = smollm2.tokens.index("<|im_start|>")
    dt = dt.copy()
    dt[:, 1] = np.where(np.arange(BATCH) % 2 == 0, end, dt[:, 1])  # half end their reasoning
    reasoning = ps.Reasoning(np.arange(BATCH) % 3 != 0, [end], [smollm2.tokens.index("{")])
    host = ps.GrammarTree.from_host(nt, ns, dt)
    want, want_valid = ps.build_host_bitmask(
        _matchers(requests), host, smollm2.size, reasoning=reasoning, return_valid=True
    )
    tree = ps.GrammarTree.from_device(*(target.put(a) for a in (nt, ns, dt)))
    mask, valid = ps.build_grammar_vocab_mask(
        _matchers(requests), tree, smollm2.size, reasoning=reasoning, return_valid=True
    )
    target.check_placement(mask)
    np.testing.assert_array_equal(target.get(mask), want)
    assert isinstance(valid, np.ndarray) and valid.dtype == np.bool_
    np.testing.assert_array_equal(valid, want_valid)
    assert (want != -1).any()
