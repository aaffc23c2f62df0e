"""The whole EAGLE loop of sglang-jax on JAX CPU with the integration: its engine, SmolLM2 as
the target, a random-weight EAGLE-3 head as the drafter (tests/real_sglang_jax/cpu_harness.py
gives native attention the EAGLE metadata), chains (topk 1) and trees (topk 2), grammar
requests batched with a free one.

With speculation the outputs equal the non-speculative run's (the spawned engine of
test_engine.py) token for token; every verify step is masked; the drafting masks raise the
accepted tokens per step; without the integration sglang-jax's scheduler stops on the first
speculative step of a grammar request (``accept_token`` given a list).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sgl_jax")

from _engine import MAX_NEW_TOKENS, eagle3, launch
from test_engine import check_outputs


def run(tmp_path_factory, name: str, config: dict) -> dict:
    report, log, code = launch(tmp_path_factory.mktemp(name), config)
    if report is None:
        pytest.fail(f"engine run failed ({code}):\n{log[-6000:]}")
    return report


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """EAGLE-3 chains: 3 steps, 4 verify nodes; drafting masks on, off, on again (the third
    call's grammars are cache hits of sglang-jax's grammar backend: each request's own copy)."""
    return run(tmp_path_factory, "chain",
               eagle3(1, 3, 4, max_new_tokens=MAX_NEW_TOKENS, drafting=[True, False, True]))  # fmt: skip


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """EAGLE-3 trees: top-2 per level, 3 steps, 4 verify nodes."""
    return run(tmp_path_factory, "tree", eagle3(2, 3, 4, max_new_tokens=MAX_NEW_TOKENS))


def same_outputs(run: dict, reference: dict) -> list[int]:
    """The requests whose output differs from the reference's: token for token, except that a
    speculative step may commit past ``max_new_tokens`` (sglang-jax stops after the step), so
    a request the reference cut at its length only has to begin with the reference."""
    differing = []
    for b, (ids, ref, finish) in enumerate(
        zip(run["ids"], reference["ids"], reference["finish"], strict=True)
    ):
        same = ids[: len(ref)] == ref if finish["type"] == "length" else ids == ref
        if not same:
            differing.append(b)
    return differing


def test_chains_commit_what_plain_decoding_commits(chain, spawned):
    reference, _ = spawned
    for each in chain["runs"]:
        assert same_outputs(each, reference["runs"][0]) == [], each["drafting"]


def test_trees_commit_what_plain_decoding_commits(tree, spawned):
    reference, _ = spawned
    assert same_outputs(tree["runs"][0], reference["runs"][0]) == []


def test_every_verify_step_is_masked_and_grammar_valid(chain, tree):
    for report in (chain, tree):
        for each in report["runs"]:
            stats = each["stats"]
            assert stats["verify_steps"] >= stats["grammar_steps"] > 0
            assert stats["masked_steps"] == stats["grammar_steps"]
            assert stats["refused_requests"] == 0
            check_outputs(report, each)


def test_drafting_masks_raise_the_accepted_tokens_per_step(chain):
    per_step = {}
    for each in chain["runs"]:
        stats = each["stats"]
        per_step[each["drafting"]] = stats["accepted_tokens"] / stats["constrained_verifies"]
    print(f"accepted tokens per constrained verify: {per_step}")
    assert per_step[True] > per_step[False]


def test_without_the_integration_the_first_speculative_grammar_step_fails(tmp_path):
    config = eagle3(1, 3, 4, max_new_tokens=4, case_indices=[1])
    config["install"] = False
    report, log, code = launch(tmp_path, config)
    assert report is None and code != 0
    assert "'list' object cannot be interpreted as an integer" in log
