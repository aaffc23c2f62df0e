"""Ready-made glue between portable_spec and serving engines: a package per engine, all on one
patching contract.

* ``patching.py``: the contract. A patch names its target and how to make the replacement;
  one table per engine lists the version and the source hash of every function replaced or
  read; a patch set installs all of it or nothing (one warning, the engine's own code), and
  uninstalls as a whole. Also the switch reader, the import hook, the counters' one shape.
* ``vllm/``: vLLM's structured-output bitmask with speculative decoding (``internals.py`` is
  the only file that names vLLM's internals, ``rows.py`` holds vLLM's row rules);
* ``tpu_inference/``: vLLM's rows on the logits rows they belong to in tpu-inference's runner;
* ``sglang_jax/``: grammar masks on sglang-jax's speculative verify, its engine-bug fixes in
  ``fixes.py``;
* ``entry_points.py``: what each engine's plugin entry point switches on.

Every engine package has the same face: ``ENV_VAR`` (its switch: ``1``/``on``, ``shadow``
where the engine's own result can be computed beside, ``0``/``off``/unset), ``install(mode)``,
``uninstall()``, ``is_installed()``, ``integration_stats()`` and ``reset_stats()``.

Nothing here is imported by ``import portable_spec``; no package imports its engine before
``install`` (or its entry point, with the switch on) asks for it.
"""
