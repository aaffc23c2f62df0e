"""Fixtures of the tools' and the demo's tests (tools/, examples/demo/, imported from the
checkout: tests/conftest.py puts its root on ``sys.path``)."""

from __future__ import annotations

from typing import Any

import pytest
from _demo_models import DEMO_MAX_LEN


@pytest.fixture(scope="session")
def tok() -> Any:
    """SmolLM2's tokenizer with its chat template (the demo's), rebuilt from the GGUF."""
    from examples.demo.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def models() -> Any:
    """``get(backend, dtype)``: the demo model of each backend and dtype, built once per
    session on first use; use a model inside ``precision(backend, dtype)``."""
    from examples.demo.models import build_model, precision

    built: dict[tuple[str, str], object] = {}

    def get(backend: str, dtype: str) -> object:
        key = (backend, dtype)
        if key not in built:
            with precision(backend, dtype):
                built[key] = build_model(backend, dtype, DEMO_MAX_LEN)
        return built[key]

    return get
