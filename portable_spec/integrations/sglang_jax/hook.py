"""The switch of the sglang-jax integration in every process (``PORTABLE_SPEC_SGLANG_JAX=1``).

sglang-jax has no plugin entry point and starts its scheduler in a spawned process. The library
ships ``portable_spec_sglang_jax.pth`` into site-packages; Python runs its one line at the
start of every process, and that line imports nothing while ``PORTABLE_SPEC_SGLANG_JAX`` is
unset, empty, ``0`` or ``off``. Otherwise it calls :func:`activate_from_env`: for ``1``/``on``
an :class:`~portable_spec.integrations.import_hook.ImportHook` waits for sglang-jax's scheduler
module, and once it is imported ``Scheduler.__init__`` first installs the integration
(:func:`portable_spec.integrations.sglang_jax.install`, its log line in the scheduler's log).
Processes that never create a scheduler (the tokenizer, the detokenizer) patch nothing. Any
other value is refused with one line on stderr, and sglang-jax runs its own code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from portable_spec.integrations.face import read_mode
from portable_spec.integrations.import_hook import ImportHook
from portable_spec.integrations.sglang_jax.internals import TRIGGER, logger
from portable_spec.integrations.sglang_jax.state import ENV_VAR, INTEGRATION

__all__ = ["activate", "activate_from_env", "deactivate", "watching"]
_OWN_INIT = "__portable_spec_own_init__"  # on the wrapped Scheduler.__init__: sglang-jax's
_REPORTED: set[str] = set()  # refusals already written to stderr


def activate_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Activate the hook if ``PORTABLE_SPEC_SGLANG_JAX`` asks for the integration (``1``,
    ``on``). Returns whether it does. Never raises: a value that is not a switch (shadow mode
    included: sglang-jax has none) is reported on stderr, naming the variable."""
    try:
        mode = read_mode(ENV_VAR, shadow=False, environ=environ)
    except ValueError as exc:
        if str(exc) not in _REPORTED:  # once: site may run the .pth line twice (lib64 links)
            _REPORTED.add(str(exc))
            print(f"portable_spec: {exc}; the sglang-jax integration stays off", file=sys.stderr)
        return False
    if mode == "on":
        activate()
    return mode == "on"


def activate() -> None:
    """Install the integration when sglang-jax creates its scheduler in this process (at once
    if the scheduler module is already imported: its next ``Scheduler`` installs). Idempotent;
    :func:`~portable_spec.integrations.sglang_jax.uninstall` stops it."""
    INTEGRATION.watch(_SCHEDULER)


def deactivate() -> None:
    """Stop waiting for the scheduler module and give ``Scheduler.__init__`` back (an
    installed integration stays installed: :func:`~portable_spec.integrations.sglang_jax.
    uninstall` removes it, and stops this hook too)."""
    INTEGRATION.unwatch(_SCHEDULER)


def watching() -> bool:
    """Whether this process waits for sglang-jax's scheduler module or has its
    ``Scheduler.__init__`` install the integration."""
    return _SCHEDULER.watching()


def _install_first(module: ModuleType) -> None:
    """The scheduler module is imported: its ``Scheduler.__init__`` installs the integration
    before sglang-jax's own runs."""
    scheduler = module.Scheduler
    if hasattr(scheduler.__init__, _OWN_INIT):
        return
    scheduler.__init__ = _installing(scheduler.__init__)


def _installing(own: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            from portable_spec.integrations import sglang_jax

            sglang_jax.install()
        except Exception as exc:  # the scheduler starts with sglang-jax's own code
            logger.warning("portable_spec: the sglang-jax integration is not installed: %s", exc)
        own(self, *args, **kwargs)

    setattr(__init__, _OWN_INIT, own)
    __init__.__wrapped__ = own  # type: ignore[attr-defined]
    __init__.__doc__ = own.__doc__
    return __init__


class _SchedulerHook:
    """The scheduler module's import hook, and ``Scheduler.__init__`` wrapped once it is in."""

    def __init__(self) -> None:
        self._hook = ImportHook(TRIGGER, _install_first, logger)

    def activate(self) -> None:
        self._hook.activate()

    def deactivate(self) -> None:
        self._hook.deactivate()
        scheduler = getattr(sys.modules.get(TRIGGER), "Scheduler", None)
        own = getattr(getattr(scheduler, "__init__", None), _OWN_INIT, None)
        if scheduler is not None and own is not None:
            scheduler.__init__ = own

    def watching(self) -> bool:
        scheduler = getattr(sys.modules.get(TRIGGER), "Scheduler", None)
        wrapped = hasattr(getattr(scheduler, "__init__", None), _OWN_INIT)
        return self._hook.waiting() or wrapped


_SCHEDULER = _SchedulerHook()
