"""Part 1, correctness: the test files that need an accelerator, run with pytest.

:data:`SUITES` is the one list of what runs; add a file (or a glob) there. Each suite is one
pytest process (a CUDA fault in one cannot take the others' results with it), started with
``-p tools.devicecheck.pytest_record`` so that every test's outcome is on disk as soon
as it is known, even when the suite is killed at its time limit.

On the GPU machine a suite also fails when a test skipped because no GPU was found (reasons in
:data:`NO_GPU_REASONS`: give GPU-only tests one of those skip reasons), and when it must show
passing tests of a target (``gpu_must_pass``) and does not.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NO_GPU_REASONS", "SUITES", "Suite", "run_suite", "summarize_records"]


@dataclass(frozen=True)
class Suite:
    """One pytest run of the correctness part.

    Attributes:
        name: label in the report.
        paths: test files or globs, relative to the repository root.
        gpu_args, cpu_args: extra pytest arguments on the GPU machine / under ``--cpu``.
        gpu_must_pass: on the GPU machine, each of these strings must occur in the id of at
            least one passed test (e.g. a matrix target's name).
        typical_s: the suite's typical duration on a quiet machine, from which its time
            limit on the GPU machine is derived (:mod:`.limits`; none under ``--cpu``).
    """

    name: str
    paths: tuple[str, ...]
    gpu_args: tuple[str, ...] = ()
    cpu_args: tuple[str, ...] = ()
    gpu_must_pass: tuple[str, ...] = ()
    typical_s: float = 60.0


SUITES: tuple[Suite, ...] = (
    Suite(
        "backend matrix",
        ("tests/test_backend_matrix.py", "tests/test_compact_matrix.py"),
        gpu_args=("--backend=torch-cuda", "--backend=jax-gpu"),
        cpu_args=("--backend=numpy", "--backend=torch-cpu", "--backend=jax-cpu"),
        gpu_must_pass=("torch-cuda", "jax-gpu"),
        typical_s=90.0,
    ),
    Suite("torch backend", ("tests/test_torch_backend.py",), typical_s=60.0),
    Suite(
        "jax backend", ("tests/test_jax_backend.py", "tests/test_compact_jax.py"), typical_s=60.0
    ),
    # CUDA-specific tests: streams, pool reuse under load, xgrammar's CUDA and Triton kernels,
    # dtypes, odd vocabularies, strided and > 2**31-element logits
    Suite("cuda tests", ("tests/test_cuda_*.py",), typical_s=150.0),
    # grammar-aware drafting: a session's level rows on the accelerator's own arrays
    Suite(
        "drafting",
        ("tests/test_drafting.py",),
        gpu_args=("-k", "every_backend", "--backend=torch-cuda", "--backend=jax-gpu"),
        cpu_args=("-k", "every_backend", "--backend=numpy", "--backend=torch-cpu"),
        gpu_must_pass=("torch-cuda", "jax-gpu"),
        typical_s=60.0,
    ),
    # the sglang plugin against sglang's own mask build, masks on the GPU (from_device's CUDA
    # event, the pinned upload); runs where sglang's CUDA build is installed, else skips
    Suite(
        "sglang",
        (
            "tests/real_sglang/test_masks.py",
            "tests/real_sglang/test_chain.py",
            "tests/real_sglang/test_fill.py",
            "tests/real_sglang/test_plugin.py",
        ),
        gpu_args=("--confcutdir=tests/real_sglang",),
        cpu_args=("--confcutdir=tests/real_sglang",),
        typical_s=240.0,
    ),
)

#: skip reasons that mean "no GPU here": a failure on the GPU machine
NO_GPU_REASONS = ("no CUDA device", "needs a CUDA device", "has 0 gpu device", "needs a GPU")

RECORD_ENV = "PORTABLE_SPEC_CHECK_RECORD"
#: the checkout holding ``tools/``: the tools are not installed, and every process of the check
#: runs with ``-P`` (the installed library, never the checkout's, comes first)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def checkout_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: ``os.environ``) whose ``PYTHONPATH`` ends with the checkout
    (:data:`CHECKOUT`), so that a ``-P`` child finds ``tools`` but takes ``portable_spec`` from
    wherever it is installed first."""
    out = dict(os.environ if env is None else env)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if CHECKOUT not in paths:
        out["PYTHONPATH"] = os.pathsep.join([*paths, CHECKOUT])
    return out


def _files(root: str, patterns: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        found += sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern)))
    return list(dict.fromkeys(found))


def _read_lines(path: str) -> list[dict[str, Any]]:
    lines = []
    try:
        with open(path, encoding="utf-8") as f:
            for text in f:
                try:
                    lines.append(json.loads(text))
                except ValueError:  # a line cut short by a kill
                    continue
    except OSError:
        pass
    return lines


