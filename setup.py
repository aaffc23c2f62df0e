"""Build of the optional C helper; all other metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # GIL-free index work of the builder (link validation, row repair). Optional: without
        # a compiler the install proceeds and the numpy/Python fallbacks are used.
        Extension(
            "portable_spec._native",
            sources=["portable_spec/_native.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
