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
    # build_chain_bitmask calls the first row's build (routes._lists) directly: record it there
    lists = routes._lists

    def spying_lists(*args: Any) -> Any:
        result = lists(*args)
        if result is not None:
            taken.append(routes.ROUTES[0].name)
        return result

    monkeypatch.setattr(routes, "_lists", spying_lists)
    # build_host_bitmask calls the "one call" row's build (routes._one_call) directly too
    one_call = routes._one_call

    def spying_one_call(*args: Any) -> Any:
        result = one_call(*args)
        if result is not None:
            taken.append(routes.ROUTES[1].name)
        return result

    monkeypatch.setattr(routes, "_one_call", spying_one_call)
    return taken


def spy_short_paths(monkeypatch: Any) -> list[str]:
    """The compiled rows that took each call (see :func:`spy_routes`)."""
    return spy_routes(monkeypatch, compiled_only=True)
