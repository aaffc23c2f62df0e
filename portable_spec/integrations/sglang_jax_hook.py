"""The switch of the sglang-jax integration in every process (``PORTABLE_SPEC_SGLANG_JAX=1``).

sglang-jax has no plugin entry point and starts its scheduler in a spawned process. The library
ships ``portable_spec_sglang_jax.pth`` into site-packages; Python runs its one line at the
start of every process, and that line imports nothing unless ``PORTABLE_SPEC_SGLANG_JAX`` asks
for the integration. Then it calls :func:`activate`, which watches for sglang-jax's scheduler
module: when it has been imported, ``Scheduler.__init__`` first installs the integration
(:func:`portable_spec.integrations.sglang_jax.install`, with its log line in the scheduler's
log). Processes that never create a scheduler (the tokenizer, the detokenizer) patch nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["SCHEDULER_MODULE", "activate", "watching"]

SCHEDULER_MODULE = "sgl_jax.srt.managers.scheduler"
_MARK = "_portable_spec_install"
_lock = threading.Lock()
_active = {"finder": None}


def activate() -> None:
    """Arrange for the integration to be installed when sglang-jax creates its scheduler in
    this process. Idempotent; never raises (a failure is reported on stderr and sglang-jax runs
    its own code)."""
    try:
        with _lock:
            module = sys.modules.get(SCHEDULER_MODULE)
            if module is not None:
                _wrap_scheduler(module)
                return
            if _active["finder"] is None:
                finder = _SchedulerFinder()
                sys.meta_path.insert(0, finder)
                _active["finder"] = finder
    except Exception as exc:  # pragma: no cover - never break the interpreter's start
        print(f"portable_spec: sglang-jax hook not active: {exc}", file=sys.stderr)


def watching() -> bool:
    """Whether this process waits for sglang-jax's scheduler (or has wrapped it)."""
    module = sys.modules.get(SCHEDULER_MODULE)
    wrapped = module is not None and hasattr(
        getattr(getattr(module, "Scheduler", None), "__init__", None), _MARK
    )
    return _active["finder"] is not None or wrapped


def _wrap_scheduler(module: ModuleType) -> None:
    scheduler = getattr(module, "Scheduler", None)
    if scheduler is None or hasattr(scheduler.__init__, _MARK):
        return
    original = scheduler.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            from portable_spec.integrations import sglang_jax

            sglang_jax.install()
        except Exception as exc:  # the scheduler starts with sglang-jax's own code
            import logging

            logging.getLogger("sgl_jax.portable_spec").warning(
                "portable_spec: the sglang-jax integration could not be installed: %s", exc
            )
        original(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    scheduler.__init__ = __init__


class _SchedulerFinder(importlib.abc.MetaPathFinder):
    """Finds sglang-jax's scheduler module through the other finders and wraps its loader.

    While it asks them, it answers nothing itself: another finder that also asks the finders
    of ``sys.meta_path`` (an import hook of the same kind) would otherwise ask it back, and
    the two would recurse without end."""

    _searching = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != SCHEDULER_MODULE or getattr(self._searching, "on", False):
            return None
        self._searching.on = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader)
                    return spec
            return None
        finally:
            self._searching.on = False


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            _wrap_scheduler(module)
            finder = _active["finder"]
            if finder is not None and finder in sys.meta_path:
                sys.meta_path.remove(finder)
            _active["finder"] = None

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, name)
