"""Ready-made glue between portable_spec and serving engines: a package per engine, all in one
layout on one patching contract.

Shared by every engine package:

* ``patching.py``: the contract. A :class:`~.patching.Patch` names its target and how to make
  the replacement; a :class:`~.patching.Revision` per known release lists its version and
  the source hash of every function replaced or read; a :class:`~.patching.PatchSet`
  installs all of it or nothing (one warning naming what it found, the engine's own code),
  uninstalls as a whole, and stacks with other sets on the same functions;
* ``face.py``: the face every package shows, in one implementation
  (:class:`~.face.Integration`: the mode check, install, uninstall, is_installed,
  integration_stats, reset_stats), the switch reader (:func:`~.face.read_mode`) and the
  version helper (:func:`~.face.engine_version`);
* ``telemetry.py``: :class:`~.telemetry.Stats` (counters, series, per-batch timings: the
  shape of every ``integration_stats()``) and :class:`~.telemetry.LogOnce` (a line per kind
  of event, once per process);
* ``import_hook.py``: :class:`~.import_hook.ImportHook`, patching when the engine imports a
  module (engines whose workers run in processes of their own);
* ``entry_points.py``: what each engine's plugin entry point switches on.

The engine packages:

* ``vllm/``: vLLM's structured-output bitmask with speculative decoding;
* ``tpu_inference/``: vLLM's rows on the logits rows they belong to in tpu-inference's runner;
* ``sglang/``: sglang's speculative and plain grammar masks (an ``sglang.srt.plugins`` entry
  point);
* ``sglang_jax/``: grammar masks on sglang-jax's speculative verify and drafts, its
  engine-bug fixes in ``fixes.py``.

Each engine package has the same modules:

* ``__init__.py``: the face, each function one line over ``state.INTEGRATION``: ``ENV_VAR``
  (its switch: ``1``/``on``, ``shadow`` where the engine's own result can be computed beside,
  ``0``/``off``/unset), ``install(mode)``, ``uninstall()``, ``is_installed()``,
  ``integration_stats()``, ``reset_stats()``; then what that engine needs beside (an entry
  point, a setter);
* ``internals.py``: the only module that names the engine: ``ENGINE``, ``PACKAGE``,
  ``DISTRIBUTIONS``, ``logger`` (a child of the engine's), every target it replaces
  (``TARGETS``) or reads (``READS``), ``REVISIONS`` (the known releases), ``version()``, and
  accessors for what the replacements call of the engine. ``python -m
  portable_spec.integrations.<engine>.internals`` prints the row a new release needs;
* ``patches.py``: ``PATCHES``, the table: each target of ``internals`` and the function that
  makes its replacement, in stacking order, then the targets only read. Imported at the
  first install, never before;
* ``state.py``: this process's state: ``ENV_VAR`` and the other switches, ``COUNTERS`` (and
  ``SERIES``, ``BUILDS``) behind ``STATS``, ``LOG`` (a :class:`~.telemetry.LogOnce`) and
  ``INTEGRATION`` (the mode and revision the replacements read on every call);
* then a module per job (the replacements), which read ``state`` and ``internals``.

To add, to an engine package:

* **a patch**: its target in ``internals.py`` (a constant, listed in ``TARGETS``; its source
  hash in each row of ``REVISIONS``, printed by ``python -m ...internals``), the function
  that makes the replacement in the module of its job, and one row in ``patches.py``
  (``Patch(internals.TARGET, make)``). A function it only calls or reads: in ``READS``, with
  its hash (``patches.py`` lists ``READS`` by itself). A workaround of an engine bug carries
  ``fixes="<heading of the upstream note>"``;
* **a counter**: its name in ``state.COUNTERS`` (documented beside it), counted with
  ``STATS.add(name)`` (or ``STATS.update`` for several at once); ``integration_stats()``
  and ``reset_stats()`` then include it;
* **a switch**: a ``*_ENV_VAR`` constant in ``state.py``, documented beside it; a value the
  replacements read on every call is read once into ``state`` (sglang-jax's ``SWITCHES``),
  by :func:`~.face.read_mode` for an on/off switch (a misspelt value raises, naming the
  variable), and exported from ``__init__.py`` with the package's other names;
* **a line once per process**: ``state.LOG.warning(kind, message, *args)``.

Nothing here is imported by ``import portable_spec``; no package imports its engine (or its
table of patches) before ``install`` (or its entry point, with the switch on) asks for it.
"""
