"""The vLLM plugin's state in this process: its switches, its counters, its once-per-process
lines and its :class:`~portable_spec.integrations.face.Integration` (the mode and release the
replacement reads on every call).

A new switch is a variable here (``*_ENV_VAR``, documented beside it); a new counter a name in
:data:`COUNTERS` (documented beside it), counted with ``STATS.add(name)``.
"""

from __future__ import annotations

import os

from portable_spec.integrations.face import Integration, read_mode
from portable_spec.integrations.telemetry import LogOnce, Stats
from portable_spec.integrations.vllm import internals

__all__ = [
    "BUILDS",
    "COUNTERS",
    "ENV_VAR",
    "FORCED_ENV_VAR",
    "INTEGRATION",
    "LOG",
    "LOG_EVERY_ENV_VAR",
    "LOOKUP_ENV_VAR",
    "STATS",
    "SWITCHES",
    "THREADS_ENV_VAR",
    "WRITINGS_ENV_VAR",
    "forced_mode",
    "read_switches",
]

#: the plugin's switch: ``1``/``on``, ``shadow``, ``0``/``off``/unset (read by vLLM's entry point)
ENV_VAR = "PORTABLE_SPEC_VLLM"
#: log a summary line (median times, rows compared and differing) every this many calls
#: (default 1000; 0: never); read when the plugin is installed
LOG_EVERY_ENV_VAR = "PORTABLE_SPEC_VLLM_LOG_EVERY"
#: the library's thread count; where it is unset the plugin runs its builds on vLLM's
#: scheduler thread alone, as vLLM's own fill does
THREADS_ENV_VAR = "PORTABLE_SPEC_NUM_THREADS"

#: forced drafts (:mod:`.drafts`): unset, empty, ``1``/``on``: on wherever the plugin is;
#: ``shadow``: counted, never scheduled (also in the plugin's shadow mode); ``0``/``off``:
#: vLLM's drafts untouched (the plugin still builds the masks). Read at each install
FORCED_ENV_VAR = "PORTABLE_SPEC_FORCED_DRAFTS"
#: forced drafts' two additions, for measuring what each adds (``0``/``off`` leaves it out,
#: unset or ``1``/``on`` keeps it): what the model wrote at a forced text before, and the
#: lookup after the forced tokens. Read at each install
WRITINGS_ENV_VAR = "PORTABLE_SPEC_FORCED_WRITINGS"
LOOKUP_ENV_VAR = "PORTABLE_SPEC_FORCED_LOOKUP"

#: ``calls`` (``grammar_bitmask`` calls seen), ``built`` (steps the library built),
#: ``fallback_steps`` (steps given to vLLM's own fill), ``rows_compared`` and
#: ``rows_differing`` (shadow mode); forced drafts: ``forced_steps`` (steps that extended some
#: request's drafts), ``forced_drafted`` (forced tokens scheduled beyond vLLM's drafts),
#: ``forced_accepted`` (of those, accepted by the model), ``forced_would_draft`` (shadow:
#: counted, not scheduled), ``forced_refused_steps`` (steps the library refused: vLLM's drafts)
COUNTERS = (
    "calls",
    "built",
    "fallback_steps",
    "rows_compared",
    "rows_differing",
    "forced_steps",
    "forced_drafted",
    "forced_accepted",
    "forced_would_draft",
    "forced_refused_steps",
)
#: per-call times of the library's build, of vLLM's own fill (shadow mode only) and of the
#: forced drafts' extension of a step, by the number of structured requests in the call
#: (extended requests for ``forced_drafts``)
BUILDS = ("portable_spec", "vllm", "forced_drafts")
STATS = Stats(COUNTERS, builds=BUILDS)
#: a step left to vLLM says why, once per kind (until ``reset_stats()``)
LOG = LogOnce(internals.logger)


#: the switches the replacements read on every call, as :func:`read_switches` last read them:
#: ``"forced"`` (``"on"``, ``"shadow"``, ``"off"``), ``"writings"`` and ``"lookup"`` (``"on"``,
#: ``"off"``)
SWITCHES: dict[str, str] = {"forced": "on", "writings": "on", "lookup": "on"}


def _switch(env_var: str, *, shadow: bool) -> str:
    raw = os.environ.get(env_var, "").strip()
    return read_mode(env_var, shadow=shadow) if raw else "on"


def read_switches() -> None:
    """Read :data:`FORCED_ENV_VAR`, :data:`WRITINGS_ENV_VAR` and :data:`LOOKUP_ENV_VAR` into
    :data:`SWITCHES` (unset or empty: on). Raises ValueError naming the variable for a value
    other than ``1``/``on``, ``0``/``off`` (and ``shadow`` for the first), changing nothing."""
    read = {
        "forced": _switch(FORCED_ENV_VAR, shadow=True),
        "writings": _switch(WRITINGS_ENV_VAR, shadow=False),
        "lookup": _switch(LOOKUP_ENV_VAR, shadow=False),
    }
    SWITCHES.update(read)


def forced_mode() -> str:
    """The forced drafts' mode in force: ``"off"``, ``"shadow"`` (the switch says so, or the
    plugin runs in shadow mode: shadow mode never changes what vLLM does) or ``"on"``."""
    setting = SWITCHES["forced"]
    if setting == "off":
        return "off"
    if setting == "shadow" or INTEGRATION.mode == "shadow":
        return "shadow"
    return "on"


def _installed(revision: str) -> None:
    if THREADS_ENV_VAR not in os.environ:
        import portable_spec as ps

        # vLLM's own fill is serial on the scheduler's thread; worker threads would compete
        # with the engine's own (its CPU backend keeps its cores busy).
        ps.set_num_threads(1)


INTEGRATION = Integration(
    internals,
    table="portable_spec.integrations.vllm.patches",
    modes=("on", "shadow"),
    stats=STATS,
    log=LOG,
    on_install=_installed,
)
