"""The vLLM plugin under load, through vLLM's OpenAI server (``vllm serve``).

Two servers, one after the other, on 127.0.0.1 (SmolLM2-135M, n-gram speculation with K = 4
drafts, vLLM's default separate engine-core process): one with ``PORTABLE_SPEC_VLLM=1``,
where vLLM's ``vllm.general_plugins`` entry point switches the plugin on in the engine core,
and one with the plugin off. The ``openai`` client sends them requests 16 in flight at a time
(``load.py``: JSON schemas by ``response_format`` and by ``structured_outputs``, regexes,
choices, ``json_object``, streams read to the end and streams dropped mid-way, requests
without a constraint, malformed constraints). The server without the plugin gets the first
``OFF_REQUESTS`` of the same requests (every class and every malformed constraint). With the
plugin on:

* every finished output meets its constraint (jsonschema, ``re.fullmatch``, choice list);
* no request fails that the server without the plugin serves (request by request where both
  got it, class by class after), and every malformed request gets the 4xx it gets without;
* the dropped streams reach the engine as aborts, and once the clients have their answers no
  request is left running or waiting;
* the server is healthy after the load (``/health``, a last request, no process lost, none
  left after it stopped);
* memory: from the first third of the load to the last (after a warm-up, RSS sampled every
  half second), the engine-core process the plugin runs in and the API server stay flat, and
  the whole process tree stays within a bound (vLLM's model worker grows by itself, with the
  plugin off too: about half a MiB per request here);
* the plugin built the steps: its summary lines in vLLM's log count the steps it built, none
  left to vLLM's own fill, no warning; nothing of it is logged with the plugin off.

Environment: ``PORTABLE_SPEC_SERVER_REQUESTS`` (default 256), ``PORTABLE_SPEC_SERVER_START_S``
(start-up deadline per server, default 1800 s: vLLM imports torch in each of its three
processes, minutes on two busy cores).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import httpx  # noqa: E402
import load  # noqa: E402
from server import MODEL_NAME, ROOT, Server, server_env  # noqa: E402

REQUESTS = int(os.environ.get("PORTABLE_SPEC_SERVER_REQUESTS", "256"))
OFF_REQUESTS = min(REQUESTS, 6 * len(load.KINDS))  # 96: every malformed constraint once
CONCURRENCY = 16
WARMUP = 32  # requests sent before the memory samples start
LOG_EVERY = 25  # the plugin's summary line every this many grammar_bitmask calls
MIB = 1 << 20
#: Allowed RSS growth, median of the last third of the samples over that of the first third:
#: the plugin's process (vLLM's engine core) and the API server, each...
FLAT_BOUND = 16 * MIB
#: ...and the whole tree (vLLM's model worker grows ~0.5-0.7 MiB per request, plugin or not).
TREE_BOUND = 384 * MIB
SUMMARY = re.compile(r"portable_spec: (\d+) calls, (\d+) built, (\d+) fallback")
ANNOUNCE = re.compile(
    r"pid=(\d+)\)[^\n]*portable_spec: grammar_bitmask built by portable_spec \(on, packed rows"
)


def _model() -> str:
    model = Path(os.environ.get("PORTABLE_SPEC_VLLM_MODEL", ROOT / ".vllm-model"))
    if not (model / "config.json").exists():
        pytest.skip(f"no model directory at {model} (bash scripts/setup-vllm.sh makes it)")
    return str(model.resolve())


def _serve(mode: str, requests: int, workdir: Path) -> dict[str, Any]:
    """One server with ``PORTABLE_SPEC_VLLM=mode``: the load, the checks after it, the stop."""
    todo = load.cases(requests)
    start_s = float(os.environ.get("PORTABLE_SPEC_SERVER_START_S", "1800"))
    server = Server(_model(), server_env(mode, LOG_EVERY), workdir / f"{mode}.log", start_s)
    report: dict[str, Any] = {"mode": mode, "cases": todo}
    started = time.monotonic()
    with server:
        report["start_s"] = time.monotonic() - started
        root = server.proc.pid if server.proc else -1
        before = {p.pid for p in server.tree()}
        outcomes = asyncio.run(load.run(server.url, todo[:WARMUP], CONCURRENCY, MODEL_NAME))
        server.start_sampling()
        outcomes += asyncio.run(load.run(server.url, todo[WARMUP:], CONCURRENCY, MODEL_NAME))
        server.stop_sampling()
        report["load_s"] = time.monotonic() - started - report["start_s"]
        report["outcomes"] = outcomes
        report["lost"] = sorted(before - {p.pid for p in server.tree()})
        report["health"] = _get(server.url + "/health")[0]
        report["metrics"] = _settled_metrics(server.url)
        last = load.cases(1)[0]  # a JSON schema by response_format
        report["last"] = (last, asyncio.run(load.run(server.url, [last], 1, MODEL_NAME))[0])
        report["samples"], report["labels"], report["root"] = server.samples, server.labels(), root
        report["cpu_s"] = server.cpu_seconds()
    report["leftovers"] = server.leftovers()
    report["log"] = server.log()
    return report


def _get(url: str) -> tuple[int, str]:
    try:
        response = httpx.get(url, timeout=30)
    except httpx.HTTPError as exc:
        return -1, str(exc)
    return response.status_code, response.text


def _metrics(text: str) -> dict[str, float]:
    """vLLM's request counters from ``/metrics``: requests finished by reason (aborted ones
    are not counted there), requests running and waiting."""
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^vllm:(\w+)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        if name == "request_success_total":
            reason = re.search(r'finished_reason="(\w+)"', labels)
            name = f"finished_{reason.group(1) if reason else '?'}"
        if name.startswith("finished_") or name in ("num_requests_running", "num_requests_waiting"):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _settled_metrics(url: str, wait_s: float = 60) -> dict[str, float]:
    """The counters once vLLM reports no request running or waiting (its gauges follow its
    steps), or as they are after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        metrics = _metrics(_get(url + "/metrics")[1])
        idle = not metrics.get("num_requests_running") and not metrics.get("num_requests_waiting")
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(1)


