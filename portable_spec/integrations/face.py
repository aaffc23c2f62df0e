"""What every engine package shows its users, in one implementation.

* :func:`read_mode`: the switch (``ENV_VAR``) every package reads: ``1``/``on``, ``shadow``,
  ``0``/``off``/unset, a ValueError naming the variable for anything else;
* :func:`engine_version`: the version an engine reports (each ``internals.version()``);
* :class:`Integration`: a package's ``install(mode)``, ``uninstall()``, ``is_installed()``,
  ``integration_stats()`` and ``reset_stats()``, made from its parts: its ``internals``
  module (the engine's names and table of releases), its table of patches (the package's
  ``patches`` module, imported at the first install), its :class:`~portable_spec.
  integrations.telemetry.Stats` and :class:`~portable_spec.integrations.telemetry.LogOnce`.

Nothing here imports an engine.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

from portable_spec.integrations.import_hook import ImportHook
from portable_spec.integrations.patching import PatchSet
from portable_spec.integrations.telemetry import LogOnce, Stats

__all__ = ["Integration", "engine_version", "read_mode"]

_ON = ("1", "on")
_OFF = ("", "0", "off")


def read_mode(
    env_var: str, *, shadow: bool = True, environ: Mapping[str, str] | None = None
) -> str:
    """The mode an environment variable asks for: ``"on"`` (``1``, ``on``), ``"shadow"``
    (``shadow``, where the integration can compute the engine's own result beside its own) or
    ``"off"`` (unset, empty, ``0``, ``off``). Case and surrounding spaces are ignored.

    Raises ValueError naming the variable for any other value (and for ``shadow`` when
    ``shadow`` is False): a misspelt switch must not silently leave the engine unpatched.
    """
    value = (os.environ if environ is None else environ).get(env_var, "").strip().lower()
    if value in _ON:
        return "on"
    if value in _OFF:
        return "off"
    if value == "shadow" and shadow:
        return "shadow"
    allowed = "1/on, shadow, 0/off" if shadow else "1/on, 0/off"
    raise ValueError(f"{env_var}={value!r} is not one of {allowed} (or unset)")


def engine_version(package: str, distributions: Sequence[str]) -> str | None:
    """The version of the engine importable as ``package``, read from its distribution's
    metadata (nothing is imported): None when ``package`` is not importable here (the engine
    is absent), else the version of the first of ``distributions`` installed, else ``""`` (a
    source tree on ``sys.path``: only a revision for any version, ``Revision("")``, matches
    it). ``package`` is a top-level name."""
    if importlib.util.find_spec(package) is None:
        return None
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


class Hook(Protocol):
    """Something that installs an integration later (when the engine imports a module, say):
    :class:`~portable_spec.integrations.import_hook.ImportHook` is one."""

    def activate(self) -> None: ...

    def deactivate(self) -> None: ...


class Integration:
    """One engine package's face.

    ``internals``: the package's ``internals`` module, which names ``ENGINE`` (the engine's
    name in log lines and errors), ``logger`` (a child of the engine's logger), ``REVISIONS``
    (the releases it knows) and ``version()``. ``table``: the dotted name of the package's
    ``patches`` module, whose ``PATCHES`` lists every :class:`~portable_spec.integrations.
    patching.Patch` in stacking order (imported at the first install, so the replacements'
    modules are not imported before one is asked for). ``modes``: what ``install`` takes
    (``("on",)`` or ``("on", "shadow")``). ``stats`` and ``log``: the package's counters and
    once-per-process lines. ``on_install(revision)``, ``on_uninstall()``: what the package
    does beside the patches (set after a successful install, undone at uninstall).

    :attr:`mode` is the mode the replacements run in (``"on"`` until an install says
    otherwise), :attr:`revision` the label of the release installed (None when not
    installed); the replacements read both on every call, without a lock. Thread-safe.
    """

    def __init__(
        self,
        internals: ModuleType,
        *,
        table: str,
        modes: Sequence[str],
        stats: Stats,
        log: LogOnce,
        on_install: Callable[[str], None] | None = None,
        on_uninstall: Callable[[], None] | None = None,
    ) -> None:
        if not modes or modes[0] != "on" or not set(modes) <= {"on", "shadow"}:
            raise ValueError(f"modes must be ('on',) or ('on', 'shadow'), got {modes!r}")
        self.internals = internals
        self.engine: str = internals.ENGINE
        self.modes = tuple(modes)
        self.stats = stats
        self.log = log
        self.mode = "on"
        self.revision: str | None = None
        self._table = table
        self._on_install = on_install
        self._on_uninstall = on_uninstall
        self._lock = threading.RLock()
        self._patches: PatchSet | None = None
        self._hooks: list[Hook] = []

    # -- the face ------------------------------------------------------------------------------

    def check_mode(self, mode: str) -> None:
        """ValueError, in the words every package uses, unless ``install`` takes ``mode``."""
        if mode not in self.modes:
            takes = " or ".join(repr(m) for m in self.modes)
            why = "" if "shadow" in self.modes else f" ({self.engine} has no shadow mode)"
            raise ValueError(
                f"the {self.engine} integration's install() takes mode {takes}{why}, not {mode!r}"
            )

    def install(self, mode: str = "on") -> bool:
        """Check ``mode``, switch the replacements to it (at once, also when installed), then
        patch the engine: True when the patches are in place; False without the engine
        (nothing imported, nothing logged) or on a release the table does not know (one
        ``WARNING``; the engine's own code runs)."""
        self.check_mode(mode)
        with self._lock:
            self.mode = mode
            patches = self.patch_set()
            if patches.is_installed():
                return True
            if not patches.install():
                return False
            self.revision = patches.revision
            if self._on_install is not None:
                self._on_install(self.revision or "")
            return True

    def uninstall(self) -> None:
        """Give the engine its own functions back in this process, and stop every hook that
        would install them again (:meth:`watch`, :meth:`install_on_import`)."""
        with self._lock:
            for hook in reversed(self._hooks):
                hook.deactivate()
            self._hooks.clear()
            if self._patches is not None:
                self._patches.uninstall()
            self.revision = None
            if self._on_uninstall is not None:
                self._on_uninstall()

    def is_installed(self) -> bool:
        """Whether the engine's functions are the integration's in this process."""
        return self._patches is not None and self._patches.is_installed()

    def integration_stats(self) -> dict[str, Any]:
        """A snapshot of the package's counters (:meth:`Stats.snapshot`). Never blocks."""
        return self.stats.snapshot()

    def reset_stats(self) -> None:
        """Forget every counter and timing of this process; the once-per-process lines, and
        the warning about a release the table does not know, may be logged again."""
        self.stats.reset()
        self.log.reset()
        if self._patches is not None:
            self._patches.reset_warning()

    # -- beside the face -------------------------------------------------------------------------

    def watch(self, hook: Hook) -> None:
        """Activate ``hook`` (once; :meth:`uninstall` or :meth:`unwatch` deactivates it)."""
        with self._lock:
            if hook not in self._hooks:
                self._hooks.append(hook)
        hook.activate()

    def unwatch(self, hook: Hook) -> None:
        """Deactivate ``hook`` (the patches already installed stay)."""
        with self._lock:
            if hook in self._hooks:
                self._hooks.remove(hook)
        hook.deactivate()

    def install_on_import(self, module: str, mode: str = "on") -> None:
        """Install in ``mode`` as soon as the engine's ``module`` is imported in this process
        (now, if it is): for engines whose workers run in processes of their own, from the
        entry point those processes run. Idempotent; :meth:`uninstall` stops waiting."""
        self.check_mode(mode)
        with self._lock:
            for hook in self._hooks:
                if isinstance(hook, ImportHook) and hook.module_name == module:
                    break
            else:
                hook = ImportHook(module, lambda _m: self.install(mode), self.internals.logger)
        self.watch(hook)

    def patch_set(self) -> PatchSet:
        """This process's patch set (made at the first call from the package's table)."""
        with self._lock:
            if self._patches is None:
                self._patches = self.new_patch_set()
            return self._patches

    def new_patch_set(self) -> PatchSet:
        """A patch set made now from the package's table and ``internals`` as they are (one
        to recognise the engine against a changed table, say; it is not this process's)."""
        internals = self.internals
        return PatchSet(
            self.engine,
            patches=importlib.import_module(self._table).PATCHES,
            revisions=internals.REVISIONS,
            version=lambda: internals.version(),
            logger=internals.logger,
        )
