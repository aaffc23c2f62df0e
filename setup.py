"""Build of the optional C helper; all other metadata lives in pyproject.toml."""

import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# The sglang-jax integration's switch (portable_spec/integrations/sglang_jax/hook.py): a .pth
# file at the root of site-packages, which Python runs in every process.
PTH = "portable_spec_sglang_jax.pth"
PTH_SOURCE = os.path.join("portable_spec", "integrations", "sglang_jax", PTH)


class BuildPy(build_py):
    """build_py that also puts the .pth file at the root of the wheel (site-packages)."""

    def run(self) -> None:
        super().run()
        self.copy_file(PTH_SOURCE, self._pth())

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), self._pth()]

    def _pth(self) -> str:
        return os.path.join(self.build_lib, PTH)


try:  # numpy's C API reads and makes arrays without a buffer export (csrc/arrays.c)
    import numpy

    numpy_headers = {"include_dirs": [numpy.get_include()], "define_macros": [("PS_NUMPY", "1")]}
except ImportError:  # the buffer protocol only
    numpy_headers = {}

setup(
    cmdclass={"build_py": BuildPy},
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
    ],
)
