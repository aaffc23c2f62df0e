"""The demo's output constraint: a JSON schema, a regex or an EBNF grammar, compiled with
xgrammar for SmolLM2's vocabulary, and checked independently once the text is generated."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from portable_spec.testing import PERSON_SCHEMA, tokenizer_info

__all__ = ["Constraint", "compiler", "load_constraint"]

DEFAULT_PROMPTS = {
    "json_schema": (
        "Give a JSON object for this person. Name: Ada Lovelace. Age: 36. Email: ada@example.com. "
        'Street: 12 Engine Road. City: London. Zip: 10815. Tags: "math" and "poetry" '
        "(only these two)."
    ),
    "regex": "Give a date and an e-mail address, for example: 2024-05-17 ada@example.com",
    "ebnf": "Write three settings of a web server as key = value lines: port, host and timeout.",
}


@dataclass(frozen=True)
class Constraint:
    """A compiled constraint and what is needed to check its output.

    Attributes:
        kind: ``"json_schema"``, ``"regex"`` or ``"ebnf"``.
        source: the schema (a dict), the regex or the EBNF text.
        compiled: the ``xgrammar.CompiledGrammar``.
    """

    kind: str
    source: Any
    compiled: Any

    @property
    def default_prompt(self) -> str:
        """A prompt that asks for output of this kind."""
        return DEFAULT_PROMPTS[self.kind]

    def matcher(self) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` (stop token: the vocabulary's EOS)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)

    def check(self, text: str) -> tuple[bool | None, str]:
        """Check finished output independently of xgrammar.

        Returns ``(valid, detail)``: a JSON schema is checked with ``jsonschema`` and a regex
        with Python's ``re.fullmatch``; an EBNF grammar has no independent checker
        (``None``).
        """
        if self.kind == "json_schema":
            import jsonschema

            try:
                jsonschema.validate(json.loads(text), self.source)
            except json.JSONDecodeError as exc:
                return False, f"not JSON: {exc}"
            except jsonschema.ValidationError as exc:
                return False, f"schema violation: {exc.message}"
            return True, "valid JSON, matches the schema"
        if self.kind == "regex":
            ok = re.fullmatch(self.source, text) is not None
            return ok, "matches the regex" if ok else "does not match the regex"
        return None, "no independent checker for EBNF"


@lru_cache(maxsize=1)
def compiler() -> Any:
    """The shared ``xgrammar.GrammarCompiler`` for SmolLM2's vocabulary."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(tokenizer_info())


def load_constraint(
    *, schema: Any = None, regex: str | None = None, ebnf: str | None = None
) -> Constraint:
    """Compile at most one of ``schema`` (a dict or JSON text), ``regex`` or ``ebnf``;
    none given: the person/address schema. Raises ``ValueError`` with xgrammar's message
    for a grammar it cannot compile."""
    given = [x is not None for x in (schema, regex, ebnf)]
    if sum(given) > 1:
        raise ValueError("give at most one of schema, regex, ebnf")
    comp = compiler()
    try:
        if regex is not None:
            return Constraint("regex", regex, comp.compile_regex(regex))
        if ebnf is not None:
            return Constraint("ebnf", ebnf, comp.compile_grammar(ebnf))
        source = PERSON_SCHEMA if schema is None else schema
        if isinstance(source, str):
            source = json.loads(source)
        compiled = comp.compile_json_schema(json.dumps(source), any_whitespace=False)
        return Constraint("json_schema", source, compiled)
    except (RuntimeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot compile the grammar: {exc}") from exc
