"""Which row of the builder's route table built a call (``portable_spec.builder.routes``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import portable_spec.builder.routes as routes


def spy_routes(monkeypatch: Any, *, compiled_only: bool = False) -> list[str]:
    """Wrap every row of the route table; each call a row builds appends the row's name to
    the returned list (a compiled row that declines appends nothing). ``compiled_only``:
    record only the compiled rows (``chain lists``, ``one call``, ``small chains``)."""
    taken: list[str] = []

    def spying(route: routes.Route) -> routes.Route:
        def build(call: Any) -> Any:
            if route.build in (routes._lists_build, routes._one_call_build):  # recorded below
                return route.build(call)
            if not route.compiled:  # named before it builds: its own builds come after it
                if not compiled_only:
                    taken.append(route.name)
                return route.build(call)
            result = route.build(call)
            if result is not None:
                taken.append(route.name)
            return result

        return dataclasses.replace(route, build=build)

    monkeypatch.setattr(routes, "ROUTES", tuple(spying(route) for route in routes.ROUTES))
    # the entry points call the builds of "chain lists" (routes._lists) and "one call"
    # (routes._one_call) directly: record those rows there
    for function, name in (("_lists", "chain lists"), ("_one_call", "one call")):
        monkeypatch.setattr(routes, function, _recording(getattr(routes, function), name, taken))
    return taken


def _recording(function: Any, name: str, taken: list[str]) -> Any:
    def spy(*args: Any) -> Any:
        result = function(*args)
        if result is not None:
            taken.append(name)
        return result

    return spy


def spy_short_paths(monkeypatch: Any) -> list[str]:
    """The compiled rows that took each call (see :func:`spy_routes`)."""
    return spy_routes(monkeypatch, compiled_only=True)
