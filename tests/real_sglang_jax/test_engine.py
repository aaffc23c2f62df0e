"""sglang-jax's engine on JAX CPU (SmolLM2, tests/real_sglang_jax/engine_run.py) with grammar
requests and the integration switched on the way a user does: ``PORTABLE_SPEC_SGLANG_JAX=1``
in the environment of the launch, the scheduler in the process sglang-jax spawns for it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("sgl_jax")

HERE = os.path.dirname(os.path.abspath(__file__))
INSTALL_LINE = "portable_spec: grammar masks on sglang-jax's speculative verify"


def launch(tmp_path, config: dict, env: dict) -> tuple[dict, str]:
    out = tmp_path / "report.json"
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(HERE, "harness_site"), full_env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    full_env["PORTABLE_SPEC_SGLANG_JAX_CPU_HARNESS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-P", os.path.join(HERE, "engine_run.py"), str(out), json.dumps(config)],
        env=full_env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"engine run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text()), proc.stderr


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One engine launch, scheduler in its own process, the switch in the environment."""
    return launch(tmp_path_factory.mktemp("spawned"), {}, {"PORTABLE_SPEC_SGLANG_JAX": "1"})


def check_outputs(report: dict) -> int:
    from jsonschema import validate

    finished = 0
    run = report["runs"][-1]
    for case, text, finish in zip(report["cases"], run["texts"], run["finish"], strict=True):
        if finish["type"] != "stop":
            continue
        if "json_schema" in case:
            validate(json.loads(text), json.loads(case["json_schema"]))
            finished += 1
        elif "regex" in case:
            assert re.fullmatch(case["regex"], text), text
            finished += 1
    return finished


def test_the_switch_installs_the_integration_in_the_spawned_scheduler(spawned):
    _, log = spawned
    lines = [line for line in log.splitlines() if INSTALL_LINE in line]
    assert len(lines) == 1, log[-3000:]  # the scheduler's process, once; no other process


def test_grammar_requests_follow_their_grammar(spawned):
    report, _ = spawned
    assert check_outputs(report) >= 2
