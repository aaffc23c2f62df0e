"""SmolLM2's tokenizer with its chat template, rebuilt from the GGUF metadata.

The byte-level BPE is :class:`portable_spec.testing.SampleTokenizer`; the GGUF also carries
the Jinja chat template, which ``jinja2`` renders here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from portable_spec.testing import SampleTokenizer, load_vocab

__all__ = ["ChatTokenizer", "load_tokenizer"]


class ChatTokenizer(SampleTokenizer):
    """Encode/decode text and render chat prompts for a GGUF vocabulary.

    Attributes:
        vocab: the GGUF tokenizer metadata.
        eos_id: the end-of-turn token (``<|im_end|>`` for SmolLM2).
    """

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
    """The tokenizer of a GGUF file (default: SmolLM2's), with its chat template. Cached."""
    # load_vocab() and load_vocab(None) are separate cache entries: share the default one
    return ChatTokenizer(load_vocab() if path is None else load_vocab(path))
