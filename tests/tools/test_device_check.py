"""``scripts/device-check.sh --cpu``: the GPU proof's script, run here so that it cannot rot.

Runs the whole check without a GPU, with the private install rehearsed (``--install``): every
part must report, the GPU-only sections as skipped, the CPU ones with real figures, and the
correctness part must have run and passed. Never asserts a speed: under ``--cpu`` no part has a
time limit of its own, and the check passes beside four busy processes. Slow (minutes): run
with ``-m slow`` (CI does).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.devicecheck.driver import PARTS

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("torch")
pytest.importorskip("jax")
pytestmark = pytest.mark.slow
#: a guard against a hang only: above the check's own total limit and its install's
HANG_GUARD_S = 3 * 3600


def _run_check(out: Path, *options: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    for name in ("XLA_FLAGS", "JAX_PLATFORMS", "PORTABLE_SPEC_VOCAB"):
        env.pop(name, None)  # the test suite's settings are not the check's
    return subprocess.run(
        ["bash", str(ROOT / "scripts/device-check.sh"), "--cpu", *options, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_GUARD_S,
    )


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-check")
    done = _run_check(out, "--install")
    payload = json.loads((out / "device-check.json").read_text())
    return done, payload, out


def test_exits_zero_and_writes_both_reports(check):
    done, payload, out = check
    log = (out / "device-check.log").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log[-3000:]
    assert payload["exit_code"] == 0 and payload["mode"] == "cpu"
    machine = payload["machine"]
    assert machine["gpu"] is None and machine["usable_cores"] >= 1
    assert machine["versions"]["xgrammar"] and machine["versions"]["torch"]
    report = (out / "device-check.md").read_text()
    assert "**PASSED**" in report
    for part in PARTS:
        assert f"| {part.name} |" in report


def test_every_part_reports_a_status(check):
    _, payload, _ = check
    assert list(payload["parts"]) == [p.name for p in PARTS]
    for name, part in payload["parts"].items():
        assert part["status"] in ("passed", "skipped"), (name, part)
        assert part["wall_s"] <= part["limit_s"] + 5


def test_correctness_ran_the_cpu_matrix(check):
    _, payload, _ = check
    part = payload["parts"]["correctness"]
    assert part["status"] == "passed"
    suites = {s["suite"]: s for s in part["suites"]}
    matrix = suites["backend matrix"]
    assert matrix["args"] == ["--backend=numpy", "--backend=torch-cpu", "--backend=jax-cpu"]
    for name in ("backend matrix", "torch backend", "jax backend"):
        assert suites[name]["status"] == "passed"
        assert suites[name]["counts"]["passed"] > 0 and suites[name]["counts"]["failed"] == 0
    # the CUDA-only tests skip here, with the reason the GPU run turns into a failure
    assert "needs a CUDA device" in suites["cuda tests"]["skip_reasons"]


def test_gpu_sections_skip_and_cpu_sections_measure(check):
    _, payload, _ = check
    parts = payload["parts"]
    torch_sections = parts["timings.torch"]["sections"]
    assert torch_sections["upload"] == {
        "status": "skipped",
        "reason": "no CUDA device",
        "records": [],
        "checks": [],
    }
    assert parts["timings.overlap"]["status"] == "skipped"
    assert parts["timings.overlap"]["sections"]["overlap"]["reason"] == "no CUDA device"
    measured = [
        ("timings.torch", "staging"),
        ("timings.torch", "apply"),
        ("timings.jax", "staging"),
        ("timings.jax", "upload"),
        ("timings.jax", "apply"),
    ]
    for part, section in measured:
        entry = parts[part]["sections"][section]
        assert entry["status"] == "ok" and entry["records"], (part, section)
        assert entry["checks"] and all(c["ok"] for c in entry["checks"])
        for record in entry["records"]:
            assert all(_positive(v) for v in record["seconds"].values()), record
    apply = parts["timings.torch"]["sections"]["apply"]["records"]
    assert {(r["rows"], r["vocab"], r["dtype"]) for r in apply} == {
        (64, 131072, "bfloat16"),
        (64, 131072, "float32"),
    }


def test_scaling_measures_every_usable_thread_count(check):
    _, payload, _ = check
    part = payload["parts"]["scaling"]
    section = part["sections"]["scaling"]
    cores = payload["parts"]["environment"]["sections"]["host"]["records"][0]["usable_cores"]
    wanted = [str(k) for k in (1, 2, 4, 8, 16) if k <= cores]
    assert section["records"]
    for record in section["records"]:
        assert list(record["threads"]) == wanted
        assert _positive(record["xgr_loop_ms"])
        for figures in record["threads"].values():
            assert all(_positive(v) for v in figures.values())
        assert record["threads"]["1"]["speedup"] == 1.0
    assert all(c["ok"] for c in section["checks"])


def test_install_was_rehearsed_without_touching_the_environment(check):
    _, payload, _ = check
    project = payload["prepare"]["project"]
    assert project["method"] in ("pip", "copy")
    packages = payload["parts"]["environment"]["sections"]["packages"]
    assert all(c["ok"] for c in packages["checks"])  # torch, jax, numpy not from the site
    files = packages["records"][0]["files"]
    assert files["portable_spec"].startswith(payload["prepare"]["site"])


def test_parts_have_no_time_limit_of_their_own_under_cpu(check):
    """Only the total limit (a hang guard) applies: each part's limit is what was left of it."""
    _, payload, _ = check
    assert payload["total_limit_s"] >= 1800
    assert payload["calibration"]["factor"] >= 1
    left = payload["total_limit_s"]
    for part in payload["parts"].values():
        assert part["limit_s"] <= left + 1e-6
        assert part["limit_s"] >= left - part["wall_s"] - 60  # at most the time spent before
        left -= part["wall_s"]
    for suite in payload["parts"]["correctness"]["suites"]:
        assert suite["limit_s"] >= 600, suite


@pytest.fixture
def busy_processes():
    """Four CPU-bound processes (on a 2-core machine: a load of 4 on top of the check)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(4)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_passes_beside_four_busy_processes(busy_processes, tmp_path):
    """A slow part is not a failed part: with four busy processes beside it the check still
    passes, every part passed or skipped, none killed."""
    done = _run_check(tmp_path)
    assert all(p.poll() is None for p in busy_processes)  # the load was there throughout
    payload = json.loads((tmp_path / "device-check.json").read_text())
    log = (tmp_path / "device-check.log").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log[-3000:]
    assert payload["exit_code"] == 0
    statuses = {name: part["status"] for name, part in payload["parts"].items()}
    assert set(statuses) == {p.name for p in PARTS}
    assert set(statuses.values()) <= {"passed", "skipped"}, statuses
    assert statuses["correctness"] == "passed"
