"""Ready-made glue between portable_spec and serving engines (a package per engine, each on
the contract of ``patching.py``).

Nothing here is imported by ``import portable_spec``; each module imports its engine lazily.
"""
