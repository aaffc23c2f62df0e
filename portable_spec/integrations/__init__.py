"""Ready-made glue between portable_spec and serving engines (one module per engine).

Nothing here is imported by ``import portable_spec``; each module imports its engine lazily.
"""
