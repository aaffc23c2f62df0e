"""Reference material for examples, the CLI and tests: a real model's vocabulary (and, in the
end-to-end demo, the model itself), read from a GGUF file shipped on PyPI (no hub access)."""
