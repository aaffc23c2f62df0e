"""Tables (Markdown), target checks, JSON and the build plot of a benchmark run."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tools.bench.build import BUILD_LABELS, BUILD_METHODS
from tools.bench.timing import geomean

__all__ = [
    "Target",
    "apply_table",
    "build_table",
    "chains_table",
    "evaluate_targets",
    "meta_lines",
    "overlap_table",
    "plot_build",
    "staging_table",
    "targets_table",
    "write_json",
]


def _ms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def _x(ratio: float) -> str:
    return "n/a" if not math.isfinite(ratio) else f"{ratio:.2f}x"


def _bg(record: dict[str, Any]) -> str:
    busy = record.get("other_busy_cores")
    return "?" if busy is None else f"{busy:.2f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def meta_lines(meta: dict[str, Any]) -> str:
    """The run's machine and settings, one per line (printed above the tables)."""
    keys = [
        ("machine", "machine"),
        ("cores", "usable cores"),
        ("threads", "portable_spec threads"),
        ("torch_threads", "torch threads"),
        ("background_busy_cores", "background load before the run (busy cores)"),
        ("versions", "versions"),
        ("command", "command"),
        ("wall_seconds", "wall time (s)"),
    ]
    out = []
    for key, label in keys:
        if key in meta:
            value = meta[key]
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items())
            elif isinstance(value, float):
                value = f"{value:.2f}"
            out.append(f"- {label}: {value}")
    return "\n".join(out)


def build_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per build configuration: medians (ms), speedups of portable_spec over each
    peer (peer / ours), cost per accepted node and the distance to ``T1 / cores``."""
    if not records:
        return ""
    cores = records[0]["cores"]
    header = [
        "vocab",
        "grammar",
        "shape",
        "nodes",
        "batch",
        "accepted",
        "ours ms",
        "xgr reused ms",
        "xgr fresh ms",
        "python ms",
        "vs xgr reused",
        "vs xgr fresh",
        "vs python",
        "ours us/acc",
        "xgr us/acc",
        f"ideal ms (T1/{cores})",
        "ours/ideal",
        "check",
        "bg",
    ]
    rows = []
    for r in records:
        s, sp, per = r["seconds"], r["speedup"], r["us_per_accepted_node"]
        ok = r.get("masks_identical") and r.get("accepted_matches")
        rows.append(
            [
                r.get("vocab", "SmolLM2 49152"),
                r["kind"],
                r["shape"],
                str(r["nodes"]),
                str(r["batch"]),
                f"{r['accepted_nodes']:.0f}",
                _ms(s["portable_spec"]),
                _ms(s["xgr_loop_reused"]),
                _ms(s["xgr_loop_fresh"]),
                _ms(s["python_dfs"]),
                _x(sp["xgr_loop_reused"]),
                _x(sp["xgr_loop_fresh"]),
                _x(sp["python_dfs"]),
                f"{per['portable_spec']:.2f}",
                f"{per['xgr_loop_reused']:.2f}",
                _ms(r["ideal_seconds"]),
                f"{r['ours_over_ideal']:.2f}",
                "ok" if ok else "MISMATCH",
                _bg(r),
            ]
        )
    return _table(header, rows)


def engines_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per engine configuration: medians (ms) and speedups over the engine's own
    per-node loop (and llguidance's parallel chain fill, on chains)."""
    if not records:
        return ""
    header = [
        "engine",
        "grammar",
        "shape",
        "nodes",
        "batch",
        "live rows",
        "ours ms",
        "engine loop ms",
        "vs engine loop",
        "par chain fill ms",
        "vs par chain fill",
        "check",
        "bg",
    ]
    rows = []
    for r in records:
        s, sp = r["seconds"], r["speedup"]
        par = "engine_par_chain" in s
        rows.append(
            [
                r["engine"],
                r["kind"],
                r["shape"],
                str(r["nodes"]),
                str(r["batch"]),
                str(r["live_rows"]),
                _ms(s["portable_spec"]),
                _ms(s["engine_loop"]),
                _x(sp["engine_loop"]),
                _ms(s["engine_par_chain"]) if par else "-",
                _own(r, "engine_par_chain") if par else "-",
                "ok" if r.get("rows_agree") else "MISMATCH",
                _bg(r),
            ]
        )
    return _table(header, rows)


