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

The package, a file per job:

* ``internals.py``: the only file that names vLLM's internals: what is replaced and read, the
  table of known releases (version and source hash of each), accessors, the attribute names
  handed to the compiled step readers;
* ``rows.py``: vLLM's row rules (layouts, padding, reasoning, refused drafts, guidance's rule,
  the unwritten rows of the strided layout), which every path writes by;
* ``xgrammar.py``, ``guidance.py``: the common step of each backend in one compiled call;
* ``checked.py``: any other step, through the library's general build;
* ``bitmask.py``: the replacement method, shadow mode, the counters;
* ``drafts.py``: forced drafts (the scheduler's drafts extended by what the grammar forces;
  ``PORTABLE_SPEC_FORCED_DRAFTS=0`` turns them off).

A vLLM release whose source differs from every known one in anything the plugin replaces or
reads is not patched: one warning, then vLLM's own fill.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from portable_spec.integrations.vllm import drafts, internals
from portable_spec.integrations.vllm.bitmask import (
    LOG_EVERY_ENV_VAR,
    STATS,
    Active,
    replacement,
    reset_warnings,
)

__all__ = [
    "ENV_VAR",
    "LAYOUTS",
    "LOG_EVERY_ENV_VAR",
    "install",
    "integration_stats",
    "is_installed",
    "layout_for",
    "reset_stats",
    "uninstall",
]

ENV_VAR = "PORTABLE_SPEC_VLLM"
FORCED_ENV_VAR = drafts.ENV_VAR
#: the forced drafts' counters in :func:`integration_stats`
FORCED_COUNTERS = (
    "forced_steps",
    "forced_drafted",
    "forced_accepted",
    "forced_would_draft",
    "forced_refused_steps",
)
THREADS_ENV_VAR = "PORTABLE_SPEC_NUM_THREADS"  # the library's; the plugin's default is 1
#: the row layout of each vLLM release the plugin knows
LAYOUTS = internals.LAYOUTS

_patches = internals.patch_set(replacement)


def install(mode: str = "on") -> bool:
    """Patch vLLM's ``StructuredOutputManager.grammar_bitmask`` in this process, in ``mode``
    (``"on"`` or ``"shadow"``; switched at once when already installed).

    With vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) this process is the
    engine's; otherwise the entry point installs it in vLLM's EngineCore process. Returns
    whether the patch is in place: False without vLLM or on a vLLM release the plugin does not
    know (one ``WARNING``; vLLM's own fill runs). Raises ValueError for another mode.
    Non-blocking; imports vLLM's structured-output modules.
    """
    if mode not in ("on", "shadow"):
        raise ValueError(f"mode must be 'on' or 'shadow', got {mode!r}")
    Active.mode = mode
    if not _patches.install():
        return False
    if drafts.enabled():
        drafts.install(mode)
    else:
        drafts.uninstall()
    if Active.layout is None:
        Active.layout = LAYOUTS[_patches.revision or ""]
        if THREADS_ENV_VAR not in os.environ:
            import portable_spec as ps

            # vLLM's own fill is serial on the scheduler's thread; worker threads would
            # compete with the engine's own (its CPU backend keeps its cores busy).
            ps.set_num_threads(1)
    return True


def uninstall() -> None:
    """Give vLLM its own ``grammar_bitmask`` back (in this process)."""
    Active.layout = None
    drafts.uninstall()
    _patches.uninstall()


def is_installed() -> bool:
    """Whether ``grammar_bitmask`` is the plugin's in this process."""
    return _patches.is_installed()


def integration_stats() -> dict[str, Any]:
    """A snapshot of this process's counters (the EngineCore's, where the plugin runs).

    Returns a dict: ``calls`` (``grammar_bitmask`` calls seen), ``built`` (steps the library
    built), ``fallback_steps`` (steps given to vLLM's own fill), ``rows_compared`` and
    ``rows_differing`` (shadow mode), ``median_us`` and ``samples``: ``{build: {batch: median
    µs or count}}`` for ``build`` in ``"portable_spec"`` and ``"vllm"`` (vLLM's own fill:
    shadow mode only), ``batch`` being the number of structured requests in the call (the last
    4096 calls per batch size). Forced drafts (:mod:`.drafts`): ``forced_steps``,
    ``forced_drafted`` (forced tokens scheduled), ``forced_accepted`` (of those, accepted by
    the model), ``forced_would_draft`` (shadow mode), ``forced_refused_steps``, and their
    per-call times under ``median_us["forced_drafts"]`` (by requests extended). Never blocks
    on the engine.
    """
    snap = STATS.snapshot()
    forced = drafts.STATS.snapshot()
    snap.update({name: forced[name] for name in FORCED_COUNTERS})
    snap["median_us"]["forced_drafts"] = forced["median_us"]["forced_drafts"]
    snap["samples"]["forced_drafts"] = forced["samples"]["forced_drafts"]
    return snap


def reset_stats() -> None:
    """Forget every counter and timing of this process; the once-per-process warnings may be
    logged again."""
    STATS.reset()
    drafts.reset()
    reset_warnings()
    _patches.reset_warning()


def layout_for(version: str) -> str | None:
    """The row layout of a vLLM version string (``"0.32.0"`` -> ``"packed"``), or None."""
    return LAYOUTS.get(".".join(version.split(".")[:2]))


# -- deprecated names -------------------------------------------------------------------------


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def set_mode(mode: str) -> bool:
    """Deprecated: :func:`install` (``"on"``, ``"shadow"``) or :func:`uninstall` (``"off"``)."""
    _deprecated("set_mode", "install(mode) or uninstall()")
    if mode == "off":
        uninstall()
        return False
    return install(mode)


def plugin_stats() -> dict[str, Any]:
    """Deprecated: :func:`integration_stats`."""
    _deprecated("plugin_stats", "integration_stats")
    return integration_stats()


def reset_plugin_stats() -> None:
    """Deprecated: :func:`reset_stats`."""
    _deprecated("reset_plugin_stats", "reset_stats")
    reset_stats()
