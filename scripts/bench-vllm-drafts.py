"""Forced drafts inside real vLLM: forward steps, tokens per step and wall time, plugin off,
masks only, forced drafts; n-gram speculation at K=4 and K=8.

Usage: ``.venv-vllm/bin/python scripts/bench-vllm-drafts.py [--k 4 8] [--requests 12]
[--rounds 3] [--workloads invoice tool_call free regex] [--json OUT]``
(``bash scripts/setup-vllm.sh`` first; in-process engine, SmolLM2-135M fp32 on the CPU);
``--tables OUT.json ...`` prints the tables of earlier runs again.

One engine per K. Each round runs every workload under the three modes in a random order
(interleaved: the machine's load falls on all alike), each a ``generate`` call of
``--requests`` greedy requests:

* ``off``: vLLM alone (``PORTABLE_SPEC_VLLM`` unset);
* ``masks``: the plugin builds the masks, vLLM's drafts (``PORTABLE_SPEC_FORCED_DRAFTS=0``);
* ``forced``: the plugin on, forced drafts on, cold: what the model wrote at forced texts is
  forgotten before the call (``forced-only``, ``forced+writings``, ``forced+lookup``: parts
  of it, see ``VARIANTS``);
* ``forced-warm``: the same after an untimed call of the same workload on other prompts (a
  server that has seen the schema before).

Workloads: ``invoice`` and ``tool_call`` (``portable_spec.testing.SCHEMA_WORKLOADS``: the JSON
schemas and prompts of every engine's drafting tables), ``free`` (no constraint) and
``regex`` (an ISO date list: nothing forced but the separators). Counted per call: forward
steps (scheduler steps that ran the model), output tokens, drafts scheduled and accepted
(vLLM's spec-decode counters), forced tokens drafted and accepted (the plugin's), wall time
and the process's CPU time. Every mode's outputs are compared token for token with ``off`` and
checked against their constraint. Prints medians over rounds and the ratios against ``off``,
and per workload the copy floor (:func:`floor_steps`): the fewest forward steps any drafter
copying from the request's own tokens, with the grammar's forced tokens, could reach.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("PORTABLE_SPEC_VLLM_LOG_EVERY", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("off", "masks", "forced")
#: the forced mode's variants (environment of the plugin's drafts): forced text alone, with
#: the model's writings remembered, with the lookup after the forced tokens, both (default)
VARIANTS = {
    "forced-only": {"PORTABLE_SPEC_FORCED_WRITINGS": "0", "PORTABLE_SPEC_FORCED_LOOKUP": "0"},
    "forced+writings": {"PORTABLE_SPEC_FORCED_WRITINGS": "1", "PORTABLE_SPEC_FORCED_LOOKUP": "0"},
    "forced+lookup": {"PORTABLE_SPEC_FORCED_WRITINGS": "0", "PORTABLE_SPEC_FORCED_LOOKUP": "1"},
    "forced": {"PORTABLE_SPEC_FORCED_WRITINGS": "1", "PORTABLE_SPEC_FORCED_LOOKUP": "1"},
    "forced-warm": {"PORTABLE_SPEC_FORCED_WRITINGS": "1", "PORTABLE_SPEC_FORCED_LOOKUP": "1"},
}
DATES = r"20[0-9]{2}-[01][0-9]-[0-3][0-9](, 20[0-9]{2}-[01][0-9]-[0-3][0-9]){3}"
FREE_PROMPT = "Write a short paragraph about the history of the bicycle."
REGEX_PROMPT = "List four dates in 2024 as YYYY-MM-DD, comma separated: "


def workloads(names: list[str]) -> dict[str, tuple[str, dict | None, int]]:
    """``name -> (prompt, structured-output arguments or None, max_tokens)``."""
    from portable_spec.testing import SCHEMA_WORKLOADS

    every = {
        name: (prompt, {"json": schema}, 384) for name, (schema, prompt) in SCHEMA_WORKLOADS.items()
    }
    every["free"] = (FREE_PROMPT, None, 96)
    every["regex"] = (REGEX_PROMPT, {"regex": DATES}, 64)
    return {name: every[name] for name in names}


class StepCounter:
    """Counts the scheduler's steps that ran the model and the tokens they scheduled."""

    def __init__(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        self.steps = 0
        self.tokens = 0
        original = Scheduler.schedule

        def schedule(sched: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(sched, *args, **kwargs)
            if out.total_num_scheduled_tokens > 0:
                self.steps += 1
                self.tokens += out.total_num_scheduled_tokens
            return out

        Scheduler.schedule = schedule


def set_mode(plugin: Any, mode: str) -> None:
    if mode == "off":
        plugin.uninstall()
        return
    os.environ[plugin.FORCED_ENV_VAR] = "0" if mode == "masks" else "1"
    os.environ.update(VARIANTS.get(mode, {}))
    assert plugin.install("on")  # reads the switches


def valid(text: str, constraint: dict | None) -> bool:
    if constraint is None:
        return True
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    from jsonschema import validate

    try:
        validate(json.loads(text), constraint["json"])
    except Exception:
        return False
    return True


def run_k(k: int, args: argparse.Namespace, rng: random.Random) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from portable_spec.integrations import vllm as plugin

    llm = LLM(
        model=os.path.join(ROOT, ".vllm-model"),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max(args.requests, 1),
        enable_prefix_caching=False,
        disable_log_stats=False,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
        },
        seed=0,
    )
    counter = StepCounter()
    results: dict = {}
    reference: dict = {}
    for round_ in range(args.rounds):
        cases = [(w, m) for w in workloads(args.workloads) for m in args.modes]
        rng.shuffle(cases)
        for name, mode in cases:
            prompt, constraint, max_tokens = workloads([name])[name]
            params = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                structured_outputs=None
                if constraint is None
                else StructuredOutputsParams(**constraint),
            )
            prompts = [f"Request {i}. {prompt}" for i in range(args.requests)]
            set_mode(plugin, mode)
            from portable_spec.integrations.vllm import drafts

            drafts.forget_writings()  # every call starts cold; -warm: after an untimed call
            if mode == "forced-warm":
                earlier = [f"Earlier request {i}. {prompt}" for i in range(args.requests)]
                llm.generate(earlier, [params] * len(earlier), use_tqdm=False)
            plugin.reset_stats()
            stats0 = _spec_counts(llm)
            counter.steps = counter.tokens = 0
            began, cpu_began = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
            wall = time.perf_counter() - began
            cpu = time.process_time() - cpu_began
            stats1 = _spec_counts(llm)
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            texts = [o.outputs[0].text for o in outputs]
            snap = plugin.integration_stats() if mode != "off" else {}
            record = {
                "steps": counter.steps,
                "scheduled": counter.tokens,
                "output_tokens": sum(map(len, tokens)),
                "wall_s": wall,
                "cpu_s": cpu,
                "drafts": stats1[0] - stats0[0],
                "accepted": stats1[1] - stats0[1],
                "forced_drafted": snap.get("forced_drafted", 0),
                "forced_accepted": snap.get("forced_accepted", 0),
                "valid": sum(valid(t, constraint) for t in texts),
                "finished": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
            }
            key = (name, mode)
            if round_ == 0 and mode == "off":
                reference[name] = tokens
                record["floor_steps"] = floor_steps(
                    llm, [o.prompt_token_ids for o in outputs], tokens, constraint, k
                )
            results.setdefault(key, []).append((record, tokens))
            print(f"K={k} round {round_} {name:9s} {mode:6s} {record}", file=sys.stderr)
    plugin.uninstall()
    table = {}
    for (name, mode), runs in results.items():
        same = all(tokens == reference[name] for _, tokens in runs)
        recs = [r for r, _ in runs]
        table[f"{name}/{mode}"] = {
            "identical_to_off": same,
            **{f: statistics.median(r[f] for r in recs if f in r) for f in recs[0]},
            "wall_s_all": [r["wall_s"] for r in recs],
        }
    del llm
    return table


