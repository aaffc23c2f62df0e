"""The one way an engine integration patches its engine: the contract.

An integration states, in one table, what it replaces (:class:`Patch`: a dotted target and a
function that makes the replacement from the engine's own) and how it recognises the engine
(:class:`Revision`: the version the engine reports and the SHA-256 of the source of every
function it replaces or relies on). A :class:`PatchSet` installs all of it or nothing: when
the engine is absent, reports another version, cannot import a module named in the table, or
any listed function's source differs, it logs one warning naming what it found, patches
nothing and the engine runs its own code.

Patch sets stack. Two sets (two integrations, or two copies of one table) may replace the same
function: each is a layer made from the function below it. Uninstalling any of them, in any
order, leaves exactly the layers still installed, in the target and in every module-level
name rebound to it (the layers above the one removed are made again from the function below
it); if one of them cannot be made again, the uninstall raises and changes nothing. A set
whose replacements were put back by someone else (``importlib.reload`` of the engine's module,
another library's patch on the same attribute) is no longer installed: :meth:`PatchSet.
is_installed` says so, :meth:`PatchSet.install` patches again, :meth:`PatchSet.uninstall`
leaves those attributes as they now are.

Nothing here imports an engine; :func:`resolve` imports a target's module when asked.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["Patch", "PatchSet", "Revision", "print_sources", "resolve", "source_hash"]

_ORIGINAL = "__portable_spec_original__"  # set on every replacement: the engine's own function
_MISSING = object()


def _split(target: str) -> tuple[str, list[str], str]:
    """``"package.module:Class.attribute"`` -> ``("package.module", ["Class"], "attribute")``."""
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname or ":" in qualname:
        raise ValueError(f"patch target {target!r} is not 'package.module:Qualified.name'")
    *path, attribute = qualname.split(".")
    return module_name, path, attribute


def resolve(target: str) -> tuple[Any, str, Any]:
    """``"package.module:Class.attribute"`` -> ``(owner, attribute, current value)``, importing
    the module. Raises ValueError for a target without exactly one ``:``, ImportError (or
    whatever the module raises while it is imported) or AttributeError when it does not
    exist."""
    module_name, path, attribute = _split(target)
    owner: Any = importlib.import_module(module_name)
    for part in path:
        owner = getattr(owner, part)
    return owner, attribute, getattr(owner, attribute)


def source_hash(function: Any) -> str:
    """SHA-256 (hex) of the source text of ``function`` (for a replacement made by a
    :class:`PatchSet`, of the engine's function it replaced). Raises OSError or TypeError when
    there is no source to read."""
    function = getattr(function, _ORIGINAL, function)
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def print_sources(engine: str, version: str | None, targets: Sequence[str]) -> None:
    """Print the :class:`Revision` row this process's engine would need: its version and the
    :func:`source_hash` of every target (importing their modules)."""
    print(f"{engine} {version}")
    for target in targets:
        digest, problem = _read_source(target)
        print(f"    {target!r}: {digest!r},{f'  # {problem}' if problem else ''}")


@dataclass(frozen=True)
class Patch:
    """One function of the engine, replaced or only relied on.

    ``target``: ``"package.module:Qualified.name"``. ``make``: called with the function below
    the patch, returns its replacement; ``None`` for a function the integration relies on
    without replacing it (its source is checked all the same). The function below is the
    engine's own, or what the patch before it made: several patches may name one target (a fix
    of the engine's function and the mask work on it) and are stacked in the order of the
    table. Where another patch set replaced the target first, its replacement is below; if
    that set is uninstalled while this one stays, ``make`` is called again with what is then
    below. ``rebind``: the replacement also takes the place of every module-level name bound
    to the original (``from module import name`` in modules imported before the install;
    modules imported after read the patched attribute anyway). ``fixes``: for a patch that
    works around a bug of the engine rather than adding the mask, the name of that bug in the
    integration's upstream notes; once the engine fixes it, a revision leaves the patch out
    (it omits the target, or names the bug in its ``fixed``).
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
        self._layers: dict[str, tuple[_Target, _Layer]] = {}  # target -> its record, our layer
        self._warned = False
        self.revision: str | None = None

    def is_installed(self) -> bool:
        """Whether every replacement of this set is in place in this process (False once one of
        them was put back by anyone but :meth:`uninstall`: a reload of its module, say)."""
        with self._lock:
            return self.revision is not None and self._in_place()

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
        with self._lock, _LOCK:
            if target in self._layers:
                return self._layers[target][0].base
        value = resolve(target)[2]
        return getattr(value, _ORIGINAL, value)

    def sources(self) -> dict[str, str | None]:
        """The :func:`source_hash` of every target in this process's engine (None: its module
        does not import, it is missing, or it has no source to read): what a new
        :class:`Revision` of the table lists."""
        return {patch.target: _read_source(patch.target)[0] for patch in self.patches}

    def reset_warning(self) -> None:
        """Let the next :meth:`install` that does not recognise the engine warn again."""
        with self._lock:
            self._warned = False

    def recognise(self) -> tuple[str | None, str]:
        """``(label, "")`` of the known revision the installed engine is, or ``(None, why)``:
        ``"not installed"``, a version no revision matches, a module of the table that does not
        import here (and what its import raised), or the functions whose source differs from
        every known release's (or that are missing)."""
        try:
            version = self._version()
        except Exception as exc:
            return None, f"its version could not be read ({type(exc).__name__}: {exc})"
        if version is None:
            return None, "not installed"
        shown = version or "(none reported)"
        candidates = {k: r for k, r in self.revisions.items() if r.matches_version(version)}
        if not candidates:
            known = ", ".join(sorted(self.revisions))
            return None, f"version {shown} is not a release this integration knows ({known})"
        read: dict[str, tuple[str | None, str]] = {}
        differing: list[str] = []
        for label, revision in candidates.items():
            for target in revision.sources:
                if target not in read:
                    read[target] = _read_source(target)
            differing = [t for t, h in revision.sources.items() if read[t][0] != h]
            if not differing:
                return label, ""
        failed = {t.partition(":")[0]: p for t, (_, p) in read.items() if p.startswith("import")}
        if failed:
            module, problem = next(iter(failed.items()))
            more = f"; {len(failed) - 1} more of its modules neither" if len(failed) > 1 else ""
            return None, f"{module} does not import here ({problem[len('import: ') :]}){more}"
        missing = [t for t in differing if read[t][1] == "missing"]
        changed = [t for t in differing if read[t][1] != "missing"]
        parts = [f"the source of {', '.join(changed)} differs"] if changed else []
        parts += [f"{', '.join(missing)} not found"] if missing else []
        return None, f"version {shown}, but {' and '.join(parts)}"

    def install(self) -> bool:
        """Patch the engine in this process, all or nothing. Returns whether it is patched
        (True at once when it already is; a set whose replacements were put back by someone
        else is installed anew)."""
        with self._lock:
            if self.revision is not None:
                if self._in_place():
                    return True
                self._take_down()
                self.revision = None
            label, why = self.recognise()
            if label is None:
                if why != "not installed" and not self._warned:
                    self._warned = True
                    self._logger.warning(
                        "portable_spec: %s is not patched (%s); its own code runs",
                        self.engine,
                        why,
                    )
                return False
            stacks: dict[str, list[Patch]] = {}
            for patch in self.installs(label):
                stacks.setdefault(patch.target, []).append(patch)
            with _LOCK:
                try:
                    for target, stack in stacks.items():
                        self._push(target, tuple(stack))
                except BaseException:
                    self._take_down()
                    raise
            self.revision = label
        self._logger.info(
            "portable_spec: %s %s patched (%d functions replaced)", self.engine, label, len(stacks)
        )
        return True

    def uninstall(self) -> None:
        """Take this set's replacements out, every rebound module name included (and the names
        modules imported while it was installed bound to them); other sets' replacements of
        the same functions stay. Raises RuntimeError, changing nothing, when a set installed
        over this one cannot make its replacement again from what is below."""
        with self._lock:
            self._take_down()
            self.revision = None

    # -- the layers --------------------------------------------------------------------------

    def _in_place(self) -> bool:
        with _LOCK:
            return all(record.holds(layer) for record, layer in self._layers.values())

    def _push(self, target: str, stack: tuple[Patch, ...]) -> None:
        """Put this set's ``stack`` on ``target``, above the layers already there."""
        owner, attribute, _ = resolve(target)
        key = (id(owner), attribute)
        record = _TARGETS.get(key)
        if record is not None and not record.live():  # put back by someone else
            record.retire()
            record = None
        if record is None:
            record = _Target(target, owner, attribute)
        layer = _Layer(self, stack)
        start = len(record.layers)
        layers = [*record.layers, layer]
        record.commit(layers, start, record.remake(layers, start))
        self._layers[target] = (record, layer)

    def _take_down(self) -> None:
        """Remove every layer of this set still in place (the layers above each remade first,
        so that a failure changes nothing), and forget the rest."""
        with _LOCK:
            plans = []
            for target, (record, layer) in reversed(self._layers.items()):
                if not record.holds(layer):
                    if _TARGETS.get(record.key) is record:
                        record.retire()
                    continue
                index = record.layers.index(layer)
                layers = record.layers[:index] + record.layers[index + 1 :]
                try:
                    made = record.remake(layers, index)
                except Exception as exc:
                    above = layers[index].owner.engine
                    raise RuntimeError(
                        f"{self.engine} cannot be uninstalled: {above}'s replacement of "
                        f"{target}, installed over it, failed to be made again without it "
                        f"({type(exc).__name__}: {exc}); nothing was changed"
                    ) from exc
                plans.append((record, layers, index, made))
            for record, layers, index, made in plans:
                record.commit(layers, index, made)
            self._layers.clear()


@dataclass(eq=False)
class _Layer:
    """One patch set's stack of patches on one target, and the replacement it made."""

    owner: PatchSet
    stack: tuple[Patch, ...]
    made: Any = None


class _Target:
    """One attribute of the engine replaced by one or more patch sets: the engine's function
    and a layer per set, bottom first. Kept in :data:`_TARGETS` while it has layers."""

    def __init__(self, name: str, owner: Any, attribute: str) -> None:
        self.name = name
        self.owner = owner
        self.attribute = attribute
        self.key = (id(owner), attribute)
        self.own = _raw(owner, attribute)  # what the owner held itself (_MISSING: inherited)
        self.binder = type(self.own) if isinstance(self.own, (staticmethod, classmethod)) else None
        self.base = self.own.__func__ if self.binder else getattr(owner, attribute)
        self.layers: list[_Layer] = []
        self.held: Any = _MISSING  # what the layers put on the owner
        self.rebound: dict[tuple[int, str], ModuleType] = {}  # names moved off the base
        self.rebinding = False  # whether a layer ever rebound names (then every change does)

    def live(self) -> bool:
        """Whether the owner still holds what the layers put there, and is still what the
        target names (a reloaded module's class is another owner)."""
        if _TARGETS.get(self.key) is not self or _raw(self.owner, self.attribute) is not self.held:
            return False
        module_name, path, _ = _split(self.name)
        owner: Any = sys.modules.get(module_name, _MISSING)
        for part in path:
            owner = getattr(owner, part, _MISSING)
        return owner is self.owner

    def holds(self, layer: _Layer) -> bool:
        return layer in self.layers and self.live()

    def remake(self, layers: list[_Layer], start: int) -> list[Any]:
        """The replacements of ``layers[start:]``, each made from the one below (the first from
        the engine's function when ``start`` is 0). Nothing is changed."""
        below = layers[start - 1].made if start else self.base
        made = []
        for layer in layers[start:]:
            below = _make(layer.stack, below, self.base)
            made.append(below)
        return made

    def commit(self, layers: list[_Layer], start: int, made: list[Any]) -> None:
        """Make ``layers`` (with ``made``, the new replacements of ``layers[start:]``) what the
        target holds, and every module-level name follow."""
        superseded = {id(layer.made): layer.made for layer in self.layers[start:]}
        self.rebinding = self.rebinding or _rebinds(layers)
        for layer, replacement in zip(layers[start:], made, strict=True):
            layer.made = replacement
        self.layers = layers
        if layers:
            top = layers[-1].made
            self.held = top if self.binder is None else self.binder(top)
            setattr(self.owner, self.attribute, self.held)
            _TARGETS[self.key] = self
        else:
            if self.own is _MISSING:
                delattr(self.owner, self.attribute)
            else:
                setattr(self.owner, self.attribute, self.own)
            self.held = _MISSING
            _TARGETS.pop(self.key, None)
        if self.rebinding:
            self._rebind(superseded)

    def retire(self) -> None:
        """The owner no longer holds what the layers put there (a reload, another library's
        patch): leave it as it is, give every module-level name holding one of the layers'
        replacements the function it held before them, and forget the layers (their sets are
        no longer installed)."""
        superseded = {id(layer.made): layer.made for layer in self.layers}
        self.layers = []
        _TARGETS.pop(self.key, None)
        if self.rebinding:
            self._rebind(superseded)

    def _rebind(self, superseded: dict[int, Any]) -> None:
        """Every module-level name outside the owner that holds one of the target's functions
        gets what it should hold now: the top while a layer rebinds (the engine's function
        where none does) for names bound to the engine's function, the top for names bound
        to a replacement made by a layer since removed or remade."""
        top = self.layers[-1].made if self.layers else self.base
        rebinding = _rebinds(self.layers)
        known = {id(f): f for f in (self.base, *superseded.values())}
        known.update((id(layer.made), layer.made) for layer in self.layers)
        for module in list(sys.modules.values()):
            names = getattr(module, "__dict__", None)
            if module is self.owner or not isinstance(names, dict):
                continue
            for name, value in list(names.items()):
                if id(value) not in known or known[id(value)] is not value:
                    continue
                key = (id(module), name)
                if key in self.rebound or value is self.base:
                    want = top if rebinding else self.base
                    if want is self.base:
                        self.rebound.pop(key, None)
                    else:
                        self.rebound[key] = module
                else:  # bound by an import while installed: what that import would bind now
                    want = top
                if value is not want:
                    names[name] = want


#: Every replaced attribute in this process, by ``(id(owner), attribute)``, and the lock every
#: patch set takes to change any of them.
_TARGETS: dict[tuple[int, str], _Target] = {}
_LOCK = threading.RLock()


def _rebinds(layers: Sequence[_Layer]) -> bool:
    return any(patch.rebind for layer in layers for patch in layer.stack)


def _raw(owner: Any, attribute: str) -> Any:
    """What ``owner`` holds itself (for a class: its own ``__dict__`` entry, staticmethod and
    classmethod objects as they are; ``_MISSING`` when inherited or absent)."""
    if isinstance(owner, type):
        return vars(owner).get(attribute, _MISSING)
    return getattr(owner, attribute, _MISSING)


def _make(stack: Sequence[Patch], below: Any, base: Any) -> Any:
    """``stack``'s replacement of ``below``, each patch made from the one before; every
    replacement names ``base`` (the engine's function) as its original and carries its name
    and docstring."""
    replacement = below
    for patch in stack:
        assert patch.make is not None
        replacement = patch.make(replacement)
        setattr(replacement, _ORIGINAL, base)
        for name in ("__doc__", "__name__", "__qualname__"):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(replacement, name, getattr(base, name))
    return replacement


def _read_source(target: str) -> tuple[str | None, str]:
    """``(source_hash, "")`` of ``target``, or ``(None, why)``: ``"import: <what the module
    raised>"``, ``"missing"`` (no such attribute) or ``"no source"``. Imports the module."""
    module_name, _, _ = _split(target)
    try:
        importlib.import_module(module_name)
    except Exception as exc:  # an import failure is named, never taken for another source
        return None, f"import: {type(exc).__name__}: {exc}"
    try:
        value = resolve(target)[2]
    except AttributeError:
        return None, "missing"
    try:
        return source_hash(value), ""
    except (OSError, TypeError):
        return None, "no source"
