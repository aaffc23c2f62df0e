"""The tpu-inference integration's state in this process: its switch, its counters, its
once-per-process lines and its :class:`~portable_spec.integrations.face.Integration`.

A new switch is a variable here (``*_ENV_VAR``, documented beside it); a new counter a name in
:data:`COUNTERS` (documented beside it), counted with ``STATS.add(name)``.
"""

from __future__ import annotations

from portable_spec.integrations.face import Integration
from portable_spec.integrations.telemetry import LogOnce, Stats
from portable_spec.integrations.tpu_inference import internals

__all__ = ["COUNTERS", "ENV_VAR", "INTEGRATION", "LOG", "STATS"]

#: tpu-inference runs inside vLLM and takes vLLM's switch (vLLM's entry point installs both;
#: ``shadow`` leaves tpu-inference alone: its own rows are the misplaced ones)
ENV_VAR = "PORTABLE_SPEC_VLLM"

#: ``steps`` whose mask the integration prepared, ``rows`` (logits rows given a grammar row),
#: ``skipped_requests`` (structured requests that were not in the runner's batch: their rows
#: skipped, with a log line); no timings kept
COUNTERS = ("steps", "rows", "skipped_requests")
STATS = Stats(COUNTERS)
#: once per kind of event (until reset_stats())
LOG = LogOnce(internals.logger)

INTEGRATION = Integration(
    internals,
    table="portable_spec.integrations.tpu_inference.patches",
    modes=("on",),
    stats=STATS,
    log=LOG,
)
