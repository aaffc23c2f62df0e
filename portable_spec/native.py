"""The optional compiled helpers (``portable_spec._native``) and their availability.

The C extension is built at install time when a compiler is present; without it the builder
uses its numpy and pure-Python equivalents (same results, tested against each other). Set
``PORTABLE_SPEC_NO_NATIVE=1`` to force the fallback.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["native"]


def _load() -> ModuleType | None:
    if os.environ.get("PORTABLE_SPEC_NO_NATIVE", "") not in ("", "0"):
        return None
    try:
        from portable_spec import _native
    except ImportError:
        return None
    return _native


#: the compiled module, or None when unavailable or disabled
native: ModuleType | None = _load()
