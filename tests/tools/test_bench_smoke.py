"""Smoke test of ``scripts/bench.sh --quick``: it runs, writes sane JSON and a plot.

Never asserts a speed (the machine may be busy); only that every figure is a finite positive
number, that every section produced its records and that the library's masks matched the
Python traversal's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.slow  # a whole quick benchmark run: over a minute


def _finite_positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


# the checkout
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = str(out / "bench.json"), str(out / "bench.png")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the test suite's 8 virtual CPU devices are not the bench's
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench",
            "--quick",
            "--json",
            json_path,
            "--plot",
            plot_path,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,  # the tools run from the checkout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(json_path, encoding="utf-8") as f:
        payload = json.load(f)
    return payload, plot_path, proc.stdout


def test_meta(quick_run):
    payload, _, _ = quick_run
    meta = payload["meta"]
    assert meta["preset"] == "quick"
    assert meta["cores"] >= 1 and meta["threads"] >= 1
    assert meta["vocab_size"] == 49152
    assert meta["wall_seconds"] > 0
    assert {"numpy", "torch", "jax", "xgrammar"} <= set(meta["versions"])


def test_build_records(quick_run):
    payload, _, _ = quick_run
    build = payload["build"]
    # quick: 2 grammars x 2 shapes x 1 node count x 2 batch sizes
    assert len(build) == 8
    assert {(r["kind"], r["shape"], r["batch"]) for r in build} == {
        (k, s, b) for k in ("json_schema", "regex") for s in ("tree", "chain") for b in (1, 8)
    }
    methods = {"portable_spec", "xgr_loop_reused", "xgr_loop_fresh", "python_dfs"}
    for r in build:
        assert r["masks_identical"] is True, r
        assert r["accepted_matches"] is True, r
        assert r["rounds"] >= 3
        assert r["accepted_nodes"] >= 1
        assert r["cores"] >= 1
        assert set(r["seconds"]) == methods
        assert all(_finite_positive(v) for v in r["seconds"].values()), r
        assert all(_finite_positive(v) for v in r["us_per_accepted_node"].values()), r
        assert set(r["speedup"]) == methods - {"portable_spec"}
        assert all(_finite_positive(v) for v in r["speedup"].values()), r
        assert _finite_positive(r["ideal_seconds"]) and _finite_positive(r["ours_over_ideal"])


def test_other_sections(quick_run):
    payload, _, _ = quick_run
    staging = payload["staging"]
    assert {(r["framework"], r["operation"]) for r in staging} == {
        (f, op) for f in ("torch", "jax") for op in ("tree download", "mask upload")
    }
    for r in staging:
        assert all(_finite_positive(v) for v in r["seconds"].values()), r
        assert _finite_positive(r["plain_over_library"])

    apply = payload["apply"]
    assert {(r["framework"], r["dtype"]) for r in apply} == {
        ("numpy", "float32"),
        ("torch", "float32"),
        ("torch", "bfloat16"),
        ("jax", "float32"),
        ("jax", "bfloat16"),
    }
    for r in apply:
        assert r["vocab"] == 131072
        assert all(_finite_positive(v) for v in r["seconds"].values()), r
        assert _finite_positive(r["apply_over_floor"])
        if r["framework"] == "jax":
            assert _finite_positive(r["donating_apply_over_numpy_copy"])

    overlap = payload["overlap"]
    assert [r["forward"] for r in overlap] == ["one core", "all cores"]
    for r in overlap:
        assert all(_finite_positive(v) for v in r["seconds"].values()), r
        assert _finite_positive(r["forward_dispatch_seconds"])
        assert _finite_positive(r["forward_busy_cores"])
        assert math.isfinite(r["hidden_fraction"])


def test_layout_and_async_sections(quick_run):
    """quick: SmolLM2, bs 8 x 16 nodes; both layouts, the same mask, K rows uploaded."""
    payload, _, stdout = quick_run
    (layout,) = payload["layout"]
    assert (layout["batch"], layout["nodes"], layout["vocab_size"]) == (8, 16, 49152)
    assert set(layout["seconds"]) == {"xgr_loop_reused", "dense", "compact"}
    assert all(_finite_positive(v) for v in layout["seconds"].values()), layout
    assert layout["masks_identical"] is True and layout["listed_matches_accepted"] is True
    assert layout["upload_is_k_rows_plus_index"] is True
    written = layout["host_bytes_written"]
    assert written["compact"] < written["dense"] == 8 * 16 * 1536 * 4
    assert set(layout["apply"]) == {"numpy", "torch", "jax"}
    for seconds in layout["apply"].values():
        assert len(seconds) == 2 and all(_finite_positive(v) for v in seconds.values())
    (pending,) = payload["async"]
    assert set(pending["seconds"]) == {
        "blocking",
        "wait=False (call returns)",
        "wait=False to result()",
    }
    assert all(_finite_positive(v) for v in pending["seconds"].values())
    assert "## Mask layouts: host build" in stdout and "## wait=False" in stdout


def test_targets_and_outputs(quick_run):
    payload, plot_path, stdout = quick_run
    names = [t["name"] for t in payload["targets"]]
    assert len(names) == 11
    bs1 = next(t for t in payload["targets"] if "bs1" in t["name"])
    assert bs1["met"] in (True, False) and len(bs1["configs"]) == 4
    assert "## Host mask build (" in stdout and "cores" in stdout
    with open(plot_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_routes_bench_help(capsys):
    from tools import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_engines_section(quick_run):
    """Every installed engine against its own loop: both shapes, rows agree with the loop."""
    from tools.bench.engines import available_engines

    payload, _, stdout = quick_run
    records = payload["engines"]
    assert {r["engine"] for r in records} == set(available_engines())
    assert {r["shape"] for r in records} == {"tree", "chain"}
    for r in records:
        assert r["rows_agree"], r
        assert r["live_rows"] > 0
        assert all(_finite_positive(v) for v in r["seconds"].values()), r
        assert ("engine_par_chain" in r["seconds"]) == (
            r["engine"] == "llguidance" and r["shape"] == "chain"
        )
    assert "## Grammar engines" in stdout


def test_chains_section(quick_run):
    """vLLM-style chains: K 1 and 4 at batch 1 and 8, half the pool reasoning; the recipe's
    rows equal the serial fill's."""
    payload, _, stdout = quick_run
    records = payload["chains"]
    assert {(r["k"], r["batch"]) for r in records} == {(k, b) for k in (1, 4) for b in (1, 8)}
    for r in records:
        assert r["rows_identical"] is True, r
        assert r["rounds"] >= 3
        assert r["pool_reasoning_share"] == 0.5
        assert 0.0 <= r["reasoning_share"] <= 1.0
        assert set(r["seconds"]) == {"portable_spec", "serial_fill", "validate_fill"}
        assert all(_finite_positive(v) for v in r["seconds"].values()), r
        assert set(r["speedup"]) == {"serial_fill", "validate_fill"}
        assert all(_finite_positive(v) for v in r["speedup"].values()), r
    assert "## vLLM-style chains" in stdout


