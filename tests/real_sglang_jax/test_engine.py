"""sglang-jax's engine on JAX CPU (SmolLM2, tests/real_sglang_jax/engine_run.py) with grammar
requests and the integration switched on the way a user does: ``PORTABLE_SPEC_SGLANG_JAX=1``
in the environment of the launch, the scheduler in the process sglang-jax spawns for it."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("sgl_jax")

import _sgl as S
from _engine import INSTALL_LINE


def check_outputs(report: dict, run: dict) -> int:
    """Every constrained output is a prefix its grammar accepts (a fresh matcher takes its
    tokens); finished ones parse and validate. Returns the number of finished ones."""
    from jsonschema import validate

    finished = 0
    cases = [report["cases"][i] for i in run.get("cases", range(len(report["cases"])))]
    for case, ids, text, finish in zip(cases, run["ids"], run["texts"], run["finish"], strict=True):
        oracle = S.oracle_for(case)
        if oracle is None:
            continue
        assert oracle.accepts(ids), (case, text)
        if finish["type"] != "stop":
            continue
        finished += 1
        if "json_schema" in case:
            validate(json.loads(text), json.loads(case["json_schema"]))
        else:
            assert re.fullmatch(case["regex"], text), text
    return finished


def test_the_switch_installs_the_integration_in_the_spawned_scheduler(spawned):
    _, log = spawned
    lines = [line for line in log.splitlines() if INSTALL_LINE in line]
    assert len(lines) == 1, log[-3000:]  # the scheduler's process, once; no other process


def test_grammar_requests_follow_their_grammar(spawned):
    report, _ = spawned
    assert check_outputs(report, report["runs"][0]) >= 1
