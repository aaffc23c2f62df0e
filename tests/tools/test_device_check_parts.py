"""The device check's pieces, without running the check: outcome parsing, part verdicts,
time limits, the private install and the wheel check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tools.bench.workloads import synthetic_tokens
from tools.devicecheck import limits, prepare, wheels
from tools.devicecheck.correctness import Suite, SuiteRun, _judge, run_suite
from tools.devicecheck.correctness import summarize_records as summarize
from tools.devicecheck.driver import PARTS, Options, part_status
from tools.devicecheck.results import PartRecorder, SkipSection, read_json
from tools.devicecheck.scaling import thread_counts

ROOT = Path(__file__).resolve().parents[2]


# -- pytest outcomes --------------------------------------------------------------------------


def _report(nodeid, when, outcome, **extra):
    return {"event": "report", "nodeid": nodeid, "when": when, "outcome": outcome, **extra}


def test_outcomes_from_plugin_lines():
    lines = [
        {"event": "start", "nodeid": "t::ok"},
        _report("t::ok", "call", "passed"),
        {"event": "start", "nodeid": "t::skip"},
        _report("t::skip", "setup", "skipped", reason="needs a CUDA device"),
        _report("t::bad", "call", "failed", message="E assert 1 == 2"),
        _report("t::teardown", "call", "passed"),
        _report("t::teardown", "teardown", "failed", message="boom"),
        _report("t::xf", "call", "skipped", xfail=True),
        {"event": "start", "nodeid": "t::hang"},
    ]
    got = summarize(lines)
    assert got["counts"] == {
        "passed": 1,
        "failed": 1,
        "error": 1,
        "skipped": 1,
        "xfailed": 1,
        "xpassed": 0,
    }
    assert got["skip_reasons"] == {"needs a CUDA device": 1}
    assert {f["nodeid"] for f in got["failures"]} == {"t::bad", "t::teardown"}
    assert got["unfinished"] == ["t::hang"]


def _run_with(lines, suite, gpu):
    run = SuiteRun(suite, ["t.py"], [], returncode=0, limit_s=10)
    run.summary = summarize(lines)
    _judge(run, gpu)
    return run


def test_gpu_run_fails_when_gpu_tests_skip_or_targets_never_pass():
    suite = Suite("matrix", ("t.py",), gpu_must_pass=("torch-cuda",))
    lines = [
        _report("t::a[torch-cuda-int32]", "setup", "skipped", reason="torch-cuda: no CUDA device"),
        _report("t::b[numpy]", "call", "passed"),
    ]
    on_cpu = _run_with(lines, suite, gpu=False)
    assert on_cpu.status == "passed", on_cpu.reasons
    on_gpu = _run_with(lines, suite, gpu=True)
    assert on_gpu.status == "failed"
    assert any("skipped on the GPU machine" in r for r in on_gpu.reasons)
    assert any("no passing test on torch-cuda" in r for r in on_gpu.reasons)
    fine = [_report("t::a[torch-cuda-int32]", "call", "passed")]
    assert _run_with(fine, suite, gpu=True).status == "passed"


def test_a_hanging_suite_is_killed_and_keeps_its_finished_tests(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_hang.py").write_text(
        textwrap.dedent(
            """
            import time

            def test_first():
                pass

            def test_second_hangs():
                time.sleep(600)
            """
        )
    )
    # a busy machine may not even reach the first test within a short limit: longer ones then
    for limit in (8, 30, 120, 600):
        with open(tmp_path / "log.txt", "w") as log:
            run = run_suite(
                Suite("hang", ("tests/test_*.py",)),
                root=str(tmp_path),
                python=sys.executable,
                gpu=False,
                limit_s=limit,
                work_dir=str(tmp_path),
                log=log,
            )
        if run.summary["counts"]["passed"] == 1:
            break
    assert run.timed_out and run.status == "failed"
    assert run.summary["counts"]["passed"] == 1
    assert run.summary["unfinished"] == ["tests/test_hang.py::test_second_hangs"]
    assert run.wall_s >= limit


def test_a_suite_without_files_is_skipped(tmp_path):
    run = run_suite(
        Suite("none", ("tests/test_cuda_*.py",)),
        root=str(tmp_path),
        python=sys.executable,
        gpu=True,
        limit_s=5,
        work_dir=str(tmp_path),
        log=None,
    )
    assert run.status == "skipped" and run.reasons == ["no file matches tests/test_cuda_*.py"]


# -- part results and verdicts ----------------------------------------------------------------


def test_recorder_keeps_going_after_a_section_fails(tmp_path):
    path = str(tmp_path / "part.json")
    rec = PartRecorder(path, "p", "cpu")
    with rec.section("a"):
        rec.add("a", {"x": np.float32(1.5), "y": np.arange(2)})
        rec.check("a", "agrees", True)
    with rec.section("b"):
        raise RuntimeError("kaput")
    with rec.section("c"):
        raise SkipSection("no CUDA device")
    data = read_json(path)
    assert data["sections"]["a"]["records"] == [{"x": 1.5, "y": [0, 1]}]
    assert data["sections"]["b"]["status"] == "error"
    assert data["sections"]["b"]["reason"] == "RuntimeError: kaput"
    assert data["sections"]["c"] == {
        "status": "skipped",
        "records": [],
        "checks": [],
        "reason": "no CUDA device",
    }
    assert not data["finished"]
    rec.finish()
    assert read_json(path)["finished"]
    assert part_status(read_json(path), 0, False)[0] == "error"


def _data(*statuses, checks=(), finished=True):
    sections = {
        f"s{i}": {"status": s, "records": [], "checks": list(checks)}
        for i, s in enumerate(statuses)
    }
    return {"finished": finished, "sections": sections}


def test_part_verdicts():
    bad = {"name": "apply equals", "ok": False, "detail": ""}
    assert part_status(_data("ok", "skipped"), 0, False) == ("passed", [])
    assert part_status(_data("skipped", "skipped"), 0, False)[0] == "skipped"
    assert part_status(_data("ok", checks=[bad]), 0, False)[0] == "failed"
    assert part_status(_data("ok", "running", finished=False), None, True) == (
        "timeout",
        ["killed at its time limit in s1"],
    )
    assert part_status(_data("ok", finished=False), -11, False)[0] == "error"
    assert part_status(None, None, True)[0] == "timeout"
    assert part_status(None, 1, False) == ("error", ["no results (exit code 1)"])


def _options(mode, factor, **limits_given):
    return Options(
        mode=mode, out="", work="", root="", total_s=limits.DEFAULT_TOTAL_S,
        limits=limits_given, parts=(), prepare_status=None, command=[], factor=factor,
    )  # fmt: skip


def test_cpu_parts_have_only_the_total_limit():
    """Under --cpu (CI, the test suite) a part may be as slow as it likes short of a hang."""
    assert limits.DEFAULT_TOTAL_S >= 1800
    options = _options("cpu", 1.0)
    for spec in PARTS:
        assert limits.scaled_limit(spec.typical_s, "cpu", 5.0) is None
        assert options.limit(spec.name, spec.typical_s, 1234.0) == 1234.0
        assert options.limit(None, spec.typical_s, 1234.0) == 1234.0
    assert _options("cpu", 1.0, scaling=30.0).limit("scaling", 60.0, 1234.0) == 30.0


def test_gpu_limits_scale_with_the_machine_and_leave_room_for_a_cold_run():
    quiet, busy = _options("gpu", 1.0), _options("gpu", 4.0)
    for spec in PARTS:
        floor = spec.typical_s * limits.HEADROOM + limits.COLD_START_S
        assert quiet.limit(spec.name, spec.typical_s, 10**6) == pytest.approx(floor)
        assert busy.limit(spec.name, spec.typical_s, 10**6) > 3 * floor - 3 * limits.COLD_START_S
        assert quiet.limit(spec.name, spec.typical_s, 5.0) == 5.0  # the total still caps it
    assert limits.HEADROOM >= 2 and limits.COLD_START_S >= 60
    assert _options("gpu", 0.5).limit(None, 100.0, 10**6) == pytest.approx(
        100.0 * limits.HEADROOM + limits.COLD_START_S
    )  # a fast machine never shortens a limit


def test_calibration_only_ever_lengthens():
    found = limits.calibrate(rounds=1)
    assert found["factor"] >= 1.0 and found["seconds"] > 0
    assert found["reference_s"] == limits.REFERENCE_S


def test_thread_counts_are_capped_by_the_cores():
    assert thread_counts((1, 2, 4, 8, 16), 16) == (1, 2, 4, 8, 16)
    assert thread_counts((1, 2, 4, 8, 16), 6) == (1, 2, 4)
    assert thread_counts((2, 4), 1) == (1,)


def test_synthetic_vocabulary():
    tokens = synthetic_tokens(5000)
    assert len(tokens) == len(set(tokens)) == 5000
    assert tokens[:2] == ["</s>", "<pad>"] and "\n" in tokens and "{" in tokens
    assert synthetic_tokens(5000) == tokens


# -- install and wheels -----------------------------------------------------------------------


def _wheel(folder, name, version, requires=()):
    path = Path(folder) / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_wheel_check_finds_what_neither_the_image_nor_the_wheels_give(tmp_path):
    _wheel(tmp_path, "xgrammar", "0.2.9", ["pydantic", "torch>=1.10", "apache-tvm-ffi>=0.1"])
    _wheel(tmp_path, "pydantic", "2.0", ["typing-extensions>=4", 'email-validator; extra == "e"'])
    assert wheels.missing_requirements(str(tmp_path)) == {
        "xgrammar-0.2.9-py3-none-any.whl": ["apache-tvm-ffi"]
    }
    _wheel(tmp_path, "apache_tvm_ffi", "0.1")
    _wheel(tmp_path, "pydantic", "2.1")
    assert wheels.missing_requirements(str(tmp_path)) == {"(several versions)": ["pydantic"]}


def test_wheels_the_image_has_at_that_version_are_kept(tmp_path):
    numpy_version = np.__version__
    _wheel(tmp_path, "numpy", "1.0.0")
    _wheel(tmp_path, "portable_spec_no_such_dist", "1.0")
    actions = {w["name"]: w["action"] for w in prepare.choose_wheels(str(tmp_path))}
    assert actions["numpy"] == f"kept the image's {numpy_version}"
    assert actions["portable_spec_no_such_dist"] == "install"


def test_copy_install_lays_out_the_package_like_pyproject(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    report = prepare.copy_project(str(ROOT), str(site))
    assert report["method"] == "copy"
    code = (
        "import json, portable_spec, portable_spec.backends.numpy as b, portable_spec.native as n\n"
        "print(json.dumps([portable_spec.__file__, b.__file__, n.native is not None]))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    done = subprocess.run(
        [sys.executable, "-P", "-c", code],
        cwd=ROOT,  # the source tree must not shadow the copy
        capture_output=True,
        text=True,
        env=env,
        timeout=600,  # a hang guard only
    )
    assert done.returncode == 0, done.stderr
    package, backend, native = json.loads(done.stdout)
    assert package == str(site / "portable_spec" / "__init__.py")
    assert backend == str(site / "portable_spec" / "backends" / "numpy" / "__init__.py")
    assert native == report["native"]


@pytest.mark.parametrize("text", ["4.16.0", "0.1.15.post2", "2.50.5", "10.0rc1"])
def test_version_keys_order_releases(text):
    assert prepare._version_key(text) < prepare._version_key("99.0")


# -- the GPU-only measurements' code, run on the CPU ------------------------------------------
# On the GPU machine these run on CUDA; here a CPU device runs the same code (tiny forward,
# one round), so that a change elsewhere cannot break them unseen until a GPU is lent.


@pytest.fixture
def quick_profile():
    import dataclasses

    from tools.bench.timing import RoundPlan
    from tools.devicecheck.profiles import CPU

    return dataclasses.replace(CPU, plan=RoundPlan(min_rounds=1, max_rounds=1, budget_s=0.0))


def test_overlap_measurement_runs_on_a_cpu_device(tmp_path, quick_profile):
    torch = pytest.importorskip("torch")
    from tools.devicecheck.overlap import VerifyStandIn, measure_overlap

    device = torch.device("cpu")
    rows = quick_profile.overlap_batch * quick_profile.nodes
    model = VerifyStandIn(
        rows, quick_profile.vocab, device, hidden=32, layers=1, matmuls=((32, 48), (32, 32))
    )
    assert model.forward().shape == (rows, quick_profile.vocab)
    rec = PartRecorder(str(tmp_path / "overlap.json"), "timings.overlap", "cpu")
    with rec.section("overlap"):
        measure_overlap(rec, quick_profile, device, model)
    entry = rec.data["sections"]["overlap"]
    assert entry["status"] == "ok", entry.get("traceback")
    assert entry["checks"] and all(c["ok"] for c in entry["checks"])
    (record,) = entry["records"]
    assert set(record["seconds"]) == {
        "forward + apply",
        "build",
        "serial",
        "library upload",
        "same-stream upload",
    }
    assert record["tokens"] == rows and record["forward_tflops"] > 0
    assert set(record["library upload"]) == {"hidden", "exposed_s"}
    report = _render(rec)
    assert "| library upload | 64 x 16 |" in report and "| same-stream upload |" in report


def test_upload_measurement_runs_on_a_cpu_device(tmp_path, quick_profile):
    torch = pytest.importorskip("torch")
    from tools.devicecheck.torch_timings import upload_one

    host = np.random.default_rng(0).integers(-(2**31), 2**31, (64, 4096)).astype(np.int32)
    rec = PartRecorder(str(tmp_path / "torch.json"), "timings.torch", "cpu")
    with rec.section("upload"):
        upload_one(rec, quick_profile, host, torch.device("cpu"))
    entry = rec.data["sections"]["upload"]
    assert entry["status"] == "ok", entry.get("traceback")
    assert all(c["ok"] for c in entry["checks"])
    (record,) = entry["records"]
    assert set(record["gb_per_s"]) == {"backend.upload", "pinned copy_", "pageable .to()"}
    assert record["bytes"] == host.nbytes
    assert "pinned copy_: " in _render(rec)


def _render(rec):
    """The Markdown report of a payload holding only ``rec``'s part."""
    from tools.devicecheck import report

    part = {"status": "passed", "reasons": [], "title": rec.data["part"], **rec.data}
    payload = {"mode": "cpu", "exit_code": 0, "parts": {rec.data["part"]: part}}
    return report.render(payload)


def test_run_rounds_times_with_the_given_timer():
    from tools.bench.timing import Method, RoundPlan, run_rounds

    calls = []

    def timer(call):
        call()
        return 0.25

    method = Method("m", lambda data: lambda: calls.append(data))
    seconds, inputs = run_rounds([method], lambda r: r, RoundPlan(3, 3, 0.0), timer=timer)
    assert seconds == {"m": [0.25, 0.25, 0.25]} and inputs == [0, 1, 2]
    assert calls == [-1, 0, 1, 2]  # the warm-up round, then the timed ones
