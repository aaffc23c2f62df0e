"""What the in-process engine runs share: vLLM's environment for one CPU process, one engine
with n-gram speculation over the test model (``engine_run.py``, ``forced_run.py``), and the
tests' way of running such a script in a process of its own and reading its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

#: set (unless already set) before vLLM is imported: the engine core in this process, nothing
#: from a model hub, a small KV cache, no periodic plugin log lines
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PORTABLE_SPEC_VLLM_LOG_EVERY": "0",
}


def set_env() -> None:
    for name, value in ENV.items():
        os.environ.setdefault(name, value)


def ngram_llm(k: int, max_num_seqs: int, backend: str, *, reasoning: bool = False) -> Any:
    """vLLM's ``LLM`` over the test model (``PORTABLE_SPEC_VLLM_MODEL`` or ``.vllm-model``):
    float32, greedy-repeatable (seed 0, no prefix caching), n-gram speculation of ``k`` tokens,
    structured outputs by ``backend``; ``reasoning``: with ``period_reasoner.py``'s parser
    (``enable_in_reasoning`` off: a prompt without a period reasons until the model writes one)."""
    from vllm import LLM

    model = os.environ.get(
        "PORTABLE_SPEC_VLLM_MODEL", os.path.join(HERE, "..", "..", ".vllm-model")
    )
    return LLM(
        model=os.path.abspath(model),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
        },
        structured_outputs_config={"backend": backend, **_reasoner(reasoning)},
        seed=0,
    )


def _reasoner(on: bool) -> dict[str, str]:
    if not on:
        return {}
    return {
        "reasoning_parser": "period_think",
        "reasoning_parser_plugin": os.path.join(HERE, "period_reasoner.py"),
    }


def run_report(script: str, args: list[str], out: Any, env: dict[str, str]) -> dict:
    """Run ``script`` (a file of this folder) with ``args`` in a process of its own, then read
    the JSON report it wrote to ``out``; the process's output is the report's ``log``. Fails
    the calling test, with the end of its stderr, when the process fails."""
    import pytest

    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.fail(f"engine run failed ({script} {' '.join(args)}):\n{proc.stderr[-4000:]}")
    with open(out) as f:
        report = json.load(f)
    report["log"] = proc.stdout + proc.stderr
    return report
