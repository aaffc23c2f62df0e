"""The drafting patch sets (:data:`.internals.DRAFT_SETS`: EAGLE v2's draft loop, the NGRAM
worker's trees), each installed when its worker module is imported, as the drafting switch
(:func:`.state.drafting_mode`) says; the plugin's install and uninstall call
:func:`follow_switch` and :func:`stop`. The plugin never imports a speculative worker module
itself."""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from portable_spec.integrations.import_hook import ImportHook
from portable_spec.integrations.patching import PatchSet
from portable_spec.integrations.sglang import drafting, eagle_draft, internals, ngram
from portable_spec.integrations.sglang.internals import logger
from portable_spec.integrations.sglang.patches import drafting_patches
from portable_spec.integrations.sglang.state import INTEGRATION, drafting_mode

__all__ = ["WhenImported", "follow_switch", "stop"]

_sets: dict[str, tuple[PatchSet, WhenImported]] = {}
_sets_lock = threading.Lock()


def _patch_sets() -> dict[str, tuple[PatchSet, WhenImported]]:
    with _sets_lock:
        if not _sets:
            for name, patches in drafting_patches().items():
                module, targets, reads = internals.DRAFT_SETS[name]
                made = PatchSet(
                    f"{internals.ENGINE} {name}",
                    patches=patches,
                    revisions=internals.draft_revisions((*targets, *reads)),
                    version=internals.version,
                    logger=logger,
                )
                _sets[name] = (made, WhenImported(module, lambda _m, made=made: _install(made)))
        return _sets


def _install(patches: PatchSet) -> None:
    if INTEGRATION.is_installed() and drafting_mode() != "off":
        patches.install()


def follow_switch() -> None:
    """The drafting patches as the switch says, where the plugin is installed: in place (now
    where their worker module is imported, else when it is), or sglang's own draft code."""
    if INTEGRATION.is_installed() and drafting_mode() != "off":
        for _, waiter in _patch_sets().values():
            waiter.activate()
    else:
        stop()


def stop() -> None:
    """sglang's own draft code back, and nothing drafted kept."""
    with _sets_lock:
        sets = list(_sets.values())
    for patches, waiter in sets:
        waiter.deactivate()
        patches.uninstall()
    drafting.clear()
    drafting.forget_parked()
    eagle_draft.forget_roots()
    ngram.forget()


class WhenImported:
    """Calls ``callback(module)`` once the module ``name`` has been imported and executed:
    at :meth:`activate` if it has been, right after its import if it has not started
    (:class:`~portable_spec.integrations.patching.ImportHook`), or, when it is executing right
    now (an import cycle reached the plugin from inside it), at the first import that starts
    after it finished. A failing callback is logged, never raised into an import."""

    def __init__(self, name: str, callback: Callable[[ModuleType], Any]) -> None:
        self.name = name
        self._callback = callback
        self._hook: ImportHook | None = None
        self._after: _AfterImport | None = None

    def activate(self) -> None:
        module = sys.modules.get(self.name)
        if module is not None and _initializing(module):
            if self._after is None:
                self._after = _AfterImport(self)
                sys.meta_path.insert(0, self._after)
            return
        if self._hook is None:
            self._hook = ImportHook(self.name, self._callback, logger)
        self._hook.activate()

    def deactivate(self) -> None:
        if self._hook is not None:
            self._hook.deactivate()
        self._drop_after()

    def _drop_after(self) -> None:
        after, self._after = self._after, None
        if after is not None and after in sys.meta_path:
            sys.meta_path.remove(after)

    def _poll(self) -> None:
        module = sys.modules.get(self.name)
        if module is None or _initializing(module):
            return
        self._drop_after()
        try:
            self._callback(module)
        except Exception:
            logger.exception("portable_spec: patching %s failed", self.name)


def _initializing(module: ModuleType) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Asks its waiter to check its module at every import; finds nothing itself."""

    _busy = threading.local()

    def __init__(self, waiter: WhenImported) -> None:
        self._waiter = waiter

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if not getattr(self._busy, "on", False):
            self._busy.on = True
            try:
                self._waiter._poll()
            finally:
                self._busy.on = False
        return None
