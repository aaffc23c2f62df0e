"""Build of the optional C helper; all other metadata lives in pyproject.toml."""

import glob

from setuptools import Extension, setup

try:  # numpy's C API reads and makes arrays without a buffer export (csrc/arrays.c)
    import numpy

    numpy_headers = {"include_dirs": [numpy.get_include()], "define_macros": [("PS_NUMPY", "1")]}
except ImportError:  # the buffer protocol only
    numpy_headers = {}

setup(
    ext_modules=[
        # GIL-free index work of the builder and xgrammar's walks. Optional: without a
        # compiler the install proceeds and the numpy/Python fallbacks are used. One
        # translation unit: csrc/module.c includes the other files of csrc/.
        Extension(
            "portable_spec._native",
            sources=["portable_spec/csrc/module.c"],
            depends=sorted(glob.glob("portable_spec/csrc/*")),
            extra_compile_args=["-O2"],
            optional=True,
            **numpy_headers,
        )
    ]
)
