"""The sglang plugin's state in this process: its switch, its counters, its once-per-process
lines and its :class:`~portable_spec.integrations.face.Integration` (the mode the
replacements read on every call).

A new switch is a variable here (``*_ENV_VAR``, documented beside it); a new counter a name in
:data:`COUNTERS` (documented beside it), counted with ``STATS.add(name)``.
"""

from __future__ import annotations

import importlib
import os

from portable_spec.integrations.face import Integration, read_mode
from portable_spec.integrations.sglang import internals
from portable_spec.integrations.telemetry import LogOnce, Stats

__all__ = [
    "BUILDS",
    "COUNTERS",
    "DRAFTING_ENV_VAR",
    "ENV_VAR",
    "INTEGRATION",
    "LOG",
    "STATS",
    "drafting_mode",
    "drafting_switch",
    "follow_drafting",
    "set_drafting_switch",
]

#: the plugin's switch: ``1``/``on``, ``shadow``, ``0``/``off``/unset (read by sglang's
#: ``sglang.srt.plugins`` entry point, :func:`portable_spec.integrations.sglang.register`)
ENV_VAR = "PORTABLE_SPEC_SGLANG"
#: grammar-aware drafting (:mod:`.drafting`), read when the plugin installs: unset, empty,
#: ``1``/``on`` (on wherever the plugin is), ``shadow`` (counting only: sglang's own drafts),
#: ``0``/``off`` (sglang's own draft code, its patches not installed)
DRAFTING_ENV_VAR = "PORTABLE_SPEC_SGLANG_DRAFTING"

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
    # grammar-aware drafting (.drafting): draft loops and NGRAM steps run in a session (of them,
    # in the last step's session restarted), the rows computed for the EAGLE head's logits,
    # verify masks gathered from a session (and trees found not to be the drafted one),
    # drafted verify nodes the grammar refuses; NGRAM slots given a forced token, and forced
    # tokens verify accepted
    "draft_steps",
    "draft_sessions_restarted",
    "draft_rows",
    "draft_verify_masks",
    "draft_mismatches",
    "refused_draft_nodes",
    "ngram_nodes_replaced",
    "forced_tokens_accepted",
)
#: per-call times of the library's build and of sglang's own (shadow mode only), by batch
BUILDS = ("portable_spec", "sglang")
STATS = Stats(COUNTERS, builds=BUILDS)
#: a request or step left to sglang's own code says why, once per kind (until reset_stats())
LOG = LogOnce(internals.logger)

#: the drafting switch (:data:`DRAFTING_ENV_VAR`): ``"on"``, ``"shadow"`` or ``"off"``; None
#: until the variable is read (at the first install) or ``set_drafting`` sets it
SWITCHES: dict[str, str | None] = {"drafting": None}


def drafting_switch() -> str:
    """The drafting switch: set by ``set_drafting``, else :data:`DRAFTING_ENV_VAR` read once
    (unset or empty: ``"on"``). Raises ValueError naming the variable for a value other than
    ``1``/``on``, ``shadow``, ``0``/``off``."""
    value = SWITCHES["drafting"]
    if value is None:
        raw = os.environ.get(DRAFTING_ENV_VAR, "").strip()
        value = read_mode(DRAFTING_ENV_VAR) if raw else "on"
        SWITCHES["drafting"] = value
    return value


def set_drafting_switch(value: str | None) -> None:
    """Set the drafting switch (``"on"``, ``"shadow"``, ``"off"``; None: read the variable
    again when next asked)."""
    if value not in ("on", "shadow", "off", None):
        raise ValueError(f"drafting must be 'on', 'shadow' or 'off', got {value!r}")
    SWITCHES["drafting"] = value


def drafting_mode() -> str:
    """The drafting mode in force: ``"off"``, ``"shadow"`` (the switch says so, or the plugin
    runs in shadow mode: shadow mode never changes what sglang does) or ``"on"``."""
    setting = drafting_switch()
    if setting == "off":
        return "off"
    if setting == "shadow" or INTEGRATION.mode == "shadow":
        return "shadow"
    return "on"


#: the drafting patch sets' module, imported (by name, as the table of patches is) at the first
#: install: it imports the replacements
_DRAFT_SETS = "portable_spec.integrations.sglang.draft_sets"


def follow_drafting() -> None:
    """The drafting patches as the switch now says, where the plugin is installed."""
    importlib.import_module(_DRAFT_SETS).follow_switch()


def _drafting_on_install(_revision: str) -> None:
    follow_drafting()


def _drafting_on_uninstall() -> None:
    importlib.import_module(_DRAFT_SETS).stop()


INTEGRATION = Integration(
    internals,
    table="portable_spec.integrations.sglang.patches",
    modes=("on", "shadow"),
    stats=STATS,
    log=LOG,
    on_install=_drafting_on_install,
    on_uninstall=_drafting_on_uninstall,
)