def _own(record: dict[str, Any], method: str) -> str:
    """The speedup over ``method``, printed as "engine's own" where the integrations give the
    record's shape to that method of the engine's (``engine_own``)."""
    ratio = _x(record["speedup"][method])
    return f"engine's own ({ratio})" if record.get("engine_own") == method else ratio


def chains_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per ``(K, batch)`` of the chains section: medians (ms) and speedups over the
    serial fill (drafts validated beforehand, untimed) and over validation + fill."""
    if not records:
        return ""
    header = [
        "vocab",
        "K",
        "batch",
        "reasoning",
        "ends in window",
        "ours ms",
        "serial fill ms",
        "validate + fill ms",
        "vs serial fill",
        "vs validate + fill",
        "check",
        "bg",
    ]
    rows = []
    for r in records:
        s, sp = r["seconds"], r["speedup"]
        rows.append(
            [
                r.get("vocab", "SmolLM2 49152"),
                str(r["k"]),
                str(r["batch"]),
                f"{100 * r['reasoning_share']:.0f}%",
                f"{r['ends_in_window']:g}",
                _ms(s["portable_spec"]),
                _ms(s["serial_fill"]),
                _ms(s["validate_fill"]),
                _x(sp["serial_fill"]),
                _x(sp["validate_fill"]),
                "ok" if r.get("rows_identical") else "MISMATCH",
                _bg(r),
            ]
        )
    return _table(header, rows)


def staging_table(records: Sequence[dict[str, Any]]) -> str:
    """Tree download and mask upload: medians per method (ms) and plain / library."""
    if not records:
        return ""
    names: list[str] = []
    for r in records:
        names += [n for n in r["seconds"] if n not in names]
    header = ["framework", "operation", "batch x nodes", "KiB", *[f"{n} ms" for n in names]]
    header += ["plain / library", "bg"]
    rows = []
    for r in records:
        rows.append(
            [
                r["framework"],
                r["operation"],
                f"{r['batch']} x {r['nodes']}",
                f"{r['bytes'] / 1024:.0f}",
                *[_ms(r["seconds"].get(n, float("nan"))) for n in names],
                _x(r["plain_over_library"]),
                _bg(r),
            ]
        )
    return _table(header, rows)


def apply_table(records: Sequence[dict[str, Any]]) -> str:
    """Apply per framework and dtype: medians (ms), apply / floor, apply / numpy copy."""
    if not records:
        return ""
    names: list[str] = []
    for r in records:
        names += [n for n in r["seconds"] if n not in names]
    header = ["framework", "dtype", "rows x vocab", *[f"{n} ms" for n in names]]
    header += [
        "apply GB/s",
        "apply / floor",
        "donating apply / floor",
        "donating apply / np copy",
        "bg",
    ]
    rows = []
    for r in records:
        rows.append(
            [
                r["framework"],
                r["dtype"],
                f"{r['rows']} x {r['vocab']}",
                *[_ms(r["seconds"].get(n, float("nan"))) for n in names],
                f"{r['apply_gbps']:.1f}",
                f"{r['apply_over_floor']:.2f}",
                _opt(r, "donating_apply_over_floor"),
                _opt(r, "donating_apply_over_numpy_copy"),
                _bg(r),
            ]
        )
    return _table(header, rows)


def _opt(record: dict[str, Any], key: str) -> str:
    return f"{record[key]:.2f}" if key in record else ""


def overlap_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per stand-in forward: medians (ms), the hidden share of the build."""
    if not records:
        return ""
    header = [
        "framework",
        "stand-in forward",
        "workload",
        "forward ms",
        "dispatch ms",
        "build ms",
        "serial step ms",
        "overlapped step ms",
        "build hidden",
        "overlapped / serial",
        "bg",
    ]
    rows = []
    for r in records:
        s = r["seconds"]
        rows.append(
            [
                r["framework"],
                f"{r['forward']} ({r['forward_busy_cores']:.1f} cores busy)",
                f"{r['kind']} {r['shape']} bs={r['batch']} n={r['nodes']}, {r['threads']} threads",
                _ms(s["forward"]),
                _ms(r["forward_dispatch_seconds"]),
                _ms(s["build"]),
                _ms(s["serial step"]),
                _ms(s["overlapped step"]),
                f"{100 * r['hidden_fraction']:.0f}%",
                f"{r['overlapped_over_serial']:.2f}",
                _bg(r),
            ]
        )
    return _table(header, rows)


