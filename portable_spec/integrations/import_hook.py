"""Patching when the engine imports a module: :class:`ImportHook`, for engines whose workers run
in processes of their own (the integration's switch is read where the process starts; the
patches go in once the engine imports what they replace)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["ImportHook"]


class ImportHook:
    """Calls ``callback(module)`` once ``module_name`` has been imported and executed in this
    process: at :meth:`activate` if it already is, otherwise right after its import (through a
    finder placed first on ``sys.meta_path``, removed once used). A failing callback is logged
    and never breaks the engine's import."""

    def __init__(
        self, module_name: str, callback: Callable[[ModuleType], None], logger: logging.Logger
    ) -> None:
        self.module_name = module_name
        self._callback = callback
        self._logger = logger
        self._lock = threading.Lock()
        self._finder: _Finder | None = None

    def activate(self) -> None:
        with self._lock:
            module = sys.modules.get(self.module_name)
            if module is None:
                if self._finder is None:
                    self._finder = _Finder(self)
                    sys.meta_path.insert(0, self._finder)
                return
        self.fire(module)

    def deactivate(self) -> None:
        with self._lock:
            if self._finder is not None and self._finder in sys.meta_path:
                sys.meta_path.remove(self._finder)
            self._finder = None

    def waiting(self) -> bool:
        """Whether the hook still waits for its module's import."""
        return self._finder is not None

    def fire(self, module: ModuleType) -> None:
        """Run the callback on ``module`` (logged, never raised, if it fails)."""
        try:
            self._callback(module)
        except Exception:
            self._logger.exception("portable_spec: patching %s failed", self.module_name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the hook's module through the other finders and wraps its loader. While it asks
    them it answers nothing itself, so a finder of the same kind asking back cannot recurse."""

    _searching = threading.local()

    def __init__(self, hook: ImportHook) -> None:
        self._hook = hook

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._hook.module_name or getattr(self._searching, "on", False):
            return None
        self._searching.on = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader, self._hook)
                    return spec
            return None
        finally:
            self._searching.on = False


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: ImportHook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook.deactivate()
        self._hook.fire(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, name)
