"""The sglang-jax integration's state in this process: its switches, its logger and its
counters (one :class:`~portable_spec.integrations.patching.Stats` for the mask patches and
the fixes alike)."""

from __future__ import annotations

import logging
import os

from portable_spec.integrations.patching import Stats, read_mode

__all__ = ["DRAFTING_ENV_VAR", "ENV_VAR", "STATS", "SWITCHES", "TIMING_ENV_VAR", "logger"]

ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX"
TIMING_ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX_TIMING"
DRAFTING_ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX_DRAFTING"

#: sglang-jax's child logger: the lines land in the scheduler's log.
logger = logging.getLogger("sgl_jax.portable_spec")

#: ``verify_steps`` (patched verifies run), ``grammar_steps`` (those with a grammar request),
#: ``masked_steps`` and ``masked_rows`` (steps and mask rows built, the overlap schedule's
#: fused steps included), ``refused_requests`` (requests left unmasked for a step),
#: ``grammar_ends`` (requests whose grammar ended inside a step's accepted path),
#: ``accepted_tokens`` and ``constrained_verifies`` (the tokens sglang-jax commits per request
#: with an active grammar and step, bonus included, none past a grammar's end; both
#: schedules), ``fused_steps`` (fused verify steps with a grammar request).
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
