"""SmolLM2's vocabulary for the other grammar engines, and the sample grammars compiled by each.

xgrammar's side is in :mod:`portable_spec.demo.gguf_vocab` and :mod:`.grammars`. Here:

* llguidance: an ``LLTokenizer`` built from the ``tokenizers`` JSON of the tokenizer rebuilt from
  the GGUF (llguidance runs the byte-level BPE itself);
* outlines-core: a ``Vocabulary`` mapping each token's bytes (GPT-2's byte-to-character table
  undone) to its id. Special tokens are left out of both (as xgrammar does): grammars can
  never produce them, the end token excepted.

Everything is built once per process (cached) and imports its engine only when called.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from portable_spec.demo.grammars import PERSON_SCHEMA, REGEX_DATE_EMAIL

__all__ = [
    "ENGINE_KINDS",
    "byte_level_decoder",
    "llguidance_grammar",
    "llguidance_matcher",
    "llguidance_tokenizer",
    "outlines_guide",
    "outlines_index",
    "outlines_vocabulary",
]

#: the sample grammars each engine compiles (outlines-core has no context-free grammars)
ENGINE_KINDS = {
    "llguidance": ("json_schema", "lark", "regex", "builtin_json"),
    "outlines": ("json_schema", "regex"),
}

# The language of grammars.EBNF_KEY_VALUES in Lark's syntax (llguidance's grammar format).
LARK_KEY_VALUES = r"""
start: line+
line: KEY " = " value "\n"
KEY: /[a-z_][a-z0-9_]*/
value: NUMBER | STRING | list
NUMBER: /-?[0-9]+(\.[0-9]+)?/
STRING: /"[^"\\\n]*"/
list: "[" (NUMBER (", " NUMBER)*)? "]"
"""


def byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table: the character a byte-level BPE uses for
    each byte value -> that byte. Printable bytes stand for themselves; the others (controls,
    space, a few Latin-1 ones) are moved past 255 in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = 256
    for b in range(256):
        if b not in printable:
            table[chr(shifted)] = b
            shifted += 1
    return table


@lru_cache(maxsize=1)
def llguidance_tokenizer() -> Any:
    """An ``llguidance.LLTokenizer`` for SmolLM2 (end token: ``<|im_end|>``)."""
    import llguidance

    from portable_spec.demo.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    return llguidance.LLTokenizer(tokenizer.backend_json(), eos_token=tokenizer.eos_id)


def llguidance_grammar(kind: str) -> str:
    """The serialized llguidance grammar of a sample: ``"json_schema"``, ``"lark"``,
    ``"regex"`` or ``"builtin_json"`` (any JSON value)."""
    import llguidance

    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PERSON_SCHEMA))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(LARK_KEY_VALUES)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(REGEX_DATE_EMAIL)
    if kind == "builtin_json":
        return llguidance.LLMatcher.grammar_from_json_schema("{}")
    raise ValueError(f"unknown llguidance sample grammar {kind!r}")


def llguidance_matcher(kind: str) -> Any:
    """A fresh ``LLMatcher`` of a sample grammar on SmolLM2's vocabulary."""
    import llguidance

    matcher = llguidance.LLMatcher(llguidance_tokenizer(), llguidance_grammar(kind), log_level=0)
    if matcher.is_error():
        raise ValueError(f"llguidance refused the {kind} sample: {matcher.get_error()}")
    return matcher


@lru_cache(maxsize=1)
def outlines_vocabulary() -> Any:
    """An ``outlines_core.Vocabulary`` of SmolLM2's tokens as bytes."""
    import outlines_core

    from portable_spec.demo.gguf_vocab import load_vocab

    vocab = load_vocab()
    decode = byte_level_decoder()
    special = set(vocab.special_ids)
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, token in enumerate(vocab.tokens):
        if token_id in special:
            continue
        by_bytes.setdefault(bytes(decode[c] for c in token), []).append(token_id)
    return outlines_core.Vocabulary(vocab.eos_id, by_bytes)


@lru_cache(maxsize=4)
def outlines_index(kind: str) -> Any:
    """The ``outlines_core.Index`` of a sample: ``"json_schema"`` or ``"regex"``."""
    import outlines_core

    if kind == "json_schema":
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(PERSON_SCHEMA))
    elif kind == "regex":
        regex = REGEX_DATE_EMAIL
    else:
        raise ValueError(f"unknown outlines sample grammar {kind!r}")
    return outlines_core.Index(regex, outlines_vocabulary())


def outlines_guide(kind: str, max_rollback: int = 64) -> Any:
    """A fresh ``outlines_core.Guide`` of a sample grammar."""
    import outlines_core

    return outlines_core.Guide(outlines_index(kind), max_rollback=max_rollback)