def summarize_records(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-test outcomes from the plugin's lines: counts, skip reasons, failures, and the
    test that had started but not finished (the one running when the suite was killed)."""
    outcome: dict[str, str] = {}
    reason: dict[str, str] = {}
    messages: dict[str, str] = {}
    started: list[str] = []
    collect_errors = []
    for line in lines:
        event, nodeid = line.get("event"), line.get("nodeid", "")
        if event == "start":
            started.append(nodeid)
        elif event == "collect":
            collect_errors.append({"nodeid": nodeid, "message": line.get("message", "")})
        elif event == "report":
            when, result = line.get("when"), line.get("outcome")
            if when == "call":
                if line.get("xfail"):
                    result = "xfailed" if result == "skipped" else "xpassed"
                if outcome.get(nodeid) != "error":
                    outcome[nodeid] = result
            elif result == "failed":
                outcome[nodeid] = "error"
            elif result == "skipped":
                outcome.setdefault(nodeid, "skipped")
            if result == "skipped" and "reason" in line:
                reason[nodeid] = line["reason"]
            if "message" in line:
                messages[nodeid] = line["message"]
    counts = Counter(outcome.values())
    unfinished = [n for n in started if n not in outcome]
    return {
        "counts": {
            k: counts.get(k, 0)
            for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
        },
        "skip_reasons": dict(Counter(reason[n] for n in outcome if outcome[n] == "skipped")),
        "failures": [
            {"nodeid": n, "outcome": o, "message": messages.get(n, "")[-1500:]}
            for n, o in outcome.items()
            if o in ("failed", "error")
        ],
        "collect_errors": collect_errors,
        "unfinished": unfinished,
        "passed_ids": [n for n, o in outcome.items() if o == "passed"],
    }


@dataclass
class SuiteRun:
    """What :func:`run_suite` found (``as_record`` is the JSON form)."""

    suite: Suite
    files: list[str]
    args: list[str]
    status: str = "passed"
    reasons: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    limit_s: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    summary: dict[str, Any] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        summary = {k: v for k, v in self.summary.items() if k != "passed_ids"}
        return {
            "suite": self.suite.name,
            "files": self.files,
            "args": self.args,
            "status": self.status,
            "reasons": self.reasons,
            "wall_s": round(self.wall_s, 2),
            "limit_s": round(self.limit_s, 1),
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            **summary,
        }


def run_suite(
    suite: Suite,
    *,
    root: str,
    python: str,
    gpu: bool,
    limit_s: float,
    work_dir: str,
    log: Any,
    env: dict[str, str] | None = None,
) -> SuiteRun:
    """Run one suite with pytest (blocks up to ``limit_s``; the whole process group is killed
    past it). ``log``: a text file receiving pytest's output."""
    files = _files(root, suite.paths)
    args = list(suite.gpu_args if gpu else suite.cpu_args)
    run = SuiteRun(suite, files, args, limit_s=limit_s)
    if not files:
        run.status = "skipped"
        run.reasons.append(f"no file matches {', '.join(suite.paths)}")
        return run
    record = os.path.join(work_dir, f"pytest-{suite.name.replace(' ', '-')}.jsonl")
    if os.path.exists(record):
        os.remove(record)
    command = [python, "-P", "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"]
    command += ["-m", "slow or not slow"]  # every test of the suite, slow ones included
    command += ["-p", "tools.devicecheck.pytest_record", *files, *args]
    child_env = dict(checkout_env(env), **{RECORD_ENV: record})
    log.write(f"\n===== suite {suite.name}: {' '.join(command)}\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=root, env=child_env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        run.returncode = proc.wait(timeout=max(1.0, limit_s))
    except subprocess.TimeoutExpired:
        run.timed_out = True
        kill_group(proc)
    run.wall_s = time.perf_counter() - start
    run.summary = summarize_records(_read_lines(record))
    _judge(run, gpu)
    return run


def kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s process group (it was started in a new session) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _judge(run: SuiteRun, gpu: bool) -> None:
    summary, counts = run.summary, run.summary["counts"]
    if run.timed_out:
        where = ", ".join(summary["unfinished"]) or "between tests"
        run.reasons.append(f"killed at its {run.limit_s:.0f} s limit (running: {where})")
    if counts["failed"] or counts["error"]:
        run.reasons.append(f"{counts['failed']} failed, {counts['error']} errors")
    if summary["collect_errors"]:
        run.reasons.append(f"{len(summary['collect_errors'])} collection errors")
    if not run.timed_out and run.returncode not in (0, 5):
        run.reasons.append(f"pytest exited with {run.returncode}")
    if gpu:
        for reason, count in summary["skip_reasons"].items():
            if any(marker in reason for marker in NO_GPU_REASONS):
                run.reasons.append(f"{count} GPU tests skipped on the GPU machine: {reason}")
        for target in run.suite.gpu_must_pass:
            if not any(target in nodeid for nodeid in summary["passed_ids"]):
                run.reasons.append(f"no passing test on {target}")
    ran = sum(counts.values())
    if run.reasons:
        run.status = "failed"
    elif ran == 0:
        run.status = "skipped"
        run.reasons.append("no tests ran")
