"""Backend registry: built-ins plus the ``portable_spec.backends`` entry-point group.

Backends are found the einops way. :func:`backend_for` looks only at backends whose framework
module is already in ``sys.modules``: an array of a framework the caller never imported cannot
exist, so nothing is imported to answer the question. :func:`get_backend` imports on request.

A third-party package adds a backend by declaring, in its own ``pyproject.toml``::

    [project.entry-points."portable_spec.backends"]
    mynpu = "my_package.portable_spec_backend:MyNpuBackend"

where ``MyNpuBackend`` subclasses :class:`portable_spec.backend.Backend`, sets
``name = "mynpu"`` and ``framework = "my_framework"``, and does not import ``my_framework`` at
module import time (the class is loaded to read ``framework``; it is only instantiated once
the framework is imported or the backend is asked for by name).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from dataclasses import dataclass
from typing import Any

from portable_spec.backend import Backend

__all__ = ["available_backends", "backend_for", "get_backend", "register_backend"]

ENTRY_POINT_GROUP = "portable_spec.backends"


@dataclass
class _Entry:
    name: str
    framework: str
    target: str | type[Backend]  # "module:attr" or a Backend subclass
    origin: str  # "builtin", "entry point <dist>", "register_backend"
    instance: Backend | None = None


# name -> entry; built-ins are known without importing anything.
_BUILTINS = {
    "numpy": _Entry("numpy", "numpy", "portable_spec.backends.numpy:NumpyBackend", "builtin"),
    "torch": _Entry("torch", "torch", "portable_spec.backends.cuda:TorchBackend", "builtin"),
    "jax": _Entry("jax", "jax", "portable_spec.backends.jax:JaxBackend", "builtin"),
}
# "cuda": the torch backend's historical name (the package is portable_spec.backends.cuda)
_ALIASES = {"cuda": "torch", "np": "numpy"}

_lock = threading.RLock()
_entries: dict[str, _Entry] = dict(_BUILTINS)
_plugins_loaded = False


def _load_plugins() -> None:
    """Read the entry-point group once. Loading an entry point imports only the plugin's
    module (which must not import its framework eagerly) to learn its ``framework``."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    with _lock:
        if _plugins_loaded:
            return
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in _entries:
                continue  # a plugin may not shadow a built-in or an explicit registration
            try:
                cls = ep.load()
            except Exception as exc:  # a broken plugin must not break the library
                sys.stderr.write(
                    f"portable_spec: skipping backend entry point {ep.name!r}: {exc!r}\n"
                )
                continue
            if not (isinstance(cls, type) and issubclass(cls, Backend)):
                sys.stderr.write(
                    f"portable_spec: entry point {ep.name!r} is not a Backend subclass\n"
                )
                continue
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            _entries[ep.name] = _Entry(ep.name, cls.framework, cls, f"entry point {dist}")
        _plugins_loaded = True


def register_backend(backend_cls: type[Backend]) -> None:
    """Register a :class:`Backend` subclass under its ``name`` (for code that cannot ship an
    entry point, such as tests). Replaces an earlier registration of the same name."""
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, Backend)):
        raise TypeError(f"register_backend expects a Backend subclass, got {backend_cls!r}")
    if not backend_cls.name or not backend_cls.framework:
        raise ValueError(f"{backend_cls.__name__} must set both `name` and `framework`")
    with _lock:
        _entries[backend_cls.name] = _Entry(
            backend_cls.name, backend_cls.framework, backend_cls, "register_backend"
        )


def _instantiate(entry: _Entry) -> Backend:
    if entry.instance is None:
        with _lock:
            if entry.instance is None:
                target = entry.target
                if isinstance(target, str):
                    module_name, _, attr = target.partition(":")
                    target = getattr(importlib.import_module(module_name), attr)
                entry.instance = target()
    return entry.instance


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``: ``"numpy"``, ``"torch"`` (alias ``"cuda"``),
    ``"jax"``, or a plugin's name. Imports the backend's framework if needed.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: no backend has that name (the message lists the known ones).
        ImportError: the backend's framework is not installed.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}")
    _load_plugins()
    key = _ALIASES.get(name, name)
    entry = _entries.get(key)
    if entry is None:
        raise ValueError(f"unknown backend {name!r}; known backends: {sorted(_entries)}")
    return _instantiate(entry)


def host_backend() -> Backend:
    """``get_backend("numpy")`` in a few steps once it exists: the backend of host trees and
    masks, asked for on every call of the hot paths."""
    instance = _entries["numpy"].instance
    return instance if instance is not None else get_backend("numpy")


def backend_for(obj: Any) -> Backend:
    """The backend whose framework owns ``obj`` (an array, or a device/placement object).

    Only frameworks already imported by the caller are consulted; nothing is imported.

    Raises:
        TypeError: no registered backend recognizes ``obj``.
    """
    _load_plugins()
    for entry in list(_entries.values()):
        if entry.framework not in sys.modules:
            continue
        backend = _instantiate(entry)
        if backend.owns(obj):
            return backend
    raise TypeError(
        f"no portable_spec backend handles {type(obj).__module__}.{type(obj).__qualname__}; "
        f"backends with their framework imported: "
        f"{[e.name for e in _entries.values() if e.framework in sys.modules]}"
    )


def available_backends() -> list[str]:
    """Names of the backends whose framework is installed here, found without importing it.

    Returns a list of str, e.g. ``["numpy", "torch", "jax"]`` plus plugins' names. A name
    says which arrays the backend takes (``"torch"``: ``torch.Tensor`` on any device, CPU or
    CUDA; ``"jax"``: ``jax.Array`` on CPU, GPU or TPU), not that an accelerator is present:
    ask the framework (``torch.cuda.is_available()``, ``jax.devices()``) which devices exist.
    Never blocks; imports nothing but the plugins' entry points.
    """
    _load_plugins()
    names = []
    for entry in _entries.values():
        if entry.framework in sys.modules or importlib.util.find_spec(entry.framework):
            names.append(entry.name)
    return names
