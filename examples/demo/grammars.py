"""Sample grammars shared by the CLI, the benchmark, the demo and the tests."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["EBNF_KEY_VALUES", "PERSON_SCHEMA", "REGEX_DATE_EMAIL", "compile_sample"]

# A person with an address: the demo's default schema.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "address"],
}

# key = value lines, values are numbers, quoted strings or lists of numbers.
EBNF_KEY_VALUES = r"""
root ::= line+
line ::= key " = " value "\n"
key ::= [a-z_] [a-z0-9_]*
value ::= number | string | list
number ::= "-"? [0-9]+ ("." [0-9]+)?
string ::= "\"" [^"\\\n]* "\""
list ::= "[" (number (", " number)*)? "]"
"""

# An ISO date followed by an e-mail address.
REGEX_DATE_EMAIL = r"[0-9]{4}-[0-9]{2}-[0-9]{2} [a-z0-9._]+@[a-z0-9]+\.(com|org|net)"


def compile_sample(compiler: Any, kind: str) -> Any:
    """Compile one sample grammar with an ``xgrammar.GrammarCompiler``.

    ``kind``: ``"json_schema"``, ``"ebnf"``, ``"regex"`` or ``"builtin_json"``.
    """
    if kind == "json_schema":
        return compiler.compile_json_schema(json.dumps(PERSON_SCHEMA))
    if kind == "ebnf":
        return compiler.compile_grammar(EBNF_KEY_VALUES)
    if kind == "regex":
        return compiler.compile_regex(REGEX_DATE_EMAIL)
    if kind == "builtin_json":
        return compiler.compile_builtin_json_grammar()
    raise ValueError(f"unknown sample grammar {kind!r}")
