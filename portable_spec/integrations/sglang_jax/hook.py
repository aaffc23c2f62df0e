"""The switch of the sglang-jax integration in every process (``PORTABLE_SPEC_SGLANG_JAX=1``).

sglang-jax has no plugin entry point and starts its scheduler in a spawned process. The library
ships ``portable_spec_sglang_jax.pth`` into site-packages; Python runs its one line at the
start of every process, and that line imports nothing while ``PORTABLE_SPEC_SGLANG_JAX`` is
unset, empty, ``0`` or ``off``. Otherwise it calls :func:`activate_from_env`: for ``1``/``on``
an :class:`~portable_spec.integrations.patching.ImportHook` waits for sglang-jax's scheduler
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

from portable_spec.integrations.patching import ImportHook, read_mode
from portable_spec.integrations.sglang_jax.state import ENV_VAR, logger

__all__ = ["SCHEDULER_MODULE", "activate", "activate_from_env", "deactivate", "watching"]

SCHEDULER_MODULE = "sgl_jax.srt.managers.scheduler"
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
    if the scheduler module is already imported: its next ``Scheduler`` installs). Idempotent."""
    _HOOK.activate()


def deactivate() -> None:
    """Stop waiting for the scheduler module and give ``Scheduler.__init__`` back (an
    installed integration stays installed: :func:`~portable_spec.integrations.sglang_jax.
    uninstall` removes it)."""
    _HOOK.deactivate()
    scheduler = getattr(sys.modules.get(SCHEDULER_MODULE), "Scheduler", None)
    own = getattr(getattr(scheduler, "__init__", None), _OWN_INIT, None)
    if scheduler is not None and own is not None:
        scheduler.__init__ = own


def watching() -> bool:
    """Whether this process waits for sglang-jax's scheduler module or has its
    ``Scheduler.__init__`` install the integration."""
    scheduler = getattr(sys.modules.get(SCHEDULER_MODULE), "Scheduler", None)
    wrapped = hasattr(getattr(scheduler, "__init__", None), _OWN_INIT)
    return _HOOK.waiting() or wrapped


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


_HOOK = ImportHook(SCHEDULER_MODULE, _install_first, logger)
