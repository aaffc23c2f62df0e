"""vLLM plugin: vLLM's structured-output bitmask for speculative decoding, built by portable_spec.

Install ``portable-spec[vllm]`` next to vLLM and set ``PORTABLE_SPEC_VLLM``:

* unset, empty, ``0`` or ``off``: nothing changes (installing the package alone never changes
  vLLM's behaviour);
* ``1`` or ``on``: ``StructuredOutputManager.grammar_bitmask`` builds the speculative rows of
  every step with the library instead of vLLM's per-token loop;
* ``shadow``: both builds run on every step; vLLM's rows are the ones used, each row that
  differs is logged (``WARNING``), and both builds' per-call times are kept
  (:func:`integration_stats`);
* anything else: ValueError naming the variable, at vLLM's start.

vLLM loads the plugin in each of its processes through the ``vllm.general_plugins`` entry point
(:func:`portable_spec.integrations.entry_points.vllm_general_plugins`), so the replacement
reaches the EngineCore process, where the scheduler builds the mask.
``PORTABLE_SPEC_VLLM_LOG_EVERY`` (default 1000; 0 disables) logs a summary line (median times,
rows compared and differing) every that many calls. The build runs on the scheduler's thread,
as vLLM's own fill does (``PORTABLE_SPEC_NUM_THREADS`` gives it more threads).

The package, as every engine package of the library:

* ``internals.py``: the only file that names vLLM's internals: what is replaced and read, the
  table of known releases (version and source hash of each) and their row layouts, the
  version, accessors, the attribute names handed to the compiled step readers;
* ``patches.py``: what is replaced, target by target, and by what;
* ``state.py``: the switches, the counters, the once-per-process lines, the mode;
* ``rows.py``: vLLM's row rules (layouts, padding, reasoning, refused drafts, guidance's rule,
  the unwritten rows of the strided layout), which every path writes by;
* ``xgrammar.py``, ``guidance.py``: the common step of each backend in one compiled call;
* ``checked.py``: any other step, through the library's general build;
* ``bitmask.py``: the replacement method and its shadow mode;
* ``drafts.py``: forced drafts, the scheduler's drafts of each structured request extended by
  what its grammar forces (``PORTABLE_SPEC_FORCED_DRAFTS``: on by default, ``shadow``
  counts only, ``0`` leaves vLLM's drafts untouched; docs/vllm-forced-drafts.md).

A vLLM release whose source differs from every known one in anything the plugin replaces or
reads is not patched: one warning, then vLLM's own fill.
"""

from __future__ import annotations

from typing import Any

from portable_spec.integrations.vllm import internals
from portable_spec.integrations.vllm.state import (
    ENV_VAR,
    FORCED_ENV_VAR,
    INTEGRATION,
    LOG_EVERY_ENV_VAR,
    LOOKUP_ENV_VAR,
    THREADS_ENV_VAR,
    WRITINGS_ENV_VAR,
    read_switches,
)

__all__ = [
    "ENV_VAR",
    "FORCED_ENV_VAR",
    "LAYOUTS",
    "LOG_EVERY_ENV_VAR",
    "LOOKUP_ENV_VAR",
    "THREADS_ENV_VAR",
    "WRITINGS_ENV_VAR",
    "install",
    "integration_stats",
    "is_installed",
    "layout_for",
    "reset_stats",
    "uninstall",
]

#: the row layout of each vLLM release the plugin knows
LAYOUTS = internals.LAYOUTS


def install(mode: str = "on") -> bool:
    """Patch vLLM's ``StructuredOutputManager.grammar_bitmask`` and wrap its scheduler's
    drafts (forced drafts) in this process, in ``mode`` (``"on"`` or ``"shadow"``; switched at
    once when already installed). ``PORTABLE_SPEC_FORCED_DRAFTS`` and its two companions are
    read now (a value they do not take raises ValueError naming the variable, before anything
    is patched).

    With vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) this process is the
    engine's; otherwise the entry point installs it in vLLM's EngineCore process. Returns
    whether the patch is in place: False without vLLM or on a vLLM release the plugin does not
    know (one ``WARNING``; vLLM's own fill runs). Raises ValueError for another mode.
    Non-blocking; imports vLLM's structured-output modules. Unless
    ``PORTABLE_SPEC_NUM_THREADS`` is set, the library's builds then run on the calling thread
    alone, as vLLM's own fill does.
    """
    INTEGRATION.check_mode(mode)
    read_switches()
    return INTEGRATION.install(mode)


def uninstall() -> None:
    """Give vLLM its own ``grammar_bitmask`` back (in this process)."""
    INTEGRATION.uninstall()


def is_installed() -> bool:
    """Whether ``grammar_bitmask`` is the plugin's in this process."""
    return INTEGRATION.is_installed()


def integration_stats() -> dict[str, Any]:
    """A snapshot of this process's counters (the EngineCore's, where the plugin runs).

    Returns a dict: ``calls`` (``grammar_bitmask`` calls seen), ``built`` (steps the library
    built), ``fallback_steps`` (steps given to vLLM's own fill), ``rows_compared`` and
    ``rows_differing`` (shadow mode), ``median_us`` and ``samples``: ``{build: {batch: median
    µs or count}}`` for ``build`` in ``"portable_spec"`` and ``"vllm"`` (vLLM's own fill:
    shadow mode only), ``batch`` being the number of structured requests in the call (the last
    4096 calls per batch size). Forced drafts: ``forced_steps`` (steps that extended some
    request's drafts), ``forced_drafted`` (forced tokens scheduled beyond vLLM's drafts),
    ``forced_accepted`` (of those, accepted by the model), ``forced_would_draft`` (shadow
    mode: counted, not scheduled), ``forced_refused_steps``, and the extension's per-step time
    under ``median_us["forced_drafts"]`` (by requests extended). Never blocks on the engine.
    """
    return INTEGRATION.integration_stats()


def reset_stats() -> None:
    """Forget every counter and timing of this process; the once-per-process lines, and the
    warning about a vLLM release the plugin does not know, may be logged again."""
    INTEGRATION.reset_stats()


def layout_for(version: str) -> str | None:
    """The row layout of a vLLM version string (``"0.32.0"`` -> ``"packed"``), or None."""
    return LAYOUTS.get(".".join(version.split(".")[:2]))
