"""The sglang-jax integration's state in this process: its switches, its counters (one
:class:`~portable_spec.integrations.telemetry.Stats` for the mask patches and the fixes alike),
its once-per-process lines and its :class:`~portable_spec.integrations.face.Integration`.

A new switch is a variable here (``*_ENV_VAR``, documented beside it) and, when the patches
read it on every call, an entry of :data:`SWITCHES` (read from the environment at import, set
by a ``set_*`` function of the package); a new counter a name in :data:`COUNTERS` (documented
beside it), counted with ``STATS.add(name)``.
"""

from __future__ import annotations

import os

from portable_spec.integrations.face import Integration, read_mode
from portable_spec.integrations.sglang_jax import internals
from portable_spec.integrations.telemetry import LogOnce, Stats

__all__ = [
    "COUNTERS",
    "DRAFTING_ENV_VAR",
    "ENV_VAR",
    "INTEGRATION",
    "LOG",
    "SERIES",
    "STATS",
    "SWITCHES",
    "TIMING_ENV_VAR",
]

#: the integration's switch in an sglang-jax launch: ``1``/``on``, ``0``/``off``/unset (no
#: shadow mode: sglang-jax's verify has no mask of its own to compare with); :mod:`.hook`
ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX"
#: ``1``: each masked step also measures the mask time the target forward did not hide
TIMING_ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX_TIMING"
#: ``0``: sglang-jax's own EAGLE drafts (unset or ``1``: drafts masked by the grammar)
DRAFTING_ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX_DRAFTING"

#: ``verify_steps`` (patched verifies run), ``grammar_steps`` (those with a grammar request),
#: ``masked_steps`` and ``masked_rows`` (steps and mask rows built, the overlap schedule's
#: fused steps included), ``refused_requests`` (requests left unmasked for a step),
#: ``grammar_ends`` (requests whose grammar ended inside a step's accepted path),
#: ``accepted_tokens`` and ``constrained_verifies`` (tokens committed per constrained request
#: and step, bonus included), ``fused_steps`` (fused verify steps with a grammar request).
COUNTERS = (
    "verify_steps",
    "grammar_steps",
    "masked_steps",
    "masked_rows",
    "refused_requests",
    "grammar_ends",
    "accepted_tokens",
    "constrained_verifies",
    "fused_steps",
)
#: Seconds, per masked step: ``waited_s`` (how long ``sample`` waited for the build),
#: ``exposed_s`` and ``step_s`` (timing mode only: mask time the target forward did not hide,
#: and the step's ``verify`` time), ``fused_build_s`` (a fused step's staging and build).
SERIES = ("waited_s", "exposed_s", "step_s", "fused_build_s")

STATS = Stats(COUNTERS, SERIES)
#: a step left to sglang-jax's own code says why, once per kind (until reset_stats())
LOG = LogOnce(internals.logger)


def _drafting_default() -> bool:
    if not os.environ.get(DRAFTING_ENV_VAR, "").strip():
        return True  # unset: masked drafts
    return read_mode(DRAFTING_ENV_VAR, shadow=False) == "on"


#: ``timing``: each masked step also measures its exposed mask time; ``drafting``: the EAGLE
#: draft loop's logits are masked too. Read from the environment when the integration is
#: imported (``1``/``on``, ``0``/``off``; anything else raises ValueError naming the variable).
SWITCHES = {
    "timing": read_mode(TIMING_ENV_VAR, shadow=False) == "on",
    "drafting": _drafting_default(),
}

INTEGRATION = Integration(
    internals,
    table="portable_spec.integrations.sglang_jax.patches",
    modes=("on",),
    stats=STATS,
    log=LOG,
)
