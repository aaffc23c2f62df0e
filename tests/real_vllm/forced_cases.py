"""The forced-drafts engine test's requests: the schema workloads, a regex, a choice,
``json_object``, a stop string and a ``max_tokens`` reached inside drafts, a sampled request,
and requests that reason first (no period in their prompt: see ``period_reasoner.py``)."""

from __future__ import annotations

from portable_spec.testing import SCHEMA_WORKLOADS

K = 4  # speculative tokens per step

INVOICE, INVOICE_PROMPT = SCHEMA_WORKLOADS["invoice"]
TOOL_CALL, TOOL_CALL_PROMPT = SCHEMA_WORKLOADS["tool_call"]
DATES = r"20[0-9]{2}-[01][0-9]-[0-3][0-9](, 20[0-9]{2}-[01][0-9]-[0-3][0-9]){2}"
UNITS = ["celsius", "fahrenheit", "kelvin"]

CASES: list[dict] = [
    {"prompt": TOOL_CALL_PROMPT, "constraint": {"json": TOOL_CALL}, "max_tokens": 160},
    {
        "prompt": "Request 2. " + TOOL_CALL_PROMPT,
        "constraint": {"json": TOOL_CALL},
        "max_tokens": 160,
    },
    {"prompt": INVOICE_PROMPT, "constraint": {"json": INVOICE}, "max_tokens": 200},
    # max_tokens reached inside forced drafts: cut in the middle of a key
    {"prompt": "Again. " + INVOICE_PROMPT, "constraint": {"json": INVOICE}, "max_tokens": 11},
    # a stop string inside the forced text
    {
        "prompt": "Stop early. " + TOOL_CALL_PROMPT,
        "constraint": {"json": TOOL_CALL},
        "max_tokens": 160,
        "stop": ['"function_name"'],
    },
    {"prompt": "List three dates in 2024. ", "constraint": {"regex": DATES}, "max_tokens": 40},
    {"prompt": "The unit for Paris weather is. ", "constraint": {"choice": UNITS}, "max_tokens": 8},
    {
        "prompt": "A JSON object about Paris. ",
        "constraint": {"json_object": True},
        "max_tokens": 48,
    },
    {
        "prompt": "Sampled. " + TOOL_CALL_PROMPT,
        "constraint": {"json": TOOL_CALL},
        "max_tokens": 160,
        "temperature": 0.8,
        "seed": 7,
    },
    # no period in the prompt: the model reasons until it writes one, then the grammar starts
    {
        "prompt": "Think about the weather tool for Paris, then call it as JSON",
        "constraint": {"json": TOOL_CALL},
        "max_tokens": 200,
    },
    {
        "prompt": "Think about which unit Paris uses, then name it",
        "constraint": {"choice": UNITS},
        "max_tokens": 60,
    },
]

#: cases still reasoning at their start (no period in the prompt)
REASONING = [i for i, c in enumerate(CASES) if "." not in c["prompt"]]
#: greedy cases (outputs compared token for token)
GREEDY = [i for i, c in enumerate(CASES) if not c.get("temperature")]
