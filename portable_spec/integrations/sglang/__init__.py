"""sglang plugin: sglang's grammar masks, speculative and plain, built by portable_spec.

Install the library next to sglang and set ``PORTABLE_SPEC_SGLANG`` in the environment of
the launch:

* unset, empty, ``0`` or ``off``: nothing is registered and no sglang module is imported
  (installing the package alone never changes sglang's behaviour);
* ``1`` or ``on``: the speculative workers' ``build_grammar_vocab_mask`` (EAGLE v2,
  standalone, frozen-KV MTP, multi-layer EAGLE, UNO, NGRAM, DFlash, DSpark) and the plain
  ``fill_vocab_mask_batched`` are the library's;
* ``shadow``: both builds run; sglang's rows are used, the library's compared with them, each
  differing row logged (``WARNING``) and counted (:func:`integration_stats`);
* anything else: ValueError naming the variable, at sglang's start.

sglang runs the functions of its ``sglang.srt.plugins`` entry points in each process it starts
(:func:`register` is this package's); the plugin patches the process that imports sglang's
speculative utilities (the scheduler), when it does. One ``INFO`` line says it is on. An
sglang release the plugin does not know (its version, or the source of anything it replaces
or reads, differs from every release in :mod:`.internals`) is not patched: one ``WARNING``,
then sglang's own code. For a process you control, :func:`install` and :func:`uninstall`.

The package, as every engine package of the library:

* ``internals.py``: the only file that names sglang's internals: what is replaced and read,
  the table of known releases (version and source hash of each), the version, accessors;
* ``patches.py``: what is replaced, target by target, and by what;
* ``state.py``: the switch, the counters, the once-per-process lines, the mode;
* ``grammars.py``: what the library is handed for each request, by sglang's grammar rules;
* ``masks.py``: the speculative build and its shadow mode;
* ``guidance.py``: the llguidance rows sglang builds otherwise, rebuilt by its own methods;
* ``plain.py``: the plain batch fill;
* ``drafting.py``: the verify mask of a drafted step; ``draft_sets.py``: the drafting patch
  sets (``PORTABLE_SPEC_SGLANG_DRAFTING``), installed when their worker module is imported;
  ``eagle_draft.py``: the EAGLE v2 draft loop in a ``DraftSession``; ``ngram.py``: the NGRAM
  worker's trees, the slots the grammar refuses given its forced continuation.
"""

from __future__ import annotations

from typing import Any

from portable_spec.integrations.face import read_mode
from portable_spec.integrations.sglang import internals
from portable_spec.integrations.sglang.state import (
    DRAFTING_ENV_VAR,
    ENV_VAR,
    INTEGRATION,
    drafting_switch,
    follow_drafting,
    set_drafting_switch,
)

__all__ = [
    "DRAFTING_ENV_VAR",
    "ENV_VAR",
    "install",
    "integration_stats",
    "is_installed",
    "register",
    "reset_stats",
    "set_drafting",
    "uninstall",
]


def register() -> None:
    """sglang's ``sglang.srt.plugins`` entry point: reads ``PORTABLE_SPEC_SGLANG`` and, unless
    it is off, installs the plugin in this process as soon as sglang's speculative utilities
    are imported (at once if they are). Raises ValueError naming the variable for a value
    other than ``1``/``on``, ``shadow``, ``0``/``off`` or unset. Idempotent."""
    mode = read_mode(ENV_VAR)
    if mode != "off":
        INTEGRATION.install_on_import(internals.TRIGGER, mode)


def install(mode: str = "on") -> bool:
    """Patch sglang in this process, in ``mode`` (``"on"`` or ``"shadow"``; switched at once
    when already installed). Returns whether the plugin is in place: False without sglang or
    on a release it does not know (one ``WARNING``; sglang's own code runs). Raises ValueError
    for another mode, or a ``PORTABLE_SPEC_SGLANG_DRAFTING`` it does not read (before anything
    is patched). Imports sglang's speculative and grammar modules; never blocks."""
    drafting_switch()
    return INTEGRATION.install(mode)


def uninstall() -> None:
    """Give sglang its own functions back in this process (every worker module that bound the
    mask build included), and stop waiting for its import."""
    INTEGRATION.uninstall()


def is_installed() -> bool:
    """Whether sglang's functions are the plugin's in this process."""
    return INTEGRATION.is_installed()


def integration_stats() -> dict[str, Any]:
    """A snapshot of this process's counters (the scheduler's, where the plugin runs).

    Returns a dict: ``steps`` (speculative builds with a grammar request), ``built`` (of them,
    built by the library), ``whole_steps`` (built by sglang's own code), ``own_requests``
    (requests sglang's walk built inside a library step), ``refused_steps``, ``repaired_rows``
    (llguidance rows rebuilt by sglang's methods), ``rows_compared`` and ``rows_differing``
    (shadow mode), ``fills`` and ``fills_built`` (plain fills of at least ``plain.MIN_ROWS``
    entries: all, and those through xgrammar's batched fill), and ``median_us`` /
    ``samples``: ``{build: {batch: median µs or count}}`` for the builds ``portable_spec`` and
    ``sglang`` (shadow mode). Never blocks.
    """
    return INTEGRATION.integration_stats()


def set_drafting(mode: str | bool) -> None:
    """Grammar-aware drafting (``PORTABLE_SPEC_SGLANG_DRAFTING``, read at the first
    :func:`install`): ``True``/``"on"`` (the default: the drafts of grammar requests are tokens
    their grammar allows, or its forced continuation), ``"shadow"`` (sglang's own drafts, the
    plugin's counted beside them) or ``False``/``"off"`` (sglang's own draft code). Takes
    effect at once where the plugin is installed."""
    set_drafting_switch({True: "on", False: "off"}.get(mode, mode))  # type: ignore[call-overload]
    if INTEGRATION.is_installed():
        follow_drafting()


def reset_stats() -> None:
    """Forget every counter and timing of this process; the once-per-process lines, and the
    warning about an sglang release the plugin does not know, may be logged again."""
    INTEGRATION.reset_stats()
