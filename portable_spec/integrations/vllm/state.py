"""The vLLM plugin's state in this process: its switches, its counters, its once-per-process
lines and its :class:`~portable_spec.integrations.face.Integration` (the mode and release the
replacement reads on every call).

A new switch is a variable here (``*_ENV_VAR``, documented beside it); a new counter a name in
:data:`COUNTERS` (documented beside it), counted with ``STATS.add(name)``.
"""

from __future__ import annotations

import os

from portable_spec.integrations.face import Integration
from portable_spec.integrations.telemetry import LogOnce, Stats
from portable_spec.integrations.vllm import internals

__all__ = [
    "COUNTERS",
    "ENV_VAR",
    "INTEGRATION",
    "LOG",
    "LOG_EVERY_ENV_VAR",
    "STATS",
    "THREADS_ENV_VAR",
]

#: the plugin's switch: ``1``/``on``, ``shadow``, ``0``/``off``/unset (read by vLLM's entry point)
ENV_VAR = "PORTABLE_SPEC_VLLM"
#: log a summary line (median times, rows compared and differing) every this many calls
#: (default 1000; 0: never); read when the plugin is installed
LOG_EVERY_ENV_VAR = "PORTABLE_SPEC_VLLM_LOG_EVERY"
#: the library's thread count; where it is unset the plugin runs its builds on vLLM's
#: scheduler thread alone, as vLLM's own fill does
THREADS_ENV_VAR = "PORTABLE_SPEC_NUM_THREADS"

#: ``calls`` (``grammar_bitmask`` calls seen), ``built`` (steps the library built),
#: ``fallback_steps`` (steps given to vLLM's own fill), ``rows_compared`` and
#: ``rows_differing`` (shadow mode)
COUNTERS = ("calls", "built", "fallback_steps", "rows_compared", "rows_differing")
#: per-call times of the library's build and of vLLM's own fill (shadow mode only), by the
#: number of structured requests in the call
BUILDS = ("portable_spec", "vllm")
STATS = Stats(COUNTERS, builds=BUILDS)
#: a step left to vLLM says why, once per kind (until ``reset_stats()``)
LOG = LogOnce(internals.logger)


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