@dataclass(frozen=True)
class Target:
    """A target of the issue and the figures of this run that decide it."""

    name: str
    bound: str
    ratios: list[tuple[str, float]]
    met: bool | None

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        values = [v for _, v in self.ratios]
        return {
            "name": self.name,
            "bound": self.bound,
            "met": self.met,
            "geomean": geomean(values) if values else None,
            "worst": (min(values) if self.bound.startswith(">=") else max(values))
            if values
            else None,
            "configs": {k: v for k, v in self.ratios},
        }


def _target(
    name: str,
    records: Sequence[dict[str, Any]],
    select: Callable[[dict[str, Any]], bool],
    value: Callable[[dict[str, Any]], float],
    label: Callable[[dict[str, Any]], str],
    bound: str,
) -> Target:
    ratios = [(label(r), value(r)) for r in records if select(r)]
    if not ratios:
        return Target(name, bound, [], None)
    op, limit = bound.split()
    lim = float(limit.rstrip("x"))
    ok = all((v >= lim) if op == ">=" else (v <= lim) for _, v in ratios)
    return Target(name, bound, ratios, ok)


def evaluate_targets(
    build: Sequence[dict[str, Any]], apply: Sequence[dict[str, Any]]
) -> list[Target]:
    """The issue's targets, each over every configuration of this run it applies to."""

    def cfg(r: dict[str, Any]) -> str:
        return f"{r['kind']}/{r['shape']}/n{r['nodes']}/bs{r['batch']}"

    def vs(peer: str) -> Callable[[dict[str, Any]], float]:
        return lambda r: r["speedup"][peer]

    targets = [
        _target(
            "build bs64, 64 nodes: portable_spec / xgrammar loop (reused buffer)",
            build,
            lambda r: r["batch"] == 64 and r["nodes"] == 64,
            vs("xgr_loop_reused"),
            cfg,
            ">= 1.6x",
        ),
        _target(
            "build bs64, 16 nodes: portable_spec / xgrammar loop (reused buffer)",
            build,
            lambda r: r["batch"] == 64 and r["nodes"] == 16,
            vs("xgr_loop_reused"),
            cfg,
            ">= 1.4x",
        ),
        _target(
            "build bs64: portable_spec / Python traversal",
            build,
            lambda r: r["batch"] == 64,
            vs("python_dfs"),
            cfg,
            ">= 5x",
        ),
        _target(
            "build bs64: portable_spec time / ideal (T1 / cores)",
            build,
            lambda r: r["batch"] == 64,
            lambda r: r["ours_over_ideal"],
            cfg,
            "<= 1.25x",
        ),
        _target(
            "build bs1: portable_spec / xgrammar loop (reused buffer)",
            build,
            lambda r: r["batch"] == 1,
            vs("xgr_loop_reused"),
            cfg,
            ">= 0.9x",
        ),
        _target(
            "apply, JAX donating jit: time / numpy copy of the logits",
            apply,
            lambda r: r["framework"] == "jax",
            lambda r: r["donating_apply_over_numpy_copy"],
            lambda r: f"{r['dtype']} {r['rows']}x{r['vocab']}",
            "<= 1x",
        ),
        _target(
            "apply, JAX donating jit: time / elementwise select in a donating jit",
            apply,
            lambda r: r["framework"] == "jax",
            lambda r: r["donating_apply_over_floor"],
            lambda r: f"{r['dtype']} {r['rows']}x{r['vocab']}",
            "<= 1.2x",
        ),
    ]
    return targets


