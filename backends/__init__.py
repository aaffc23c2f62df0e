"""Built-in backends, installed as ``portable_spec.backends.<name>``.

``numpy``  host arrays; the reference every other backend is tested against.
``cuda``   torch tensors: CUDA (events + pinned memory), other torch accelerators, and CPU.
``jax``    ``jax.Array`` on CPU, GPU or TPU, sharded or not.

Each backend package exposes one :class:`portable_spec.backend.Backend` subclass; the registry
(:mod:`portable_spec.registry`) imports a backend package only when its framework is in use.
"""
