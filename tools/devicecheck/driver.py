"""The check's driver: runs every part under its time limit and writes the two reports.

Parts run one after the other, each (but the correctness part, whose pytest suites are
processes of their own) in a fresh process started in a new session, so that a part that
hangs is killed with all its children at its limit and a part that crashes (a CUDA fault, a
segfault) takes nothing else with it. A part's results reach the driver through its JSON file,
rewritten after every section, so a killed part still reports what it finished. A total
deadline caps every limit; parts it leaves no time for are reported as not run. The limits
are hang guards, never speed checks (:mod:`.limits`: none of a part's own under ``--cpu``;
calibrated to the machine, with room for a cold first run, on the GPU machine).

``device-check.json`` and ``device-check.md`` are rewritten after every part: if the driver
itself is killed, they still describe the parts that finished.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from tools.devicecheck import report
from tools.devicecheck.correctness import SUITES, checkout_env, kill_group, run_suite
from tools.devicecheck.limits import calibrate, scaled_limit
from tools.devicecheck.results import read_json

__all__ = ["PARTS", "PartSpec", "machine_summary", "part_status", "run_check"]


@dataclass(frozen=True)
class PartSpec:
    """A part: its name, title, typical duration and module (with ``run(recorder, profile)``).

    ``typical_s``: how long the part takes on a quiet machine; its time limit on the GPU
    machine is derived from it (:func:`.limits.scaled_limit`).

    ``gate``: a part whose failure fails the check (exit code 1); other parts' errors and
    time-outs give exit code 2. Failed checks made while measuring always give 1.
    """

    name: str
    title: str
    typical_s: float
    module: str | None
    gate: bool = False


PARTS: tuple[PartSpec, ...] = (
    PartSpec("environment", "Environment", 60.0, "tools.devicecheck.environment", True),
    PartSpec("correctness", "Correctness (pytest)", 180.0, None, True),
    PartSpec("timings.torch", "Timings: torch", 50.0, "tools.devicecheck.torch_timings"),
    PartSpec("timings.jax", "Timings: JAX", 45.0, "tools.devicecheck.jax_timings"),
    PartSpec("timings.overlap", "Timings: overlap", 45.0, "tools.devicecheck.overlap"),
    PartSpec("scaling", "Thread scaling", 60.0, "tools.devicecheck.scaling"),
)
BY_NAME = {p.name: p for p in PARTS}
#: a part is started only with at least this many seconds left before the deadline
MIN_START_S = 10.0


def part_status(
    data: dict[str, Any] | None, returncode: int | None, timed_out: bool
) -> tuple[str, list[str]]:
    """``(status, reasons)`` of a part process from its result file and how it ended.

    Status, first that applies: ``failed`` (a check made while measuring failed), ``timeout``,
    ``error`` (a section raised, or the process died or ended early), ``skipped`` (every
    section skipped), ``passed``.
    """
    if data is None:
        reason = "killed at its time limit" if timed_out else f"exit code {returncode}"
        return ("timeout" if timed_out else "error"), [f"no results ({reason})"]
    sections = data.get("sections", {})
    reasons = []
    failed = [
        f"{name}: {c['name']}"
        for name, s in sections.items()
        for c in s.get("checks", [])
        if not c["ok"]
    ]
    if failed:
        reasons.append("failed checks: " + "; ".join(failed))
    errors = [f"{n}: {s.get('reason', '')}" for n, s in sections.items() if s["status"] == "error"]
    reasons += errors
    running = [n for n, s in sections.items() if s["status"] == "running"]
    if timed_out:
        reasons.append(
            "killed at its time limit" + (f" in {', '.join(running)}" if running else "")
        )
    elif not data.get("finished"):
        reasons.append(data.get("error", f"ended early (exit code {returncode})"))
    if failed:
        return "failed", reasons
    if timed_out:
        return "timeout", reasons
    if errors or not data.get("finished") or returncode:
        return "error", reasons
    if sections and all(s["status"] == "skipped" for s in sections.values()):
        return "skipped", [f"{n}: {s.get('reason', '')}" for n, s in sections.items()]
    return "passed", reasons


@dataclass
class Options:
    """What :func:`run_check` was asked to do."""

    mode: str
    out: str
    work: str
    root: str
    total_s: float
    limits: dict[str, float]
    parts: tuple[str, ...]
    prepare_status: str | None
    command: list[str]
    #: the machine's slowdown against the reference (:func:`.limits.calibrate`); set by
    #: :func:`run_check` when left at None
    factor: float | None = None

    def limit(self, part: str | None, typical_s: float, left: float) -> float:
        """The time limit of a part (``part``: its name) or of a correctness suite (``None``)
        with ``left`` seconds before the deadline: the part's ``--limit`` if given, else the
        scaled one (:func:`.limits.scaled_limit`), capped by ``left``."""
        own = self.limits.get(part) if part is not None else None
        if own is None:
            own = scaled_limit(typical_s, self.mode, self.factor or 1.0)
        return left if own is None else min(own, left)


def _run_part(spec: PartSpec, options: Options, limit: float, log: TextIO) -> dict[str, Any]:
    result = os.path.join(options.work, f"part-{spec.name}.json")
    if os.path.exists(result):
        os.remove(result)
    command = [sys.executable, "-P", "-m", "tools.devicecheck", "part", spec.name]
    command += ["--mode", options.mode, "--result", result]
    log.write(f"\n===== part {spec.name} (limit {limit:.0f} s): {' '.join(command)}\n")
    log.flush()
    proc = subprocess.Popen(
        command,
        cwd=options.root,
        env=checkout_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    timed_out = False
    try:
        returncode: int | None = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        returncode = None
    data = read_json(result)
    status, reasons = part_status(data, returncode, timed_out)
    for section in (data or {}).get("sections", {}).values():
        if section["status"] == "running":  # the section the part died in
            section["status"] = "timeout" if timed_out else "error"
            section["reason"] = "killed at the part's time limit" if timed_out else "part ended"
    entry: dict[str, Any] = {"status": status, "reasons": reasons, "returncode": returncode}
    if data is not None:
        entry["sections"] = data.get("sections", {})
        for key in ("workload", "error"):
            if key in data:
                entry[key] = data[key]
    return entry


def _run_correctness(options: Options, limit: float, log: TextIO) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    suites = []
    for suite in SUITES:
        left = deadline - time.monotonic()
        if left < MIN_START_S:
            suites.append(
                {"suite": suite.name, "status": "not run", "reasons": ["part time limit reached"]}
            )
            continue
        run = run_suite(
            suite,
            root=options.root,
            python=sys.executable,
            gpu=options.mode == "gpu",
            limit_s=options.limit(None, suite.typical_s, left),
            work_dir=options.work,
            log=log,
        )
        suites.append(run.as_record())
    bad = [s for s in suites if s["status"] in ("failed", "not run")]
    ran = [s for s in suites if s["status"] == "passed"]
    status = "failed" if bad else ("passed" if ran else "skipped")
    reasons = [f"{s['suite']}: {'; '.join(s['reasons'])}" for s in bad]
    return {"status": status, "reasons": reasons, "suites": suites}


def machine_summary(environment: dict[str, Any]) -> dict[str, Any]:
    """The headline facts of the environment part: GPU, CPU, cores, versions."""

    def first(section: str) -> dict[str, Any]:
        records = environment.get("sections", {}).get(section, {}).get("records") or [{}]
        return records[0]

    torch, host, packages = first("torch"), first("host"), first("packages")
    return {
        "gpu": torch.get("gpu"),
        "gpu_capability": torch.get("capability"),
        "gpu_memory_gib": torch.get("memory_gib"),
        "torch_cuda": torch.get("cuda_build"),
        "jax_default_backend": first("jax").get("default_backend"),
        "cpu": host.get("cpu"),
        "usable_cores": host.get("usable_cores"),
        "python": host.get("python"),
        "versions": {k: v for k, v in packages.get("versions", {}).items() if v},
        "native_helper": packages.get("native_helper"),
    }


def _exit_code(parts: dict[str, dict[str, Any]]) -> int:
    gate_failed = any(
        part["status"] not in ("passed", "skipped") for name, part in parts.items()
        if BY_NAME[name].gate
    )  # fmt: skip
    checks_failed = any(part["status"] == "failed" for part in parts.values())
    if gate_failed or checks_failed:
        return 1
    if any(part["status"] not in ("passed", "skipped") for part in parts.values()):
        return 2
    return 0


def _write(payload: dict[str, Any], out: str) -> None:
    for name, text in (
        ("device-check.json", json.dumps(payload, indent=1, default=str)),
        ("device-check.md", report.render(payload)),
    ):
        tmp = os.path.join(out, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))


def run_check(options: Options) -> int:
    """Run the selected parts in order and write the reports; returns the exit code (0: all
    passed or skipped; 1: a correctness part or a check failed; 2: another part failed)."""
    os.makedirs(options.out, exist_ok=True)
    os.makedirs(options.work, exist_ok=True)
    start = time.monotonic()
    deadline = start + options.total_s
    payload: dict[str, Any] = {
        "schema": 1,
        "tool": "portable_spec device check",
        "mode": options.mode,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": options.command,
        "total_limit_s": options.total_s,
        "prepare": read_json(options.prepare_status) if options.prepare_status else None,
        "calibration": None,
        "parts": {},
        "wall_s": 0.0,
        "exit_code": 0,
    }
    if options.factor is None:
        payload["calibration"] = calibrate()
        options.factor = float(payload["calibration"]["factor"])
    with open(os.path.join(options.out, "device-check.log"), "a", encoding="utf-8") as log:
        for spec in PARTS:
            if spec.name not in options.parts:
                continue
            left = deadline - time.monotonic()
            limit = options.limit(spec.name, spec.typical_s, left)
            t0 = time.monotonic()
            if left < MIN_START_S:
                entry: dict[str, Any] = {
                    "status": "not run",
                    "reasons": [f"total time limit of {options.total_s:.0f} s reached"],
                }
            elif spec.module is None:
                entry = _run_correctness(options, limit, log)
            else:
                entry = _run_part(spec, options, limit, log)
            entry.update(title=spec.title, wall_s=time.monotonic() - t0, limit_s=max(limit, 0))
            payload["parts"][spec.name] = entry
            if spec.name == "environment":
                payload["machine"] = machine_summary(entry)
            payload["wall_s"] = time.monotonic() - start
            payload["exit_code"] = _exit_code(payload["parts"])
            _write(payload, options.out)
            note = f" ({'; '.join(entry['reasons'])[:300]})" if entry["reasons"] else ""
            print(
                f"[{time.monotonic() - start:6.1f} s] {spec.name}: {entry['status']}"
                f" in {entry['wall_s']:.1f} s{note}",
                flush=True,
            )
    print(
        f"device check ({options.mode}): exit code {payload['exit_code']}; "
        f"reports in {options.out}/device-check.json and device-check.md",
        flush=True,
    )
    return int(payload["exit_code"])
