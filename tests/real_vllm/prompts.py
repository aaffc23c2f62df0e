"""The end-to-end prompts: JSON schemas and a regex, with text the n-gram drafter can copy."""

from __future__ import annotations

import json

K = 4  # speculative tokens per step

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "label": {"enum": ["a", "b"]}},
    "required": ["x", "y", "label"],
    "additionalProperties": False,
}
DATE_REGEX = (
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]( and (19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9])*"
)

_BASE = [
    (
        "Alice is 31 and lives in Paris. Bob is 45 and lives in Rome. "
        'Write Bob as JSON like {"name": "Alice", "age": 31, "city": "Paris"}: ',
        {"json": PERSON},
    ),
    (
        "Order 7 has apples, pears and plums and is paid. As JSON "
        '{"id": 7, "items": ["apples", "pears", "plums"], "paid": true}. '
        "Order 8 has apples and pears, not paid. JSON: ",
        {"json": ORDER},
    ),
    (
        'Point a is at x 1.5, y 2.5. {"x": 1.5, "y": 2.5, "label": "a"} '
        "Point b is at x 3, y 4. JSON: ",
        {"json": POINT},
    ),
    (
        "The dates were 2024-01-15 and 2024-02-20 and 2024-03-25. List the dates again: ",
        {"regex": DATE_REGEX},
    ),
]


def prompts_for(batch: int) -> list[dict]:
    """``batch`` cases cycling through the four constraints, prompts made distinct."""
    cases = []
    for i in range(batch):
        text, constraint = _BASE[i % len(_BASE)]
        prefix = f"Task {i}. " if i >= len(_BASE) else ""
        cases.append({"prompt": prefix + text, "constraint": constraint, "max_tokens": 48})
    return cases


def schema_of(case: dict) -> dict | None:
    """The JSON schema of a case, or None for the regex."""
    return case["constraint"].get("json")


__all__ = ["DATE_REGEX", "K", "json", "prompts_for", "schema_of"]