def floor_steps(
    llm: Any, prompts: list[list[int]], outputs: list[list[int]], constraint: dict | None, k: int
) -> int:
    """The fewest forward steps in which any drafter that copies spans of a request's own
    prompt and output, with its grammar's forced tokens, could have written these outputs at K
    ``k`` (the slowest request's count, the prefill step included).

    A copying drafter proposes runs of tokens that followed a matched n-gram somewhere in the
    request's tokens: a token it drafts right after token ``a`` is one that followed ``a``
    somewhere before. So a token that is neither forced by the grammar at its position (the
    first of :func:`portable_spec.forced_drafts` there) nor ever seen after the token before it
    cannot be drafted by any such drafter: the model writes it, as the bonus token that ends a
    step. A step commits at most ``k + 1`` tokens. Counted this way the bound is generous (it
    assumes the drafter always picks the right copy among all candidates)."""
    import xgrammar as xgr

    import portable_spec as ps

    tokenizer = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.get_vocab_size()
    compiled = None
    if constraint is not None:
        compiler = xgr.GrammarCompiler(
            xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        )
        if "regex" in constraint:
            compiled = compiler.compile_regex(constraint["regex"])
        else:  # as vLLM compiles it by default (any whitespace)
            compiled = compiler.compile_json_schema(
                json.dumps(constraint["json"]), any_whitespace=True
            )
    worst = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        matcher = xgr.GrammarMatcher(compiled) if compiled is not None else None
        seen: set[tuple[int, int]] = set(itertools.pairwise(prompt))
        steps, run, last = 1, 0, prompt[-1]  # the prefill step writes output[0]
        for p, token in enumerate(output):
            if p:
                forced = []
                if matcher is not None:
                    forced = ps.forced_drafts(
                        [matcher], [[]], [1], tokenizer=tokenizer, vocab_size=vocab
                    )[0]
                if forced[:1] == [token] or (last, token) in seen:
                    run += 1
                else:  # the model's own token: it ends a step
                    steps += -(-(run + 1) // (k + 1))
                    run = 0
            if matcher is not None and not matcher.is_terminated():
                matcher.accept_token(token)
            seen.add((last, token))
            last = token
        steps += -(-run // (k + 1))
        worst = max(worst, steps)
    return worst


def _spec_counts(llm: Any) -> tuple[int, int]:
    """vLLM's own spec-decode counters: drafts scheduled and accepted so far."""
    drafts = accepted = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_draft_tokens":
            drafts += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(metric.value)
    return drafts, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["invoice", "tool_call", "free", "regex"])
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=["off", "masks", *VARIANTS]
    )
    parser.add_argument("--json", help="write the tables here too")
    parser.add_argument(
        "--tables",
        nargs="+",
        metavar="JSON",
        help="print the tables of earlier --json outputs (nothing is run)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tables:
        tables: dict = {}
        for path in args.tables:
            with open(path) as f:
                tables.update(json.load(f))
        print_tables(tables, args.workloads, args.modes)
        return
    rng = random.Random(args.seed)
    load = os.getloadavg()[0]
    if len(args.k) > 1:  # vLLM's CPU platform starts one engine per process: one K each
        tables = {}
        for k in args.k:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "k.json")
                cmd = [sys.executable, __file__, "--k", str(k), "--json", out]
                cmd += ["--requests", str(args.requests), "--rounds", str(args.rounds)]
                cmd += ["--seed", str(args.seed), "--workloads", *args.workloads]
                cmd += ["--modes", *args.modes]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    tables[k] = json.load(f)[str(k)]
    else:
        tables = {k: run_k(k, args, rng) for k in args.k}
    print(
        f"vLLM {_version()} n-gram speculation, {args.requests} greedy requests per call, "
        f"medians of {args.rounds} interleaved rounds; load average {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end on {os.cpu_count()} CPUs"
    )
    print_tables(tables, args.workloads, args.modes, args.requests)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): t for k, t in tables.items()}, f, indent=1)


