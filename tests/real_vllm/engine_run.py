"""Run real vLLM (in-process engine) over the test prompts, plugin off / on / shadow.

Usage: ``python tests/vllm/engine_run.py BACKEND OUT.json [BATCH ...]``. One engine start:
the plugin is installed, switched and uninstalled between generate calls, so the three modes see
the same engine, weights and scheduler. Writes the token ids of every output per mode and
batch, the shadow mode's row counts and the per-call timings.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("PORTABLE_SPEC_VLLM_LOG_EVERY", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from prompts import K, prompts_for  # noqa: E402


def main(backend: str, out_path: str, batches: list[int], modes: list[str]) -> None:
    """Generate every (mode, batch) and write the JSON report to ``out_path``."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from portable_spec.integrations import vllm as plugin

    model = os.environ.get(
        "PORTABLE_SPEC_VLLM_MODEL", os.path.join(HERE, "..", "..", ".vllm-model")
    )
    llm = LLM(
        model=os.path.abspath(model),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max(batches),
        enable_prefix_caching=False,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
        },
        structured_outputs_config={"backend": backend},
        seed=0,
    )
    report: dict = {"backend": backend, "k": K, "runs": {}}
    for mode in modes:
        if mode == "off":
            plugin.uninstall()
        else:
            assert plugin.install(mode)
        plugin.reset_stats()
        for batch in batches:
            cases = prompts_for(batch)
            params = [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=c["max_tokens"],
                    structured_outputs=StructuredOutputsParams(**c["constraint"]),
                )
                for c in cases
            ]
            for _ in range(int(os.environ.get("PORTABLE_SPEC_TEST_REPEAT", "1"))):
                outputs = llm.generate([c["prompt"] for c in cases], params, use_tqdm=False)
            report["runs"][f"{mode}/{batch}"] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "texts": [o.outputs[0].text for o in outputs],
                "finish": [o.outputs[0].finish_reason for o in outputs],
            }
        report["runs"][f"{mode}/stats"] = plugin.integration_stats()
    plugin.uninstall()
    with open(out_path, "w") as f:
        json.dump(report, f, default=str)


if __name__ == "__main__":
    args = sys.argv[1:]
    modes = os.environ.get("PORTABLE_SPEC_TEST_MODES", "off,on,shadow").split(",")
    main(args[0], args[1], [int(b) for b in args[2:]] or [1, 16], modes)
