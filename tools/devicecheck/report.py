"""``device-check.md``: the JSON payload as Markdown tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["render"]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _first(payload: dict[str, Any], part: str, section: str) -> dict[str, Any]:
    records = payload["parts"].get(part, {}).get("sections", {}).get(section, {}).get("records")
    return records[0] if records else {}


def _header(payload: dict[str, Any]) -> list[str]:
    host = _first(payload, "environment", "host")
    torch = _first(payload, "environment", "torch")
    jax = _first(payload, "environment", "jax")
    packages = _first(payload, "environment", "packages")
    versions = packages.get("versions", {})
    smi = _first(payload, "environment", "nvidia-smi")
    mode = payload["mode"]
    lines = ["# portable_spec device check", ""]
    verdict = "PASSED" if payload.get("exit_code") == 0 else "NOT PASSED"
    lines.append(f"**{verdict}** (exit code {payload.get('exit_code')})")
    lines.append("")
    lines.append(
        f"- mode: `{mode}`"
        + (" (GPU parts reported as skipped)" if mode == "cpu" else "")
        + f"; started {payload.get('started')}; {payload.get('wall_s', 0):.0f} s wall time"
    )
    lines.append(f"- command: `{' '.join(payload.get('command', []))}`")
    calibration = payload.get("calibration") or {}
    own = "none of their own" if mode == "cpu" else "calibrated, with a cold-start allowance"
    lines.append(
        f"- time limits (hang guards, not speed checks): {payload.get('total_limit_s', 0):.0f} s"
        f" in total; parts: {own}; machine slowdown {calibration.get('factor', '-')}x"
        f" ({calibration.get('seconds', '-')} s for a {calibration.get('reference_s', '-')} s"
        " reference workload)"
    )
    if torch.get("gpu"):
        lines.append(
            f"- GPU: {torch['gpu']} (compute capability {torch.get('capability')}, "
            f"{torch.get('memory_gib')} GiB, {torch.get('multiprocessors')} SMs)"
        )
    else:
        lines.append("- GPU: none visible to torch")
    if smi.get("output"):
        lines.append(f"- nvidia-smi ({smi.get('fields')}): {smi['output']}")
    if host:
        lines.append(
            f"- host: {host.get('cpu')}, {host.get('usable_cores')} usable cores, "
            f"{(host.get('memory_gib') or 0):.0f} GiB, {host.get('os')}, "
            f"Python {host.get('python')}"
        )
    if versions:
        shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
        lines.append(f"- packages: {shown}")
        lines.append(f"- C helper built: {packages.get('native_helper')}")
    if torch or jax:
        lines.append(
            f"- torch CUDA build {torch.get('cuda_build')}; JAX default backend "
            f"`{jax.get('default_backend')}`, devices {jax.get('devices')}"
        )
    prepare = payload.get("prepare")
    if prepare:
        project = prepare.get("project", {})
        wheels = prepare.get("wheels", [])
        installed = [w["name"] for w in wheels if w.get("action") == "installed"]
        kept = [w["name"] for w in wheels if w.get("action") != "installed"]
        lines.append(
            f"- install: wheels {', '.join(installed) or 'none'}"
            + (f" (image's kept: {', '.join(kept)})" if kept else "")
            + f"; project by {project.get('method')}, C helper "
            + ("built" if project.get("native") else f"not built ({project.get('native_reason')})")
        )
    return lines


def _parts(payload: dict[str, Any]) -> list[str]:
    rows = []
    for name, part in payload["parts"].items():
        notes = "; ".join(part.get("reasons", []))
        wall, limit = f"{part.get('wall_s', 0):.1f}", f"{part.get('limit_s', 0):.0f}"
        rows.append([name, part["status"], wall, limit, notes])
    return ["", "## Parts", "", *_table(["part", "status", "wall s", "limit s", "notes"], rows)]


def _correctness(part: dict[str, Any]) -> list[str]:
    suites = part.get("suites", [])
    if not suites:
        return []
    rows = []
    for s in suites:
        counts = s.get("counts", {})
        rows.append(
            [s["suite"], s["status"]]
            + [counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")]
            + [f"{s.get('wall_s', 0):.1f}", " ".join(s.get("args", [])), "; ".join(s["reasons"])]
        )
    lines = ["", "## Correctness", ""]
    lines += _table(
        ["suite", "status", "passed", "failed", "errors", "skipped", "wall s", "args", "notes"],
        rows,
    )
    for s in suites:
        for reason, count in s.get("skip_reasons", {}).items():
            lines.append(f"- {s['suite']}: {count} skipped: {reason}")
        for failure in s.get("failures", []):
            message = failure["message"].strip().splitlines()
            last = message[-1] if message else ""
            lines.append(f"- {s['suite']}: **{failure['outcome']}** `{failure['nodeid']}`: {last}")
    return lines


def _staging(records: list[dict[str, Any]]) -> list[str]:
    rows = [
        [
            r["framework"],
            f"{r['batch']} x {r['nodes']} {r['dtype']}",
            _us(r["seconds"]["from_device (launch)"]),
            _us(r["seconds"]["from_device+resolve"]),
            _us(r["seconds"]["plain"]),
            f"{r['plain_over_resolve']:.2f}",
            r["rounds"],
        ]
        for r in records
    ]
    header = ["framework", "tree", "from_device us", "+ resolve us", "blocking copy us"]
    return _table([*header, "copy / resolve", "rounds"], rows)


def _upload(records: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in records:
        cells = "; ".join(
            f"{k}: {_ms(s)} ms ({r['gb_per_s'][k]:.1f} GB/s)" for k, s in r["seconds"].items()
        )
        rows.append([r["framework"], r["rows"], f"{r['bytes'] / 2**20:.1f}", cells])
    return _table(["framework", "rows", "MiB", "median per method"], rows)


def _apply(records: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in records:
        cells = [f"{k}: {_ms(s)} ms ({r['gb_per_s'][k]:.0f} GB/s)" for k, s in r["seconds"].items()]
        ratio = r.get("apply_over_masked_fill", r.get("apply_over_where"))
        rows.append(
            [
                r["framework"],
                r["device"],
                f"{r['rows']} x {r['vocab']}",
                r["dtype"],
                "; ".join(cells),
                f"{ratio:.2f}",
            ]
        )
    return _table(
        ["framework", "device", "logits", "dtype", "median per method", "apply / floor"], rows
    )


def _overlap(records: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in records:
        s = r["seconds"]
        for name in ("library upload", "same-stream upload"):
            rows.append(
                [
                    name,
                    f"{r['batch']} x {r['nodes']}",
                    _ms(s["forward + apply"]),
                    _ms(s["build"]),
                    _ms(s["serial"]),
                    _ms(s[name]),
                    f"{r[name]['hidden']:.2f}",
                    f"{r[name]['exposed_s'] * 1e3:.3f}",
                    f"{r['forward_tflops']:.0f}",
                ]
            )
    header = ["upload", "batch", "forward+apply ms", "build ms", "serial ms", "overlapped ms"]
    return _table([*header, "hidden", "exposed ms", "forward TFLOP/s"], rows)


def _scaling(records: list[dict[str, Any]]) -> list[str]:
    if not records:
        return []
    counts = list(records[0]["threads"])
    rows = []
    for r in records:
        cells = [
            f"{t['ms']:.2f} ({t['speedup']:.2f}x, {t['efficiency']:.0%}, {t['vs_xgr_loop']:.2f}x)"
            for t in r["threads"].values()
        ]
        busy = r.get("other_busy_cores")
        bg = "-" if busy is None else f"{busy:.2f}"
        loop = f"{r['xgr_loop_ms']:.2f}"
        rows.append([r["batch"], r["nodes"], r["accepted_nodes"], loop, *cells, bg])
    header = ["batch", "nodes", "accepted", "xgr loop ms", *[f"{k} threads" for k in counts]]
    return [
        *_table([*header, "bg"], rows),
        "",
        "Cells: median ms (speed-up over 1 thread, efficiency, xgrammar loop / library). "
        "bg: cores other processes kept busy meanwhile (above about 0.2 the figures are "
        "disturbed).",
    ]


_SECTIONS: dict[str, tuple[str, Callable[[list[dict[str, Any]]], list[str]]]] = {
    "staging": ("Tree staging (host time)", _staging),
    "upload": ("Mask upload", _upload),
    "apply": ("Apply", _apply),
    "overlap": ("Overlap with a verify-sized forward", _overlap),
    "scaling": ("Thread scaling of the host build", _scaling),
}


def _measurements(payload: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for name, part in payload["parts"].items():
        sections = part.get("sections", {})
        if name in ("environment", "correctness") or not sections:
            continue
        lines += ["", f"## {part.get('title', name)}", ""]
        workload = part.get("workload")
        if workload:
            lines.append("Workload: " + "; ".join(f"{k}: {v}" for k, v in workload.items()))
        for section, entry in sections.items():
            title, render_records = _SECTIONS.get(section, (section, lambda _r: []))
            lines += ["", f"### {title}", ""]
            if entry["status"] != "ok":
                lines += [f"{entry['status']}: {entry.get('reason', '')}", ""]
            if entry.get("records"):
                lines += render_records(entry["records"])
    return lines


def _checks(payload: dict[str, Any]) -> list[str]:
    lines = []
    for name, part in payload["parts"].items():
        for section, entry in part.get("sections", {}).items():
            for check in entry.get("checks", []):
                mark = "ok" if check["ok"] else "**FAILED**"
                detail = f" ({check['detail']})" if check.get("detail") and not check["ok"] else ""
                lines.append(f"- {mark}: {name} / {section}: {check['name']}{detail}")
    return ["", "## Checks made while measuring", "", *lines] if lines else []


def render(payload: dict[str, Any]) -> str:
    """The whole report."""
    lines = _header(payload) + _parts(payload)
    lines += _correctness(payload["parts"].get("correctness", {}))
    lines += _measurements(payload) + _checks(payload)
    return "\n".join(lines) + "\n"
