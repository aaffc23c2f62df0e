"""Support for the demo's tests: which backends a run selected, and the KV cache size."""

from __future__ import annotations

import pytest

# KV cache positions of the demo models built for the tests
DEMO_MAX_LEN = 256


def require_backends(request: pytest.FixtureRequest, *backends: str) -> None:
    """Skip unless every backend ("jax", "torch") is among ``--backend`` selections (none
    given: all run)."""
    wanted = request.config.getoption("backend", default=None) or []
    for backend in backends:
        aliases = ("torch", "cuda") if backend == "torch" else ("jax",)
        if wanted and not any(w.split("-")[0] in aliases for w in wanted):
            pytest.skip(f"{backend} not selected by --backend")
