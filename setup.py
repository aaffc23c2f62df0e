"""Build of the optional C helper; all other metadata lives in pyproject.toml."""

from setuptools import Extension, setup

try:  # numpy's C API reads and makes arrays without a buffer export (see _native.c)
    import numpy

    numpy_headers = {"include_dirs": [numpy.get_include()], "define_macros": [("PS_NUMPY", "1")]}
except ImportError:  # the buffer protocol only
    numpy_headers = {}

setup(
    ext_modules=[
        # GIL-free index work of the builder (link validation, row repair). Optional: without
        # a compiler the install proceeds and the numpy/Python fallbacks are used.
        Extension(
            "portable_spec._native",
            sources=["portable_spec/_native.c"],
            extra_compile_args=["-O2"],
            optional=True,
            **numpy_headers,
        )
    ]
)
