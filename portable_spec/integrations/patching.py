"""The one way an engine integration patches its engine.

An integration states, in one table, what it replaces (:class:`Patch`: a dotted target and a
function that makes the replacement from the engine's own) and how it recognises the engine
(:class:`Revision`: the version the engine reports and the SHA-256 of the source of every
function it replaces or relies on). A :class:`PatchSet` installs all of it or nothing: when
the engine is absent, reports another version, or any listed function's source differs, it
logs one warning naming what differs, patches nothing and the engine runs its own code.

Also here: :func:`read_mode` (the ``1``/``shadow``/``0`` switch every integration reads from
its environment variable), :class:`ImportHook` (patch when a module is imported, for engines
that start their workers in processes of their own), :class:`Stats` (one shape of counters,
series and per-batch timings for every integration's ``integration_stats()``) and
:class:`LogOnce` (a message per kind of event, once per process, in the engine's log).

Nothing here imports an engine; :func:`resolve` imports a target's module when asked.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import statistics
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = [
    "ImportHook",
    "LogOnce",
    "Patch",
    "PatchSet",
    "Revision",
    "Stats",
    "read_mode",
    "resolve",
    "source_hash",
]

_ORIGINAL = "__portable_spec_original__"  # set on every replacement: the engine's own function
_MISSING = object()
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


def resolve(target: str) -> tuple[Any, str, Any]:
    """``"package.module:Class.attribute"`` -> ``(owner, attribute, current value)``, importing
    the module. Raises ValueError for a target without exactly one ``:``, ImportError or
    AttributeError when it does not exist."""
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname or ":" in qualname:
        raise ValueError(f"patch target {target!r} is not 'package.module:Qualified.name'")
    owner: Any = importlib.import_module(module_name)
    *path, attribute = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attribute, getattr(owner, attribute)


def source_hash(function: Any) -> str:
    """SHA-256 (hex) of the source text of ``function`` (for a replacement made by a
    :class:`PatchSet`, of the engine's function it replaced). Raises OSError or TypeError when
    there is no source to read."""
    function = getattr(function, _ORIGINAL, function)
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


@dataclass(frozen=True)
class Patch:
    """One function of the engine, replaced or only relied on.

    ``target``: ``"package.module:Qualified.name"``. ``make``: called once with the engine's
    function, returns its replacement; ``None`` for a function the integration relies on
    without replacing it (its source is checked all the same). Several patches may name one
    target (a fix of the engine's function and the mask work on it): they are stacked in the
    order of the table, each ``make`` given what the one before made (the first: the engine's
    function). ``rebind``: the replacement also takes the place of every module-level name
    bound to the original when the patch set is installed (``from module import name`` in
    modules imported before; modules imported after read the patched attribute anyway).
    ``fixes``: for a patch that works around a bug of the engine rather than adding the mask,
    the name of that bug in the integration's upstream notes; once the engine fixes it, a
    revision leaves the patch out (it omits the target, or names the bug in its ``fixed``).
    """

    target: str
    make: Callable[[Any], Any] | None = None
    rebind: bool = False
    fixes: str = ""


@dataclass(frozen=True)
class Revision:
    """A release of the engine the integration knows: ``version``, the prefix of the version
    the engine reports (``"0.32"`` matches ``"0.32.0"`` and ``"0.32.1"``, not ``"0.321"``; ``""``
    any version), ``sources``, the :func:`source_hash` of every target at that release, and
    ``fixed``, the engine bugs (:attr:`Patch.fixes`) the release no longer has. The patches
    installed for it are those whose target is listed and whose bug is not fixed."""

    version: str
    sources: Mapping[str, str] = field(default_factory=dict)
    fixed: frozenset[str] = frozenset()

    def matches_version(self, version: str) -> bool:
        if not self.version:
            return True
        rest = version[len(self.version) :]
        return version.startswith(self.version) and not rest[:1].isdigit()


class PatchSet:
    """An engine's patches, installed and uninstalled as a whole.

    ``version`` returns the engine's version, or None when it is not installed (then
    :meth:`install` returns False without a warning). ``revisions``: label -> :class:`Revision`.
    Thread-safe; :meth:`install` and :meth:`uninstall` are idempotent and never block on the
    engine's devices.
    """

    def __init__(
        self,
        engine: str,
        *,
        patches: Sequence[Patch],
        revisions: Mapping[str, Revision],
        version: Callable[[], str | None],
        logger: logging.Logger,
    ) -> None:
        targets = {p.target for p in patches}
        bugs = {p.fixes for p in patches if p.fixes}
        for label, revision in revisions.items():
            unknown = set(revision.sources) - targets
            if unknown:
                raise ValueError(f"{engine} {label}: sources of unpatched targets {unknown}")
            if set(revision.fixed) - bugs:
                raise ValueError(
                    f"{engine} {label}: fixed bugs no patch works around "
                    f"{set(revision.fixed) - bugs}"
                )
        self.engine = engine
        self.patches = tuple(patches)
        self.revisions = dict(revisions)
        self._version = version
        self._logger = logger
        self._lock = threading.RLock()
        # target -> (owner, attribute, the owner's own value before, replacement)
        self._applied: dict[str, tuple[Any, str, Any, Any]] = {}
        self._rebound: list[tuple[ModuleType, str, Any]] = []  # (module, name, original)
        self._warned = False
        self.revision: str | None = None

    def is_installed(self) -> bool:
        """Whether the patches are in place in this process."""
        return self.revision is not None

    def installs(self, label: str) -> tuple[Patch, ...]:
        """The patches that replace a function at revision ``label``, in table order."""
        revision = self.revisions[label]
        return tuple(
            p
            for p in self.patches
            if p.make is not None and p.target in revision.sources and p.fixes not in revision.fixed
        )

    def original(self, target: str) -> Any:
        """The engine's own function behind ``target`` (patched or not)."""
        with self._lock:
            if target in self._applied:
                return getattr(self._applied[target][3], _ORIGINAL)
        return resolve(target)[2]

    def sources(self) -> dict[str, str | None]:
        """The :func:`source_hash` of every target in this process's engine (None: missing, or
        no source to read): what a new :class:`Revision` of the table lists."""
        return {patch.target: _hash_or_none(patch.target) for patch in self.patches}

    def reset_warning(self) -> None:
        """Let the next :meth:`install` that does not recognise the engine warn again."""
        with self._lock:
            self._warned = False

    def recognise(self) -> tuple[str | None, str]:
        """``(label, "")`` of the known revision the installed engine is, or ``(None, why)``."""
        try:
            version = self._version()
        except Exception as exc:
            return None, f"its version could not be read ({type(exc).__name__}: {exc})"
        if version is None:
            return None, "not installed"
        candidates = {k: r for k, r in self.revisions.items() if r.matches_version(version)}
        if not candidates:
            return None, f"version {version} is not one of {sorted(self.revisions)}"
        differing: list[str] = []
        for label, revision in candidates.items():
            differing = [t for t, h in revision.sources.items() if _hash_or_none(t) != h]
            if not differing:
                return label, ""
        return None, f"version {version}, source differs: {', '.join(differing)}"

    def install(self) -> bool:
        """Patch the engine in this process, all or nothing. Returns whether it is patched."""
        with self._lock:
            if self.revision is not None:
                return True
            label, why = self.recognise()
            if label is None:
                if why != "not installed" and not self._warned:
                    self._warned = True
                    self._logger.warning(
                        "portable_spec: %s is not a release this integration knows (%s); "
                        "its own code runs",
                        self.engine,
                        why,
                    )
                return False
            stacks: dict[str, list[Patch]] = {}
            for patch in self.installs(label):
                stacks.setdefault(patch.target, []).append(patch)
            try:
                for target, stack in stacks.items():
                    self._apply(target, stack)
            except BaseException:
                self._restore()
                raise
            self.revision = label
        replaced = len(stacks)
        self._logger.info(
            "portable_spec: %s %s patched (%d functions replaced)", self.engine, label, replaced
        )
        return True

    def uninstall(self) -> None:
        """Give the engine its own functions back (every rebound module name included, and
        the names modules imported while it was installed bound to a replacement)."""
        with self._lock:
            self._restore()
            self.revision = None

    def _apply(self, target: str, stack: Sequence[Patch]) -> None:
        """Replace ``target`` by its ``stack`` of patches, the first made from the engine's own."""
        owner, attribute, original = resolve(target)
        own = vars(owner).get(attribute, _MISSING) if isinstance(owner, type) else original
        binder = type(own) if isinstance(own, (staticmethod, classmethod)) else None
        if binder is not None:  # the replacement is made from, and bound like, the function
            original = own.__func__
        replacement = original
        for patch in stack:
            assert patch.make is not None
            replacement = patch.make(replacement)
            setattr(replacement, _ORIGINAL, original)
            for name in ("__doc__", "__name__", "__qualname__"):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(replacement, name, getattr(original, name))
        setattr(owner, attribute, replacement if binder is None else binder(replacement))
        self._applied[target] = (owner, attribute, own, replacement)
        if any(patch.rebind for patch in stack):
            for module in list(sys.modules.values()):
                names = getattr(module, "__dict__", None)
                if module is owner or not isinstance(names, dict):
                    continue
                for name, value in list(names.items()):
                    if value is original:
                        names[name] = replacement
                        self._rebound.append((module, name, original))

    def _restore(self) -> None:
        for module, name, original in reversed(self._rebound):
            module.__dict__[name] = original
        self._rebound.clear()
        # modules imported while installed bound the replacement itself (from X import Y)
        late = {
            id(replacement): getattr(replacement, _ORIGINAL)
            for target, (_, _, _, replacement) in self._applied.items()
            if self._rebinds(target)
        }
        if late:
            for module in list(sys.modules.values()):
                names = getattr(module, "__dict__", None)
                if not isinstance(names, dict):
                    continue
                for name, value in list(names.items()):
                    original = late.get(id(value))
                    if original is not None and isinstance(value, type(original)):
                        names[name] = original
        for owner, attribute, own, _ in reversed(self._applied.values()):
            if own is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, own)
        self._applied.clear()

    def _rebinds(self, target: str) -> bool:
        return any(p.target == target and p.rebind for p in self.patches)