@pytest.mark.parametrize("value", ["2", "-0.5", "half", ""])
def test_chain_reasoning_option_is_checked(value):
    from tools.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--chain-reasoning", value])
    assert parse_args(["--chain-reasoning", "0,0.25"]).chain_reasoning == (0.0, 0.25)


def test_percall_section(quick_run):
    """One batch-1 call, phase by phase, warm and with the caches evicted."""
    from tools.bench.percall import PERCALL_PHASES

    payload, _, stdout = quick_run
    records = payload["percall"]
    assert [r["regime"] for r in records] == ["warm", "cold"]
    for r in records:
        assert (r["k"], r["batch"]) == (1, 1) and r["rounds"] >= 3
        assert set(r["us"]) == set(PERCALL_PHASES)
        assert all(_finite_positive(v) for v in r["us"].values()), r
        assert r["overhead_us"] == r["us"]["build"] - r["us"]["engine_walk"]
    assert "## One call, batch 1, K=1" in stdout


def test_per_call_targets_are_decided_by_the_records():
    """The targets table reads the sections' records: each bound applied to every
    configuration it names, a geomean target to the geomean, missing records: not run."""
    from tools.bench.percall import issue_targets

    def chain(k, batch, share, ratio):
        return {"k": k, "batch": batch, "pool_reasoning_share": share,
                "speedup": {"serial_fill": ratio, "validate_fill": ratio}}  # fmt: skip

    runs = {
        "chains": [chain(1, 1, 0.0, 0.9), chain(1, 8, 0.0, 3.0), chain(1, 1, 0.5, 0.7)],
        "percall": [
            {
                "regime": "warm",
                "k": 1,
                "overhead_us": 9.0,
                "overhead_packed_us": 11.0,
                "overhead_lists_us": 6.0,
            },
            {
                "regime": "cold",
                "k": 1,
                "overhead_us": 39.0,
                "overhead_packed_us": 30.0,
                "overhead_lists_us": 35.0,
            },
        ],
    }
    targets = {t.name: t for t in issue_targets(runs)}
    assert targets["vLLM chains, no reasoning: / serial fill, every config"].met is True
    assert targets["vLLM chains, no reasoning: / serial fill, batch >= 8"].met is True
    geo = targets["vLLM chains, no reasoning: / serial fill, geomean"]
    assert geo.met is True and abs(geo.ratios[0][1] - (0.9 * 3.0) ** 0.5) < 1e-9
    assert targets["vLLM chains, half reasoning: / serial fill, every config"].met is False
    assert targets["fixed cost bs1 K=1, warm: build - engine walk (µs)"].met is False
    assert targets["fixed cost bs1 K=1, cold: build - engine walk (µs)"].met is True
    assert targets["llguidance trees: / its own loop"].met is None  # not run


def test_the_engines_own_shapes_are_printed_so():
    """A shape the integrations give to the engine's own fill (``engine_own``) prints that
    comparison as "engine's own" (its ratio beside it) and leaves it out of the targets."""
    from tools.bench.percall import issue_targets
    from tools.bench.report import engines_table

    def record(shape, own):
        seconds = {"portable_spec": 1e-3, "engine_loop": 1.2e-3}
        if shape == "chain":
            seconds["engine_par_chain"] = 0.8e-3
        return {
            "engine": "llguidance", "kind": "json_schema", "shape": shape, "nodes": 16,
            "batch": 8, "live_rows": 90, "seconds": seconds, "rows_agree": True,
            "speedup": {k: v / 1e-3 for k, v in seconds.items() if k != "portable_spec"},
            "engine_own": own,
        }  # fmt: skip

    records = [record("tree", None), record("chain", "engine_par_chain")]
    table = engines_table(records)
    assert "engine's own (0.80x)" in table and table.count("engine's own") == 1
    targets = {t.name: t for t in issue_targets({"engines": records})}
    chains = targets["llguidance chains: / its best but the engine's own (parallel fill)"]
    assert chains.met is True and chains.ratios == [("n16/bs8", 1.2)]
    records[1]["engine_own"] = None  # compared with the parallel fill: missed
    targets = {t.name: t for t in issue_targets({"engines": records})}
    assert (
        targets["llguidance chains: / its best but the engine's own (parallel fill)"].met is False
    )