def targets_table(targets: Sequence[Target], cores: int) -> str:
    """One row per target: bound, geometric mean and worst configuration, met or missed."""
    header = [f"target ({cores} cores)", "bound", "configs", "geomean", "worst", "met"]
    rows = []
    for t in targets:
        d = t.as_dict()
        if t.met is None:
            rows.append([t.name, t.bound, "0", "", "", "not run"])
            continue
        worst_cfg = min(t.ratios, key=lambda kv: kv[1] if t.bound.startswith(">=") else -kv[1])
        rows.append(
            [
                t.name,
                t.bound,
                str(len(t.ratios)),
                f"{d['geomean']:.2f}",
                f"{worst_cfg[1]:.2f} ({worst_cfg[0]})",
                "met" if t.met else "MISSED",
            ]
        )
    return _table(header, rows)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write the run's results (``-``: stdout)."""
    text = json.dumps(payload, indent=2, sort_keys=False, default=_json_default)
    if path == "-":
        print(text)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Target):
        return value.as_dict()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


_STYLES = {
    "portable_spec": {"color": "tab:blue", "marker": "o", "linewidth": 2.2},
    "xgr_loop_reused": {"color": "tab:orange", "marker": "s"},
    "xgr_loop_fresh": {"color": "tab:green", "marker": "^"},
    "python_dfs": {"color": "tab:red", "marker": "v"},
}


def plot_build(records: Sequence[dict[str, Any]], path: str, *, title: str) -> None:
    """Build time (ms, log) against batch size (log), one line per method and the ideal
    ``T1 / cores`` dashed; one panel per grammar (rows) and tree shape / node count (columns).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in records))
    columns = list(dict.fromkeys((r["shape"], r["nodes"]) for r in records))
    fig, axes = plt.subplots(
        len(kinds),
        len(columns),
        figsize=(3.6 * len(columns) + 1, 2.9 * len(kinds) + 1.2),
        squeeze=False,
        sharex=True,
    )
    for i, kind in enumerate(kinds):
        for j, (shape, nodes) in enumerate(columns):
            ax = axes[i][j]
            rows = sorted(
                (r for r in records if (r["kind"], r["shape"], r["nodes"]) == (kind, shape, nodes)),
                key=lambda r: r["batch"],
            )
            if not rows:
                ax.set_visible(False)
                continue
            batches = [r["batch"] for r in rows]
            for name in BUILD_METHODS:
                ax.plot(
                    batches,
                    [r["seconds"][name] * 1e3 for r in rows],
                    label=BUILD_LABELS[name],
                    **_STYLES[name],
                )
            ax.plot(
                batches,
                [r["ideal_seconds"] * 1e3 for r in rows],
                "k--",
                linewidth=1,
                label=f"ideal: xgrammar loop / {rows[0]['cores']} cores",
            )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(batches)
            ax.set_xticklabels([str(b) for b in batches])
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{kind}, {shape}, {nodes} nodes", fontsize=9)
            if j == 0:
                ax.set_ylabel("build time (ms)")
            if i == len(kinds) - 1:
                ax.set_xlabel("batch size")
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 3 if len(columns) >= 3 else 2
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    legend_rows = -(-len(labels) // ncol)
    bottom = min(0.3, 0.035 * legend_rows * 8 / (2.9 * len(kinds) + 1.2))
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
