"""Examples that run from a checkout of portable_spec (not installed): ``demo/``, a speculative
decoding engine for SmolLM2 in JAX and torch with grammar-constrained verify trees."""
