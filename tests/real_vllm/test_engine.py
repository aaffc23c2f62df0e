"""End to end through real vLLM: ``LLM.generate`` with n-gram speculative decoding.

One engine start per structured-output backend (each in its own process, engine core
in-process); the plugin is switched off, on and to shadow between generate calls on that
engine. Greedy outputs with the plugin on must be token-identical to vLLM's own (plugin
off), valid for their schema or regex, and the shadow mode must compare rows and find none
differing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ngram_engine import run_report  # noqa: E402
from prompts import DATE_REGEX, prompts_for  # noqa: E402

BATCHES = [1, 16]


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def run(request, tmp_path_factory):
    backend = request.param
    out = tmp_path_factory.mktemp(backend) / "report.json"
    env = dict(os.environ, PORTABLE_SPEC_VLLM="off")
    return run_report("engine_run.py", [backend, str(out)] + [str(b) for b in BATCHES], out, env)


def test_plugin_outputs_are_vllms_own(run):
    for batch in BATCHES:
        off, on = run["runs"][f"off/{batch}"], run["runs"][f"on/{batch}"]
        assert on["tokens"] == off["tokens"], f"batch {batch}: outputs differ"
        assert run["runs"][f"shadow/{batch}"]["tokens"] == off["tokens"]
    stats = run["runs"]["on/stats"]
    assert stats["built"] > 0 and stats["fallback_steps"] == 0
    if run["backend"] == "guidance":  # its short path, said once in vLLM's log
        assert run["log"].count("written by llguidance's own chain fill") == 1


def test_shadow_finds_no_differing_row(run):
    stats = run["runs"]["shadow/stats"]
    assert stats["rows_compared"] > stats["calls"] > 0  # drafts were scheduled: several rows
    assert stats["rows_differing"] == 0
    assert "rows differ from vLLM's" not in run["log"]


def test_outputs_follow_their_constraint(run):
    from jsonschema import validate

    finished = 0
    for batch in BATCHES:
        out = run["runs"][f"on/{batch}"]
        for case, text, finish in zip(prompts_for(batch), out["texts"], out["finish"], strict=True):
            if finish != "stop":  # cut by max_tokens: a prefix, nothing to validate
                continue
            finished += 1
            schema = case["constraint"].get("json")
            if schema is not None:
                validate(json.loads(text), schema)
            else:
                assert re.fullmatch(DATE_REGEX, text), text
    assert finished >= (1 + 16) // 2


def test_the_entry_point_reaches_a_separate_engine_core(tmp_path):
    """vLLM's default: the engine core in its own process. Only the entry point can patch it
    there (PORTABLE_SPEC_VLLM=shadow); its per-call log lines report the rows it compared."""
    out = tmp_path / "report.json"
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        PORTABLE_SPEC_VLLM="shadow",
        PORTABLE_SPEC_VLLM_LOG_EVERY="1",
        PORTABLE_SPEC_TEST_MODES="shadow",
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "engine_run.py"), "xgrammar", str(out), "16"],
        env=env,
        capture_output=True,
        text=True,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summaries = re.findall(r"rows compared (\d+), differing (\d+)", log)
    assert summaries, log[-4000:]
    compared, differing = map(int, summaries[-1])
    assert compared > 16 and differing == 0
    assert "rows differ from vLLM's" not in log
