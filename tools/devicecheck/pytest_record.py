"""pytest plugin: one JSON line per test event, written as it happens.

Loaded with ``-p tools.devicecheck.pytest_record`` when ``$PORTABLE_SPEC_CHECK_RECORD``
names the output file. Lines: ``{"event": "start", "nodeid"}`` when a test starts (so a run
killed at its time limit shows which test hung), ``{"event": "report", "nodeid", "when",
"outcome", "reason"?, "message"?}`` for every call report and every setup/teardown report that
did not pass, ``{"event": "collect", "nodeid", "message"}`` for collection errors.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "PORTABLE_SPEC_CHECK_RECORD"


def _emit(line: dict[str, Any]) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _emit({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    if report.when != "call" and report.passed:
        return
    line: dict[str, Any] = {
        "event": "report",
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": round(float(report.duration), 4),
    }
    if hasattr(report, "wasxfail"):
        line["xfail"] = True
    if report.skipped:
        line["reason"] = _skip_reason(report)
    elif report.failed:
        line["message"] = report.longreprtext[-3000:]
    _emit(line)


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _emit({"event": "collect", "nodeid": report.nodeid, "message": report.longreprtext[-3000:]})
