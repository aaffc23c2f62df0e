"""Which of the builder's short paths took a call: the compiled call over the caller's arrays
(``small.in_place``) or the Python walk of small chains (``small.small_chains``)."""

from __future__ import annotations

from typing import Any

import portable_spec.builder.small as small_module


def spy_short_paths(monkeypatch: Any) -> list[str]:
    """Wrap both short paths; each call that one of them takes appends its name to the
    returned list (a path that declines appends nothing)."""
    taken: list[str] = []
    for name in ("in_place", "small_chains"):
        real = getattr(small_module, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            result = _real(*args)
            if result is not None:
                taken.append(_name)
            return result

        monkeypatch.setattr(small_module, name, spy)
    return taken
