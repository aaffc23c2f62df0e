"""A part's results, rewritten to its JSON file after every change.

A part runs in its own process under a time limit; when it is killed, the file still holds
every section it finished. Sections hold records (one per measured configuration), a status
(``ok``, ``skipped``, ``error``) and checks (named booleans: a measurement that also verifies a
result, e.g. that two apply methods gave identical logits).
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["PartRecorder", "SkipSection", "read_json"]


class SkipSection(Exception):
    """Raised inside :meth:`PartRecorder.section` to record the section as skipped."""


class PartRecorder:
    """Collects one part's sections and writes them to ``path`` (atomically) on each change.

    Layout: ``{"part", "mode", "finished", "sections": {name: {"status", "reason"?,
    "records": [...], "checks": [{"name", "ok", "detail"}]}}}``.
    """

    def __init__(self, path: str, part: str, mode: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"part": part, "mode": mode, "finished": False, "sections": {}}
        self._write()

    def _section(self, name: str) -> dict[str, Any]:
        return self.data["sections"].setdefault(
            name, {"status": "running", "records": [], "checks": []}
        )

    @contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        """Run a section: ``ok`` when the block ends, ``skipped`` on :class:`SkipSection`,
        ``error`` (with the traceback's tail) on any other exception, which is not re-raised:
        the next section still runs."""
        entry = self._section(name)
        self._write()
        try:
            yield entry
        except SkipSection as skip:
            entry["status"], entry["reason"] = "skipped", str(skip)
        except Exception as exc:  # a part records its failure and goes on
            entry["status"] = "error"
            entry["reason"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
        else:
            entry["status"] = "ok"
        self._write()

    def skip(self, name: str, reason: str) -> None:
        """Record section ``name`` as skipped without running it."""
        entry = self._section(name)
        entry["status"], entry["reason"] = "skipped", reason
        self._write()

    def add(self, name: str, record: dict[str, Any]) -> None:
        """Append one measured record to section ``name``."""
        self._section(name)["records"].append(record)
        self._write()

    def check(self, name: str, check: str, ok: bool, detail: str = "") -> None:
        """Record a correctness check made while measuring (a failed one fails the part)."""
        self._section(name)["checks"].append({"name": check, "ok": bool(ok), "detail": detail})
        self._write()

    def note(self, key: str, value: Any) -> None:
        """Part-level information (e.g. the workload's description)."""
        self.data[key] = value
        self._write()

    def finish(self) -> None:
        """Mark the part as having run to its end."""
        self.data["finished"] = True
        self._write()

    def _write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1, default=_jsonable)
        os.replace(tmp, self.path)


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays as plain JSON values; anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
