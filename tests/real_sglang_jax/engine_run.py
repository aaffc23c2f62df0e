"""Run sglang-jax's engine (JAX CPU, SmolLM2) over grammar requests and write a JSON report.

Usage: ``python engine_run.py OUT.json [CONFIG_JSON]``. ``CONFIG_JSON`` keys: ``engine``
(extra ``Engine`` arguments: speculative settings, ``enable_single_process``...), ``install``
(call the integration's ``install()`` in this process: single-process engines), ``drafting``
(one generate call of every case per entry, grammar-aware drafting on or off), or ``calls``
(``[drafting, [case indices]]`` per generate call), ``timing``,
``max_new_tokens``, ``cases`` or ``case_indices`` (of :data:`CASES`), or ``requests`` (cases of
its own: ``prompt`` and ``json_schema`` or ``regex``). The integration's switch is the environment
(``PORTABLE_SPEC_SGLANG_JAX``), as a user sets it. Writes per request the output token ids,
text and finish reason, and (single-process engines) per call the integration's counters and
sglang-jax's idle-time KV check once the call's requests are done (``kv_leak``: its message,
``None`` when every KV slot is free or cached).
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODEL = os.path.join(ROOT, ".sglang-jax", "smollm2")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lima", "Oslo", "Kyoto"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# A second schema: sglang-jax hands requests with the same grammar, compiled concurrently, one
# shared grammar object (its matcher then advances for both), so every request gets its own.
PET = {
    "type": "object",
    "properties": {
        "pet": {"enum": ["cat", "dog", "owl"]},
        "name": {"type": "string", "maxLength": 12},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    },
    "required": ["pet", "name", "legs"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CASES = [
    {"prompt": "A person described as JSON: ", "json_schema": json.dumps(SCHEMA)},
    {"prompt": "The date of the meeting, as YYYY-MM-DD: ", "regex": DATE},
    {"prompt": "Once upon a time", "constraint": None},
    {"prompt": "A pet, as JSON: ", "json_schema": json.dumps(PET)},
]


def sampling_params(case: dict, max_new_tokens: int) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    for key in ("json_schema", "regex"):
        if key in case:
            params[key] = case[key]
    return params


def main(out_path: str, config: dict) -> None:
    """Start the engine, generate every case (one batch), write the report."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, HERE)
    import cpu_harness

    cpu_harness.activate()
    if config.get("install"):
        from portable_spec.integrations import sglang_jax

        assert sglang_jax.install()
        sglang_jax.set_timing(bool(config.get("timing")))
    from sgl_jax.srt.entrypoints.engine import Engine

    kwargs = {
        "model_path": config.get("model", MODEL),
        "device": "cpu",
        "attention_backend": "native",
        "dtype": "float32",
        "max_total_tokens": 4096,
        "max_running_requests": 4,
        "chunked_prefill_size": 512,
        "max_prefill_tokens": 512,
        "skip_server_warmup": True,
        "disable_precompile": True,
        "grammar_backend": "llguidance",
        "random_seed": 0,
        "log_level": "info",
    }
    kwargs.update(config.get("engine", {}))
    started = time.perf_counter()
    engine = Engine(**kwargs)
    report: dict = {"start_s": time.perf_counter() - started, "runs": []}
    max_new = int(config.get("max_new_tokens", 48))
    cases = config.get("requests") or [
        CASES[i] for i in config.get("case_indices", range(int(config.get("cases", len(CASES)))))
    ]
    drafting = config.get("drafting", [True] * int(config.get("repeat", 1)))
    calls = config.get("calls") or [(d, list(range(len(cases)))) for d in drafting]
    for draft_masks, picked in calls:
        if config.get("install"):
            from portable_spec.integrations import sglang_jax

            sglang_jax.reset_stats()
            sglang_jax.set_drafting(bool(draft_masks))
        batch = [cases[i] for i in picked]
        t0 = time.perf_counter()
        outs = engine.generate(
            prompt=[c["prompt"] for c in batch],
            sampling_params=[sampling_params(c, max_new) for c in batch],
        )
        run = {
            "drafting": bool(draft_masks),
            "cases": picked,
            "seconds": time.perf_counter() - t0,
            "ids": [o["output_ids"] for o in outs],
            "texts": [o["text"] for o in outs],
            "finish": [o["meta_info"]["finish_reason"] for o in outs],
            "completion_tokens": [o["meta_info"]["completion_tokens"] for o in outs],
        }
        if kwargs.get("enable_single_process"):  # its scheduler runs in this process
            run["kv_leak"] = cpu_harness.kv_check_after(cpu_harness.KV_CHECK["checks"])
        if config.get("install"):
            from portable_spec.integrations import sglang_jax

            run["stats"] = sglang_jax.integration_stats()
        report["runs"].append(run)
    report["cases"] = cases
    with open(out_path, "w") as f:
        json.dump(report, f, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    engine.shutdown()
    os._exit(0)  # the engine's threads and child processes are gone; skip interpreter teardown


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
