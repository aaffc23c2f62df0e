"""The sglang plugin's state in this process: its switch, its counters, its once-per-process
lines and its :class:`~portable_spec.integrations.face.Integration` (the mode the
replacements read on every call).

A new switch is a variable here (``*_ENV_VAR``, documented beside it); a new counter a name in
:data:`COUNTERS` (documented beside it), counted with ``STATS.add(name)``.
"""

from __future__ import annotations

from portable_spec.integrations.face import Integration
from portable_spec.integrations.sglang import internals
from portable_spec.integrations.telemetry import LogOnce, Stats

__all__ = ["BUILDS", "COUNTERS", "ENV_VAR", "INTEGRATION", "LOG", "STATS"]

#: the plugin's switch: ``1``/``on``, ``shadow``, ``0``/``off``/unset (read by sglang's
#: ``sglang.srt.plugins`` entry point, :func:`portable_spec.integrations.sglang.register`)
ENV_VAR = "PORTABLE_SPEC_SGLANG"

#: ``steps`` (speculative builds with a grammar request), ``built`` (of them, built by the
#: library), ``whole_steps`` (built by sglang's own code), ``own_requests`` (requests sglang's
#: walk built inside a library step), ``refused_steps`` (steps whose first build the library
#: refused), ``repaired_rows`` (llguidance rows rebuilt by sglang's methods), ``rows_compared``
#: and ``rows_differing`` (shadow mode), ``fills`` and ``fills_built`` (plain fills of at
#: least ``plain.MIN_ROWS`` entries: all, and those through xgrammar's batched fill)
COUNTERS = (
    "steps",
    "built",
    "whole_steps",
    "own_requests",
    "refused_steps",
    "repaired_rows",
    "rows_compared",
    "rows_differing",
    "fills",
    "fills_built",
)
#: per-call times of the library's build and of sglang's own (shadow mode only), by batch
BUILDS = ("portable_spec", "sglang")
STATS = Stats(COUNTERS, builds=BUILDS)
#: a request or step left to sglang's own code says why, once per kind (until reset_stats())
LOG = LogOnce(internals.logger)

INTEGRATION = Integration(
    internals,
    table="portable_spec.integrations.sglang.patches",
    modes=("on", "shadow"),
    stats=STATS,
    log=LOG,
)
