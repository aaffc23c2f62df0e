"""The vLLM plugin under load, through vLLM's OpenAI server (``vllm serve``).

Two servers, one after the other, on 127.0.0.1 (SmolLM2-135M, n-gram speculation with K = 4
drafts, vLLM's default separate engine-core process): one with ``PORTABLE_SPEC_VLLM=1``,
where vLLM's ``vllm.general_plugins`` entry point switches the plugin on in the engine core,
and one with the plugin off. The ``openai`` client sends them requests 16 in flight at a time
(``load.py``: JSON schemas by ``response_format`` and by ``structured_outputs``, regexes,
choices, ``json_object``, streams read to the end and streams dropped mid-way, requests
without a constraint, malformed constraints). Both servers get the same requests. With the
plugin on:

* every finished output meets its constraint (jsonschema, ``re.fullmatch``, choice list);
* no request fails that the server without the plugin serves (request by request), and every
  malformed request gets the 4xx it gets without;
* the dropped streams reach the engine as aborts, and once the clients have their answers no
  request is left running or waiting;
* the server is healthy after the load (``/health``, a last request, no process lost, none
  left after it stopped);
* memory: the anonymous RSS (resident less file-backed and shared pages) of every process of
  the server, sampled after a warm-up of ``WARMUP`` requests and then at every answer, median
  of the first third of the samples against that of the last: the engine-core process the
  plugin runs in and the API server stay flat (``FLAT_BOUND``), and the whole process tree
  grows at most ``TREE_MARGIN`` more than it does without the plugin on the same requests
  (vLLM's model worker grows by itself, plugin or not: about 0.5 MiB per request here);
* the plugin built the steps: its summary lines in vLLM's log count the steps it built, none
  left to vLLM's own fill, no warning; nothing of it is logged with the plugin off.

Environment: ``PORTABLE_SPEC_SERVER_REQUESTS`` (default 256), ``PORTABLE_SPEC_SERVER_START_S``
(start-up deadline per server, default 1800 s: vLLM imports torch in each of its three
processes, minutes on two busy cores).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
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

REQUESTS = max(64, int(os.environ.get("PORTABLE_SPEC_SERVER_REQUESTS", "256")))
CONCURRENCY = 16
WARMUP = 32  # requests sent before the memory samples start
LOG_EVERY = 25  # the plugin's summary line every this many grammar_bitmask calls
MIB = 1 << 20
#: Allowed growth of anonymous RSS, median of the last third of the samples over that of the
#: first third:
#: the plugin's process (vLLM's engine core) and the API server, each...
FLAT_BOUND = 16 * MIB
#: ...and the whole tree, over its growth without the plugin (vLLM's model worker grows ~0.5-0.7
#: MiB per request in both; two runs of the same load differ by a few tens of MiB).
TREE_MARGIN = 128 * MIB
SUMMARY = re.compile(r"portable_spec: (\d+) calls, (\d+) built, (\d+) fallback")
#: The plugin's documented line at its first step (docs/vllm.md), after vLLM's ``(pid=N)``.
ANNOUNCE = re.compile(
    r"pid=(\d+)\)[^\n]*portable_spec: grammar_bitmask built by portable_spec \(on,"
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
        server.sample()  # then once per answer: as many samples, however fast the machine
        rest = load.run(
            server.url, todo[WARMUP:], CONCURRENCY, MODEL_NAME, after=lambda _: server.sample()
        )
        outcomes += asyncio.run(rest)
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
    # for a look after a failure: what each request got, and the memory samples
    got = [dataclasses.asdict(outcome) for outcome in report["outcomes"]]
    (workdir / "outcomes.json").write_text(json.dumps(got, indent=1))
    rss = {"labels": report["labels"], "samples": report["samples"]}
    (workdir / "rss.json").write_text(json.dumps(rss))
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


def _settled_metrics(url: str, wait_s: float = 300) -> dict[str, float]:
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


def _growth(run: dict[str, Any], pid: int | None = None, anon: bool = True) -> tuple[float, float]:
    """Median anonymous RSS (or RSS) of the first and of the last third of the samples: one
    process, or the tree."""
    field = 1 if anon else 0

    def value(rss: dict[int, tuple[int, int]]) -> int:
        if pid is None:
            return sum(v[field] for v in rss.values())
        return rss[pid][field] if pid in rss else 0

    values = [value(rss) for _, rss in run["samples"]]
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
        _RUNS[mode] = _serve("1" if mode == "on" else "0", REQUESTS, workdir)
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


def _validated(run: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """Finished outputs checked against their constraint, by class, and what was wrong."""
    checked: dict[str, int] = {}
    wrong: list[str] = []
    for case, outcome in zip(run["cases"], run["outcomes"], strict=True):
        n, problems = load.violations(case, outcome)
        checked[case.kind] = checked.get(case.kind, 0) + n
        wrong += problems
    return checked, wrong


def _summary(runs: dict[str, dict[str, Any]]) -> str:
    """Per server: requests by class and status, outputs validated, aborts, times, RSS, the
    plugin's counters."""
    lines = []
    for mode, run in runs.items():
        by_kind: dict[str, list[int]] = {}
        for outcome in run["outcomes"]:
            by_kind.setdefault(outcome.kind, []).append(outcome.status)
        kinds = ", ".join(
            f"{kind} {len(got)} ({', '.join(f'{got.count(s)}x {s}' for s in sorted(set(got)))})"
            for kind, got in sorted(by_kind.items())
        )
        statuses = [outcome.status for outcome in run["outcomes"]]
        served = statuses.count(200)
        refused = sum(400 <= s < 500 for s in statuses)
        checked, wrong = _validated(run)
        valid = ", ".join(f"{kind} {n}" for kind, n in sorted(checked.items()) if n)
        (a, b), (c, d) = _growth(run, anon=False), _growth(run)
        rss = [
            f"tree RSS {a / MIB:.1f} -> {b / MIB:.1f} MiB, anonymous {c / MIB:.1f} -> {d / MIB:.1f}"
        ]
        sampled = {pid for _, rss in run["samples"] for pid in rss}
        for pid, label in sorted(run["labels"].items()):
            if pid not in sampled:  # seen during the start only
                continue
            a, b = _growth(run, pid)
            rss.append(f"{label} {a / MIB:.1f} -> {b / MIB:.1f}")
        plugin = SUMMARY.findall(run["log"])
        lines.append(
            f"plugin {mode}: start {run['start_s']:.0f} s, load {run['load_s']:.0f} s, server CPU "
            f"{run['cpu_s']:.0f} s; sent {len(statuses)}: {served} served, {refused} refused "
            f"(4xx), {len(statuses) - served - refused} failed; {kinds}; finished outputs "
            f"validated {sum(checked.values())} ({valid}), invalid {len(wrong)}; "
            f"aborted {_aborted(run)}; memory (median of the first third -> last third of "
            f"{len(run['samples'])} samples, one per answer after {WARMUP} requests; per process "
            f"anonymous RSS): {'; '.join(rss)}; "
            f"plugin's last summary (calls, built, fallback): {plugin[-1] if plugin else '-'}"
        )
    return "\n".join(lines)


