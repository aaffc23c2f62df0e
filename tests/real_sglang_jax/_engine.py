"""Engine launches for the tests: tests/real_sglang_jax/engine_run.py in a subprocess, with the
CPU harness (cpu_harness.py) in every process it starts, and its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DRAFT = os.path.join(ROOT, ".sglang-jax", "eagle3-draft")
#: what the engine runs generate: the sample cases, a few tokens each (CPU time)
MAX_NEW_TOKENS = 20
INSTALL_LINE = "portable_spec: sglang-jax cddbf6f1 patched"


def launch(out_dir: Path, config: dict, env: dict | None = None) -> tuple[dict | None, str, int]:
    """Run one engine; returns (report or None when the run failed, its stderr, exit code)."""
    out = out_dir / "report.json"
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(HERE, "harness_site"), full_env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    full_env["PORTABLE_SPEC_SGLANG_JAX_CPU_HARNESS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-P", os.path.join(HERE, "engine_run.py"), str(out), json.dumps(config)],
        env=full_env,
        capture_output=True,
        text=True,
    )
    report = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
    return report, proc.stderr, proc.returncode


def eagle3(topk: int, steps: int, nodes: int, **config: Any) -> dict:
    """An in-process EAGLE-3 engine (its scheduler in a thread of the run), the integration
    installed there, without the overlap schedule (sglang-jax's EAGLE-3 path on CPU)."""
    engine = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": DRAFT,
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": nodes,
        "disable_overlap_schedule": True,
        "enable_single_process": True,
    }
    return {"engine": engine, "install": True, **config}
