"""The device check: the GPU proof of the library in one command (``scripts/device-check.sh``).

Parts, each under a time limit (see :mod:`tools.devicecheck.driver`):

``environment``      machine, GPU, versions; which packages were imported from where
``correctness``      pytest on the accelerator tests (:data:`.correctness.SUITES`)
``timings.torch``    tree staging, mask upload, apply on CUDA (:mod:`.torch_timings`)
``timings.jax``      the same on JAX's GPU (:mod:`.jax_timings`)
``timings.overlap``  the build under a verify-sized GPU forward (:mod:`.overlap`)
``scaling``          the host build at 1..16 threads against xgrammar's loop (:mod:`.scaling`)

``--cpu`` runs the same parts on a machine without a GPU: the GPU-only sections are reported as
skipped, the rest really run (reduced sizes: :mod:`.profiles`). Results go to
``device-check.json`` and ``device-check.md``; see ``docs/porting/hardware.md``.

Like the rest of the package this imports nothing but numpy until a part runs.
"""
