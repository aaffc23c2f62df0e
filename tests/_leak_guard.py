"""A pytest plugin: every test must leave the library as it found it.

Tests force routes and fallbacks by patching the library's module constants
(``routes.EXECUTOR_WORK``), its functions and methods (``dense.fill_llguidance_chains``,
``small_llguidance.in_place``) and the compiled helper in use (``native.use(None)``). One
that forgets to put something back changes every test after it in the process, far from the
cause. After each test this plugin compares, by identity, what it recorded before the test:

* each ``portable_spec`` module's UPPER_CASE constants, and the library's functions and
  classes it holds,
* the functions, static and class methods defined on those classes,
* ``portable_spec.native.native``, the compiled helper in use;

puts back whatever differs, and fails the test (an error at its teardown) naming each thing.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from typing import Any

import pytest

_MISSING = object()
Key = tuple[str, str, str]  # (module, class or "", attribute)


def _watched(value: Any) -> bool:
    """A function or class of the library (an engine's function imported by a module of an
    integration is the engine's: its patch sets rebind those on purpose)."""
    if not (inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.isclass(value)):
        return False
    module = getattr(value, "__module__", None) or ""
    return module == "portable_spec" or module.startswith("portable_spec.")


def _library_state() -> dict[Key, Any]:
    """What a test may patch and must put back, keyed by (module, class, name)."""
    state: dict[Key, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "portable_spec" or name.startswith("portable_spec.")):
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("__"):
                continue
            if attr.isupper() or _watched(value):
                state[(name, "", attr)] = value
            if inspect.isclass(value) and value.__module__ == name:  # its own classes' methods
                for method, member in list(vars(value).items()):
                    if not method.startswith("__") and (
                        _watched(member) or isinstance(member, (staticmethod, classmethod))
                    ):
                        state[(name, attr, method)] = member
    return state


def _owner(key: Key) -> Any:
    module = sys.modules.get(key[0])
    if module is None or not key[1]:
        return module
    owner = vars(module).get(key[1])
    return owner if inspect.isclass(owner) else None


def _current(key: Key) -> Any:
    owner = _owner(key)
    return _MISSING if owner is None else vars(owner).get(key[2], _MISSING)


def _put_back(key: Key, value: Any) -> None:
    owner = _owner(key)
    if owner is None:
        return
    if value is _MISSING:
        delattr(owner, key[2])
    else:
        setattr(owner, key[2], value)


def changed_since(before: dict[Key, Any]) -> list[str]:
    """Put back every recorded thing that differs from ``before``; the names of those."""
    changed = []
    for key, value in before.items():
        now = _current(key)
        if now is value or sys.modules.get(key[0]) is None:
            continue
        changed.append(".".join(part for part in key if part))
        _put_back(key, value)
    return changed


@pytest.fixture(autouse=True)
def library_left_as_found() -> Iterator[None]:
    """Fail (and undo) a test that leaves a library constant, function, method or the
    compiled helper in use changed. Autouse and defined before any other fixture, so it
    checks after every fixture of the test (``monkeypatch`` included) has undone its work."""
    import portable_spec.native as native_module

    before = _library_state()
    helper = native_module.native
    yield
    changed = changed_since(before)
    if native_module.native is not helper:
        changed.append(f"portable_spec.native.native (the compiled helper: {native_module.native})")
        native_module.use(helper)
    if changed:
        pytest.fail(
            "this test left the library changed (put back now): " + ", ".join(sorted(changed)),
            pytrace=False,
        )
