"""SmolLM2's byte-level BPE tokenizer and chat template, rebuilt from the GGUF metadata.

The GGUF carries the vocabulary, the merges and the Jinja chat template; the ``tokenizers``
library turns the first two back into a working BPE (byte-level pre-tokenization with digits
split one by one, as the ``smollm`` pre-tokenizer does), and ``jinja2`` renders the template.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from portable_spec.demo.gguf_vocab import GGUFVocab, load_vocab

__all__ = ["ChatTokenizer", "load_tokenizer"]


class ChatTokenizer:
    """Encode/decode text and render chat prompts for a GGUF vocabulary.

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

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """The GGUF's chat template rendered for one user turn, ready for the assistant."""
        template = self.vocab.chat_template
        messages: list[dict[str, Any]] = []
        if system is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": user})
        if template is None:
            raise ValueError("the GGUF has no chat template")
        import jinja2

        env = jinja2.Environment(autoescape=False, keep_trailing_newline=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=True)


@lru_cache(maxsize=2)
def load_tokenizer(path: str | None = None) -> ChatTokenizer:
    """The tokenizer of a GGUF file (default: SmolLM2's). Cached."""
    # load_vocab() and load_vocab(None) are separate cache entries: share the default one
    return ChatTokenizer(load_vocab() if path is None else load_vocab(path))
