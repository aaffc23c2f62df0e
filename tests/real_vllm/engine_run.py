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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ngram_engine import ngram_llm, set_env  # noqa: E402

set_env()

from prompts import K, prompts_for  # noqa: E402


def main(backend: str, out_path: str, batches: list[int], modes: list[str]) -> None:
    """Generate every (mode, batch) and write the JSON report to ``out_path``."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from portable_spec.integrations import vllm as plugin

    llm = ngram_llm(K, max(batches), backend)
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
