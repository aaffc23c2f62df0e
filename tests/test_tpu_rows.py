"""The tpu-inference integration's row map (numpy only), against a plain loop over the layouts.

tests/real_tpu_inference/ checks it inside tpu-inference's own runner; this covers what that
runner does not reach on one CPU device (several data-parallel ranks) and every refusal.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from portable_spec.integrations.tpu_inference.rows import map_rows


def _reference(ids, spec, ranks, drafts, num_logits):
    """{(request, position): logits row} from tpu-inference's layout, and the vLLM row of
    each (request, position) from vLLM's, by plain loops."""
    block = num_logits // len(ranks)
    logits_row = {}
    for r, members in enumerate(ranks):
        row = r * block
        for i, req_id in enumerate(members):
            count = 1 + (0 if drafts is None else int(drafts[r][i]))
            for j in range(count):
                logits_row[(req_id, j)] = row + j
            row += count
    vllm_row = {}
    row = 0
    for req_id in ids:
        for j in range(1 + len(spec.get(req_id, ()))):
            vllm_row[(req_id, j)] = row
            row += 1
    return logits_row, vllm_row, row


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("speculative", [False, True])
def test_every_row_lands_on_its_requests_position(dp, speculative):
    rng = random.Random(f"{dp}/{speculative}")
    for _ in range(50):
        names = [f"r{n}" for n in rng.sample(range(100), rng.randrange(1, 12))]
        ranks = [[] for _ in range(dp)]
        for name in names:
            ranks[rng.randrange(dp)].append(name)
        per_rank = max(len(m) for m in ranks) + rng.randrange(3)  # padded draft-count arrays
        counts = {name: rng.randrange(5) if speculative else 0 for name in names}
        drafts = None
        if speculative:
            drafts = [[counts[n] for n in m] + [0] * (per_rank - len(m)) for m in ranks]
        need = max(sum(1 + counts[n] for n in m) for m in ranks)
        num_logits = dp * (need + rng.randrange(4))
        structured = [n for n in names if rng.random() < 0.7]
        rng.shuffle(structured)  # vLLM's order
        missing = [f"gone{i}" for i in range(rng.randrange(2))]
        for name in missing:
            structured.insert(rng.randrange(len(structured) + 1), name)
        spec = {n: [rng.randrange(-1, 50)] * counts[n] for n in names if counts[n]}
        spec.update({name: [7] * rng.randrange(3) for name in missing})
        logits_row, vllm_row, total = _reference(structured, spec, ranks, drafts, num_logits)
        rows = map_rows(structured, spec, total, ranks, drafts, num_logits)
        assert rows.skipped == tuple(n for n in structured if n in missing)
        # the packed rows are vLLM's rows of the kept requests, through the spans
        packed_source = np.full(rows.rows, -1)
        for source, at, count in rows.spans:
            packed_source[at : at + count] = np.arange(source, source + count)
        assert (packed_source >= 0).all()
        want = np.full(num_logits, -1)
        for (req_id, j), source in vllm_row.items():
            if req_id not in missing:
                want[logits_row[(req_id, j)]] = source
        got = np.full(num_logits, -1)
        masked = rows.index < num_logits
        got[masked] = packed_source[rows.index[masked]]
        assert np.array_equal(got, want)
        assert rows.index.dtype == np.int32 and rows.index.shape == (num_logits,)


def test_refusals():
    ranks = [["a", "b"]]
    spec = {"a": [1, 2], "b": [3]}
    assert map_rows(["b", "a"], spec, 5, ranks, [[2, 1]], 8).rows == 5
    with pytest.raises(ValueError, match="has 4 rows, but"):
        map_rows(["b", "a"], spec, 4, ranks, [[2, 1]], 8)
    with pytest.raises(ValueError, match="twice"):
        map_rows(["a", "a"], spec, 6, ranks, [[2, 1]], 8)
    with pytest.raises(ValueError, match="logits hold 2 rows"):
        map_rows(["b", "a"], spec, 5, ranks, [[1, 1]], 8)
    with pytest.raises(ValueError, match="need 5 logits rows"):
        map_rows(["b", "a"], spec, 5, ranks, [[2, 1]], 4)
    with pytest.raises(ValueError, match="do not split"):
        map_rows(["b", "a"], spec, 5, [["a"], ["b"]], [[2], [1]], 7)


def test_install_without_tpu_inference_returns_false():
    """Where tpu-inference is not installed, ``install()`` says so by returning False (as
    sglang_jax.install() does), imports nothing of it and patches nothing."""
    import importlib.util
    import sys

    from portable_spec.integrations import tpu_inference

    if importlib.util.find_spec("tpu_inference") is not None:
        pytest.skip("tpu-inference is installed here (tests/real_tpu_inference covers it)")
    assert tpu_inference.install() is False
    assert "tpu_inference" not in sys.modules
    assert not tpu_inference.is_installed()
    tpu_inference.uninstall()  # nothing to give back: no error
