"""Forced drafts end to end through real vLLM: one engine (xgrammar, n-gram speculation
K=4, a reasoning parser), forced drafts off, on and in shadow mode over the same requests
(``forced_cases.py``), one ``generate`` call per kind of constraint (the sampled requests in
one of their own: ``forced_run.GROUPS`` says why). Greedy outputs token-identical to vLLM's own
and valid, in fewer forward steps; the forced tokens drafted and accepted; sampled requests get
them too; shadow mode schedules none."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

pytest.importorskip("vllm")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from forced_cases import CASES, GREEDY, REASONING  # noqa: E402
from ngram_engine import run_report  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("forced") / "report.json"
    env = dict(os.environ, PORTABLE_SPEC_VLLM="off")
    env.pop("PORTABLE_SPEC_FORCED_DRAFTS", None)
    return run_report("forced_run.py", [str(out)], out, env)


def test_greedy_outputs_are_vllms_own(run):
    off = run["runs"]["off"]
    for mode in ("on", "shadow"):
        got = run["runs"][mode]
        for i in GREEDY:
            assert got["tokens"][i] == off["tokens"][i], f"{mode}: case {i} differs"
            assert got["finish"][i] == off["finish"][i]


def test_forced_tokens_are_drafted_accepted_and_save_steps(run):
    on, off = run["runs"]["on"], run["runs"]["off"]
    stats = on["stats"]
    assert on["scheduler_wrapped"] and not off["scheduler_wrapped"]
    assert stats["forced_drafted"] > 0 and stats["forced_steps"] > 0
    assert 0 < stats["forced_accepted"] <= stats["forced_drafted"]
    assert stats["forced_refused_steps"] == 0
    # the greedy calls' outputs are vLLM's own (above): the same tokens in fewer forward steps
    assert on["greedy_steps"] < off["greedy_steps"]
    assert "forced drafts on (on, K=4)" in run["log"]


def test_shadow_mode_counts_and_changes_nothing(run):
    shadow = run["runs"]["shadow"]
    assert shadow["stats"]["forced_would_draft"] > 0
    assert shadow["stats"]["forced_drafted"] == 0 and shadow["extensions"] == []


def test_extensions_start_with_vllms_drafts_and_wait_for_the_reasoning_end(run):
    """Every extension keeps vLLM's drafts first; a request that reasons first gets forced
    tokens only once its output or vLLM's drafts hold the reasoning's end (the period), and
    the reasoning requests do get them after it."""
    events = run["runs"]["on"]["extensions"]
    assert events and all(case >= 0 for case, *_ in events)
    for case, ended, own, drafts in events:
        assert drafts[: len(own)] == own  # vLLM's drafts, extended
        assert len(drafts) <= 4
        if case in REASONING:
            assert ended, f"case {case}: drafts extended while still reasoning"
    assert REASONING and {case for case, *_ in events} & set(REASONING)


def _content(case, text):
    if CASES.index(case) in REASONING:  # the answer follows the first period
        return text.split(".", 1)[1] if "." in text else None
    return text


def test_outputs_follow_their_constraint(run):
    from jsonschema import validate

    checked = 0
    for mode in ("off", "on"):
        out = run["runs"][mode]
        for case, text, finish in zip(CASES, out["texts"], out["finish"], strict=True):
            content = _content(case, text)
            if finish != "stop" or case.get("stop") or content is None:
                continue  # cut by max_tokens or a stop string, or never answered: a prefix
            constraint = case["constraint"]
            if "json" in constraint:
                validate(json.loads(content), constraint["json"])
            elif "json_object" in constraint:
                assert isinstance(json.loads(content), dict)
            elif "regex" in constraint:
                assert re.fullmatch(constraint["regex"], content), content
            else:
                assert content in constraint["choice"], content
            checked += 1
    assert checked >= 8
    for i, (on, off) in enumerate(
        zip(run["runs"]["on"]["finish"], run["runs"]["off"]["finish"], strict=True)
    ):
        assert on != "error" or off == "error", f"case {i}: an error only with forced drafts"


def test_sampled_requests_get_forced_drafts_and_stay_valid(run):
    """n-gram drafts carry no draft probabilities: vLLM's rejection sampler takes each draft
    with the target's own probability of it, so a sampled request's drafts are extended too
    (its output distribution is unchanged; its text is checked above). Drafters that keep
    probabilities keep vLLM's drafts: test_forced_replay.py's configuration rule."""
    sampled = [i for i, c in enumerate(CASES) if c.get("temperature")]
    assert sampled
    extended = {case for case, *_ in run["runs"]["on"]["extensions"]}
    assert set(sampled) <= extended