def print_tables(
    tables: dict, names: list[str], modes: list[str], requests: int | None = None
) -> None:
    """One Markdown row per (K, workload, mode): forward steps (and ``off``'s / these), the
    fewest steps any copying drafter with the forced tokens could reach (:func:`floor_steps`,
    from ``off``'s outputs), output
    tokens per second of wall time, output tokens per forward step, vLLM's accepted drafts per
    forward step and per drafted token, the plugin's forced tokens drafted and accepted, wall
    time (and ``off``'s / this), the process's CPU time (and ``off``'s / this: steadier than wall
    time where other processes share the cores), outputs identical to ``off``, outputs valid."""
    print(
        "| K | workload | mode | forward steps | steps vs off | copy floor | output tok/s "
        "| tokens/step "
        "| accepted/step | accepted/drafted | forced drafted | forced accepted | wall s "
        "| wall vs off | CPU s | CPU vs off | identical | valid |"
    )
    print("|" + "---|" * 18)
    for k, table in tables.items():
        for name in names:
            off = table[f"{name}/off"]
            for mode in modes:
                r = table[f"{name}/{mode}"]
                acc = r["accepted"] / r["drafts"] if r["drafts"] else 0.0
                of = f"/{requests}" if requests else ""
                floor = off.get("floor_steps")
                floor_cell = f"{floor:.0f}" if floor else "-"
                print(
                    f"| {k} | {name} | {mode} | {r['steps']:.0f} | "
                    f"{off['steps'] / r['steps']:.2f}x | {floor_cell} | "
                    f"{r['output_tokens'] / r['wall_s']:.1f} | "
                    f"{r['output_tokens'] / r['steps']:.2f} | {r['accepted'] / r['steps']:.2f} | "
                    f"{acc:.2f} | {r['forced_drafted']:.0f} | {r['forced_accepted']:.0f} | "
                    f"{r['wall_s']:.1f} | {off['wall_s'] / r['wall_s']:.2f}x | {_cpu(r, off)} | "
                    f"{'yes' if r['identical_to_off'] else 'NO'} | {r['valid']:.0f}{of} |"
                )


def _cpu(r: dict, off: dict) -> str:
    """The call's CPU time (every thread of the process) and ``off``'s / it; "- | -" for runs
    recorded without it."""
    if not r.get("cpu_s") or not off.get("cpu_s"):
        return "- | -"
    return f"{r['cpu_s']:.1f} | {off['cpu_s'] / r['cpu_s']:.2f}x"


def _version() -> str:
    import vllm

    return str(vllm.__version__)


if __name__ == "__main__":
    main()
