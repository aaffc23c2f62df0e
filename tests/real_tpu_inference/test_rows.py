"""tpu-inference's own runner, with the integration, masks every logits row with its own
request's grammar row for its own position; its own samplers then emit grammatical tokens.

Each step: tpu-inference's runner (``steps.make_runner``) holding a ragged batch (requests
with 0 to K drafts, with and without grammars, refused drafts, EOS, ``-1`` padding, a request
still prefilling) whose ids do not sort in vLLM's order; tpu-inference's spec-decode
metadata and logits layout (padding rows included); vLLM 0.32's own
``StructuredOutputManager.grammar_bitmask`` rows (or the vLLM plugin's build of them). The
masked logits are compared row by row with an independent per-position walk on fresh
matchers (``oracle``), then sampled by tpu-inference's ``sample`` and ``RejectionSampler``:
every request's tokens must be grammatical.

One stand-in in ``sample_tokens``: the runner's ``_sample_from_logits`` (everything after the
mask: sampling, the drafter's next proposal, the step's output) needs the engine's model,
KV cache and drafter; the test replaces it with a function that keeps what ``sample_tokens``
hands it, and samples those logits with tpu-inference's own samplers (``oracle.sample``).

With ``PORTABLE_SPEC_TPU_INFERENCE_TEST=off`` the same tests run on tpu-inference's own code
and fail: rows of other requests or positions, or its shape errors.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import oracle
import pytest
import steps

STEPS = 4  # random steps per configuration
TALLY = {"steps": 0, "logits rows": 0, "constrained rows": 0, "requests": 0, "sampled": 0}


def run_step(step: steps.Step, entry: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The masked logits of a step: through ``sample_tokens`` or the manager's two calls."""
    runner = step.runner
    runner.execute_model_state = step.state
    if entry == "sample_tokens":
        handed: list[tuple] = []

        def keep(self: Any, *args: Any) -> str:
            handed.append(args)
            return "sampled"

        monkeypatch.setattr(type(runner), "_sample_from_logits", keep)
        assert runner.sample_tokens(step.grammar_output) == "sampled"
        assert runner.execute_model_state is None
        (args,) = handed
        assert args[7] is step.state.spec_decode_metadata
        return args[5]  # the logits argument
    manager = runner.structured_decoding_manager
    first, second, third = manager.prepare_structured_decoding_input(
        step.logits, step.grammar_output
    )
    return manager.structured_decode_fn(first, second, step.logits, third)


def check_step(step: steps.Step, masked: Any) -> None:
    wrong = oracle.misplaced_rows(step, np.asarray(masked))
    assert not wrong, f"{len(wrong)} of {len(step.owners)} rows wrong:\n" + "\n".join(wrong[:12])
    outputs = oracle.sample(step, masked)
    bad = oracle.ungrammatical(step, outputs)
    assert not bad, "ungrammatical output:\n" + "\n".join(bad)
    TALLY["steps"] += 1
    TALLY["logits rows"] += len(step.owners)
    TALLY["constrained rows"] += oracle.constrained_rows(step)
    TALLY["requests"] += len(step.reqs)
    TALLY["sampled"] += sum(len(t) for t in outputs.values())


CASES = [
    pytest.param(k, room, entry, source, id=f"K{k}-{room}-{entry}-{source}")
    for k in (0, 1, 4)
    for room in ("tight", "roomy")
    for entry, source in (
        ("sample_tokens", "vllm"),
        ("sample_tokens", "plugin"),
        ("manager", "vllm"),
    )
]


@pytest.mark.parametrize(("num_spec", "room", "entry", "source"), CASES)
def test_each_logits_row_gets_its_own_grammar_row(
    tpu, grammars, integration, monkeypatch, num_spec, room, entry, source
):
    """``tight``: ``max_num_reqs`` 8, below the logits rows of a speculative step (16 to 64
    rows); ``roomy``: 64, above them."""
    rng = random.Random(f"{num_spec}/{room}/{entry}/{source}")
    max_num_reqs = 8 if room == "tight" else 64
    for _ in range(STEPS):
        runner = steps.make_runner(tpu, max_num_reqs, num_spec)
        batch = steps.random_batch(rng, grammars, num_spec, rng.randrange(1, 9))
        step = steps.build_step(runner, tpu, batch, rng, source)
        check_step(step, run_step(step, entry, monkeypatch))