def _aborted(run: dict[str, Any]) -> int:
    """Requests the engine took but did not finish (the streams dropped mid-way, aborted)."""
    taken = sum(case.kind != "malformed" for case in run["cases"])
    finished = sum(v for k, v in run["metrics"].items() if k.startswith("finished_"))
    return taken - int(finished)


def _growth(run: dict[str, Any], pid: int | None = None) -> tuple[float, float]:
    """Median RSS of the first and of the last third of the samples: one process, or the tree."""
    values = [rss.get(pid, 0) if pid else sum(rss.values()) for _, rss in run["samples"]]
    third = max(1, len(values) // 3)
    return statistics.median(values[:third]), statistics.median(values[-third:])


def _plugin_pid(run: dict[str, Any]) -> int | None:
    """The process that said it builds the bitmask (vLLM prefixes its lines with the pid)."""
    found = ANNOUNCE.search(run["log"])
    return int(found.group(1)) if found else None


_RUNS: dict[str, dict[str, Any]] = {}  # one server per mode and session, started on demand


def _run(mode: str, factory: pytest.TempPathFactory) -> dict[str, Any]:
    if mode not in _RUNS:
        workdir = factory.mktemp(f"vllm-serve-{mode}")
        if mode == "on":
            _RUNS[mode] = _serve("1", REQUESTS, workdir)
        else:
            _RUNS[mode] = _serve("0", OFF_REQUESTS, workdir)
        print(_summary({mode: _RUNS[mode]}))
    return _RUNS[mode]


@pytest.fixture(scope="module")
def on(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The server with the plugin on, after its load."""
    return _run("on", tmp_path_factory)


@pytest.fixture(scope="module")
def off(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The server with the plugin off (vLLM's own code), after its load."""
    return _run("off", tmp_path_factory)


def _summary(runs: dict[str, dict[str, Any]]) -> str:
    """Per server: requests by class and status, aborts, times, RSS, the plugin's counters."""
    lines = []
    for mode, run in runs.items():
        by_kind: dict[str, list[int]] = {}
        for outcome in run["outcomes"]:
            by_kind.setdefault(outcome.kind, []).append(outcome.status)
        kinds = ", ".join(
            f"{kind} {len(got)} ({', '.join(f'{got.count(s)}x {s}' for s in sorted(set(got)))})"
            for kind, got in sorted(by_kind.items())
        )
        first, last = _growth(run)
        rss = [f"tree {first / MIB:.1f} -> {last / MIB:.1f} MiB"]
        for pid, label in sorted(run["labels"].items()):
            a, b = _growth(run, pid)
            rss.append(f"{label} {a / MIB:.1f} -> {b / MIB:.1f}")
        plugin = SUMMARY.findall(run["log"])
        lines.append(
            f"plugin {mode}: start {run['start_s']:.0f} s, load {run['load_s']:.0f} s, server CPU "
            f"{run['cpu_s']:.0f} s; {kinds}; "
            f"aborted {_aborted(run)}; RSS (first third -> last third, {len(run['samples'])} "
            f"samples): {'; '.join(rss)}; plugin's last summary (calls, built, fallback): "
            f"{plugin[-1] if plugin else '-'}"
        )
    return "\n".join(lines)


def test_every_finished_output_meets_its_constraint(on):
    checked: dict[str, int] = {}
    wrong: list[str] = []
    for case, outcome in zip(on["cases"], on["outcomes"], strict=True):
        n, problems = load.violations(case, outcome)
        checked[case.kind] = checked.get(case.kind, 0) + n
        wrong += problems
    assert not wrong, "\n".join(wrong[:20])
    # most outputs finished (rather than cut by max_tokens) in every class checked
    for kind in ("response_format", "json", "json_object", "regex", "choice", "stream"):
        sent = sum(case.kind == kind for case in on["cases"])
        assert checked.get(kind, 0) >= sent // 2, (kind, checked.get(kind, 0), sent)


def test_memory_stays_flat(on):
    assert len(on["samples"]) >= 30, "too few memory samples"
    pid = _plugin_pid(on)
    assert pid in on["labels"], (pid, on["labels"])  # a process of the server's tree
    for who, label in ((pid, "the plugin's process"), (on["root"], "the API server")):
        first, last = _growth(on, who)
        assert first > 0 and last - first <= FLAT_BOUND, (
            f"{label} ({on['labels'].get(who)}) grew {(last - first) / MIB:.1f} MiB "
            f"({first / MIB:.1f} -> {last / MIB:.1f} MiB)"
        )
    first, last = _growth(on)
    assert last - first <= TREE_BOUND, f"the server's tree grew {(last - first) / MIB:.0f} MiB"


def test_the_plugin_built_the_steps(on):
    log = on["log"]
    assert _plugin_pid(on) is not None, log[-4000:]
    summaries = [tuple(map(int, s)) for s in SUMMARY.findall(log)]
    assert summaries, log[-4000:]
    calls, built, fallback = summaries[-1]
    assert calls >= 4 * LOG_EVERY and built == calls and fallback == 0, summaries[-1]
    # nothing refused or left to vLLM's own fill, no warning of the plugin's
    assert not re.search(r"WARNING.*\bportable_spec[: ]", log)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_dropped_streams_reach_the_engine_as_aborts(mode, request):
    run = request.getfixturevalue(mode)
    dropped = sum(case.kind == "dropped" for case in run["cases"])
    assert 0 < _aborted(run) <= dropped, run["metrics"]
    # no request left in the scheduler once every client has its answer
    assert run["metrics"]["num_requests_running"] == 0, run["metrics"]
    assert run["metrics"]["num_requests_waiting"] == 0, run["metrics"]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_server_healthy_after_the_load(mode, request):
    run = request.getfixturevalue(mode)
    assert run["health"] == 200
    assert not run["lost"], f"processes gone during the load: {run['lost']}"
    last, outcome = run["last"]
    assert outcome.status == 200 and outcome.finish == ["stop"], outcome
    assert load.violations(last, outcome) == (1, [])
    assert not run["leftovers"], f"still running after stop: {run['leftovers']}"


def test_no_request_fails_that_vllm_serves(on, off):
    assert len(off["outcomes"]) == OFF_REQUESTS and len(on["outcomes"]) == REQUESTS
    # request by request where both servers got it
    for a, b in zip(off["outcomes"], on["outcomes"], strict=False):
        if a.status == 200:
            assert b.status == 200, f"request {b.index} ({b.kind}) failed: {b.error}"
        else:
            assert b.status == a.status, (b.index, b.kind, a.error, b.error)
    # class by class (each malformed constraint its own class) for the rest
    off_status: dict[str, set[int]] = {}
    for case, outcome in zip(off["cases"], off["outcomes"], strict=True):
        off_status.setdefault(case.group, set()).add(outcome.status)
    for case, outcome in zip(on["cases"], on["outcomes"], strict=True):
        if case.kind == "malformed":
            assert off_status[case.group] == {outcome.status}, (case.index, outcome.error)
            assert 400 <= outcome.status < 500, (case.index, outcome.error)
        else:  # every valid request of the load is served, plugin on or off
            assert off_status[case.group] == {200}, (case.group, off_status[case.group])
            assert outcome.status == 200, f"request {case.index} ({case.kind}): {outcome.error}"
        if case.drop_after:
            assert 0 < outcome.chunks <= case.drop_after, outcome


def test_vllm_alone_logs_nothing_of_the_plugin(off):
    assert not re.search(r"\bportable_spec[: ]", off["log"])  # the comparison is vLLM's own