def _hash_or_none(target: str) -> str | None:
    try:
        return source_hash(resolve(target)[2])
    except Exception:  # missing module, attribute or source: not this revision
        return None


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


class LogOnce:
    """Log each kind of event once per process (until :meth:`reset`): a step an integration
    leaves to the engine's own code says why the first time only. Thread-safe."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, key: str) -> bool:
        """True the first time ``key`` is asked for (since the last :meth:`reset`). Takes no
        lock once ``key`` was seen (a step's hot path may ask every time)."""
        if key in self._seen:
            return False
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    def warning(self, key: str, message: str, *args: Any) -> None:
        """``logger.warning(message, *args)`` the first time ``key`` is seen."""
        if self.first(key):
            self.logger.warning(message, *args)

    def info(self, key: str, message: str, *args: Any) -> None:
        """``logger.info(message, *args)`` the first time ``key`` is seen."""
        if self.first(key):
            self.logger.info(message, *args)

    def reset(self) -> None:
        """Every kind may be logged again."""
        with self._lock:
            self._seen.clear()


class Stats:
    """Thread-safe counters, bounded series and per-batch timings of one integration.

    ``counters``: names counted with :meth:`add`; ``series``: names whose last ``history``
    values :meth:`sample` keeps (seconds waited, rows per step...); :meth:`time` keeps the
    last ``history`` durations per build name and batch size; ``builds``: build names listed
    in every snapshot, timed or not (an integration's own and the engine's, say).
    :meth:`snapshot` never blocks.
    """

    def __init__(
        self,
        counters: Sequence[str],
        series: Sequence[str] = (),
        *,
        builds: Sequence[str] = (),
        history: int = 4096,
    ) -> None:
        self._names = tuple(counters)
        self._series_names = tuple(series)
        self._builds = tuple(builds)
        self._history = history
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._counters = dict.fromkeys(self._names, 0)
            self._series: dict[str, deque[float]] = {
                n: deque(maxlen=self._history) for n in self._series_names
            }
            self._times: dict[str, dict[int, deque[float]]] = {b: {} for b in self._builds}

    def add(self, name: str, n: int = 1) -> int:
        """Add ``n`` to counter ``name``; returns its new value (KeyError for an unknown name)."""
        with self._lock:
            value = self._counters[name] + n
            self._counters[name] = value
            return value

    def sample(self, name: str, value: float) -> None:
        with self._lock:
            self._series[name].append(value)

    def update(self, counts: Mapping[str, int], samples: Mapping[str, float] | None = None) -> None:
        """Several counters (``name: n``) and series values at once, under one lock (a step's
        bookkeeping in one call). Raises KeyError for an unknown name, counting nothing."""
        samples = samples or {}
        with self._lock:
            unknown = (counts.keys() - self._counters) | (samples.keys() - self._series)
            if unknown:
                raise KeyError(f"not counted here: {sorted(unknown)}")
            for name, n in counts.items():
                self._counters[name] += n
            for name, value in samples.items():
                self._series[name].append(value)

    def time(self, build: str, batch: int, seconds: float) -> None:
        with self._lock:
            per = self._times.setdefault(build, {})
            per.setdefault(batch, deque(maxlen=self._history)).append(seconds)

    def snapshot(self) -> dict[str, Any]:
        """``{counter: int, ..., series: [values], ..., "median_us": {build: {batch: µs}},
        "samples": {build: {batch: count}}}``."""
        with self._lock:
            snap: dict[str, Any] = dict(self._counters)
            snap.update({n: list(v) for n, v in self._series.items()})
            times = {b: {n: list(v) for n, v in per.items()} for b, per in self._times.items()}
        snap["median_us"] = {
            b: {n: statistics.median(v) * 1e6 for n, v in sorted(per.items()) if v}
            for b, per in times.items()
        }
        snap["samples"] = {
            b: {n: len(v) for n, v in sorted(per.items())} for b, per in times.items()
        }
        return snap