def test_every_finished_output_meets_its_constraint(on):
    checked, wrong = _validated(on)
    assert not wrong, "\n".join(wrong[:20])
    # most outputs finished (rather than cut by max_tokens) in every class checked
    for kind in ("response_format", "json", "json_object", "regex", "choice", "stream"):
        sent = sum(case.kind == kind for case in on["cases"])
        assert checked.get(kind, 0) >= sent // 2, (kind, checked.get(kind, 0), sent)


def test_memory_stays_flat(on, off):
    assert len(on["samples"]) == len(off["samples"]) == REQUESTS - WARMUP + 1
    pid = _plugin_pid(on)
    assert pid in on["labels"], (pid, on["labels"])  # a process of the server's tree
    for who, label in ((pid, "the plugin's process"), (on["root"], "the API server")):
        first, last = _growth(on, who)
        assert first > 0 and last - first <= FLAT_BOUND, (
            f"{label} ({on['labels'].get(who)}) grew {(last - first) / MIB:.1f} MiB "
            f"({first / MIB:.1f} -> {last / MIB:.1f} MiB)"
        )
    (first, last), (first_off, last_off) = _growth(on), _growth(off)
    assert last - first <= last_off - first_off + TREE_MARGIN, (
        f"the server's tree grew {(last - first) / MIB:.0f} MiB with the plugin, "
        f"{(last_off - first_off) / MIB:.0f} MiB without"
    )


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
    assert len(off["outcomes"]) == len(on["outcomes"]) == REQUESTS
    for case, a, b in zip(on["cases"], off["outcomes"], on["outcomes"], strict=True):
        where = f"request {case.index} ({case.group})"
        if a.status == 200:  # served without the plugin: served with it
            assert b.status == 200, f"{where} failed with the plugin: {b.error}"
        else:  # refused (4xx, not a crash) with the plugin as without it
            assert b.status == a.status, f"{where}: {a.status} without, {b.status} with the plugin"
        if case.kind == "malformed":
            assert 400 <= a.status < 500, f"{where}: {a.status} without the plugin: {a.error}"
        else:  # the load means what it says: vLLM alone serves every valid request of it
            assert a.status == 200, f"{where} failed without the plugin: {a.error}"
        if case.drop_after:
            assert 0 < b.chunks <= case.drop_after, b
    # greedy, but the batches differ between the runs: printed, not asserted
    both = [
        (a.texts, b.texts)
        for case, a, b in zip(on["cases"], off["outcomes"], on["outcomes"], strict=True)
        if a.status == b.status == 200 and not case.drop_after
    ]
    same = sum(a == b for a, b in both)
    print(f"\noutputs the same with the plugin on and off: {same} of {len(both)}")


def test_vllm_alone_logs_nothing_of_the_plugin(off):
    assert not re.search(r"\bportable_spec[: ]", off["log"])  # the comparison is vLLM's own
