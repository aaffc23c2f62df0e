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

The package, a file per job:

* ``internals.py``: the only file that names sglang's internals: what is replaced and read,
  the table of known releases (version and source hash of each), accessors;
* ``grammars.py``: what the library is handed for each request, by sglang's grammar rules;
* ``masks.py``: the speculative build, its shadow mode, the counters;
* ``guidance.py``: the llguidance rows sglang builds otherwise, rebuilt by its own methods;
* ``plain.py``: the plain batch fill;
* ``drafting.py``: grammar-aware drafting's switch (``PORTABLE_SPEC_SGLANG_DRAFTING``) and the
  verify mask of a drafted step; ``eagle_draft.py``: the EAGLE v2 draft loop in a
  ``DraftSession``; ``ngram.py``: the NGRAM worker's trees, refused nodes replaced by the
  grammar's forced continuation.
"""

from __future__ import annotations

from typing import Any

from portable_spec.integrations.patching import ImportHook, PatchSet, read_mode
from portable_spec.integrations.sglang import drafting, internals

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

ENV_VAR = "PORTABLE_SPEC_SGLANG"
#: the module whose import (in the scheduler's process) installs the plugin
_TRIGGER = "sglang.srt.speculative.spec_utils"

DRAFTING_ENV_VAR = drafting.DRAFTING_ENV_VAR

_state: dict[str, Any] = {"patches": None, "hook": None, "drafting": None}


def _patches() -> PatchSet:
    patches = _state["patches"]
    if patches is None:
        from portable_spec.integrations.sglang.masks import build_replacement, chain_replacement
        from portable_spec.integrations.sglang.plain import fill_replacement

        patches = internals.patch_set(build_replacement, chain_replacement, fill_replacement)
        _state["patches"] = patches
    return patches


def _draft_makers() -> dict[str, Any]:
    from portable_spec.integrations.sglang import eagle_draft, ngram

    return {
        internals.NGRAM_PREPARE: ngram.wrap_prepare,
        internals.NGRAM_STEP: ngram.wrap_step,
        internals.EAGLE_STEP: eagle_draft.wrap_forward_batch_generation,
        internals.EAGLE_DRAFT: eagle_draft.wrap_draft,
        internals.EAGLE_DRAFT_FORWARD: eagle_draft.wrap_draft_forward,
        internals.EAGLE_SELECT: eagle_draft.wrap_select,
        internals.EAGLE_EXTEND_DECODE: eagle_draft.wrap_extend,
        internals.EAGLE_EXTEND_PREFILL: eagle_draft.wrap_extend,
        internals.EAGLE_ORGANIZE: eagle_draft.wrap_organize,
        internals.EAGLE_DRAFT_GRAPH: eagle_draft.wrap_can_run_graph,
    }


def _draft_sets() -> dict[str, tuple[PatchSet, drafting.WhenImported]]:
    """The drafting patch sets, each with what installs it when its worker module is
    imported (the plugin never imports a speculative worker module itself)."""
    sets = _state["drafting"]
    if sets is None:
        makers = _draft_makers()
        sets = {}
        for name in internals.DRAFT_SETS:
            patches = internals.draft_patch_set(name, makers)
            waiter = drafting.WhenImported(
                internals.draft_module(name),
                lambda _module, patches=patches: _install_drafting(patches),
            )
            sets[name] = (patches, waiter)
        _state["drafting"] = sets
    return sets


def _install_drafting(patches: PatchSet) -> None:
    if is_installed() and drafting.mode() != "off":
        patches.install()


def _set_draft_patches(on: bool) -> None:
    """The drafting patches in place (``on``: now where their worker module is imported,
    else when it is) or sglang's own draft code back."""
    if on:
        for _, waiter in _draft_sets().values():
            waiter.activate()
        return
    if _state["drafting"] is None:
        return
    for patches, waiter in _state["drafting"].values():
        waiter.deactivate()
        patches.uninstall()
    drafting.clear()
    from portable_spec.integrations.sglang import eagle_draft, ngram

    eagle_draft.forget_roots()
    ngram.forget()


def register() -> None:
    """sglang's ``sglang.srt.plugins`` entry point: reads ``PORTABLE_SPEC_SGLANG`` and, unless
    it is off, installs the plugin in this process as soon as sglang's speculative utilities
    are imported (at once if they are). Raises ValueError naming the variable for a value
    other than ``1``/``on``, ``shadow``, ``0``/``off`` or unset. Idempotent."""
    mode = read_mode(ENV_VAR)
    if mode == "off" or _state["hook"] is not None:
        return
    hook = ImportHook(_TRIGGER, lambda _module: install(mode), internals.logger)
    _state["hook"] = hook
    hook.activate()


def install(mode: str = "on") -> bool:
    """Patch sglang in this process, in ``mode`` (``"on"`` or ``"shadow"``; switched at once
    when already installed). Returns whether the plugin is in place: False without sglang or
    on a release it does not know (one ``WARNING``; sglang's own code runs). Raises ValueError
    for another mode. Imports sglang's speculative and grammar modules; never blocks."""
    if mode not in ("on", "shadow"):
        raise ValueError(f"mode must be 'on' or 'shadow', got {mode!r}")
    from portable_spec.integrations.sglang.masks import Active

    drafting.switch()  # a bad PORTABLE_SPEC_SGLANG_DRAFTING raises before anything is patched
    Active.mode = mode
    drafting.set_plugin_mode(mode)
    if not _patches().install():
        return False
    _set_draft_patches(drafting.mode() != "off")
    return True


def uninstall() -> None:
    """Give sglang its own functions back in this process (every worker module that bound the
    mask build included), and stop waiting for its import."""
    hook = _state["hook"]
    if hook is not None:
        hook.deactivate()
        _state["hook"] = None
    _set_draft_patches(False)
    if _state["patches"] is not None:
        _state["patches"].uninstall()


def set_drafting(mode: str | bool) -> None:
    """Grammar-aware drafting (``PORTABLE_SPEC_SGLANG_DRAFTING``, read at :func:`install`):
    ``True``/``"on"`` (the default: the drafts of grammar requests are tokens their grammar
    allows, or its forced continuation), ``"shadow"`` (sglang's own drafts, the plugin's
    counted beside them) or ``False``/``"off"`` (sglang's own draft code). Takes effect at once
    where the plugin is installed."""
    drafting.set_mode({True: "on", False: "off"}.get(mode, mode))  # type: ignore[call-overload]
    if is_installed():
        _set_draft_patches(drafting.mode() != "off")


def is_installed() -> bool:
    """Whether sglang's functions are the plugin's in this process."""
    return _state["patches"] is not None and _state["patches"].is_installed()


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
    from portable_spec.integrations.sglang.masks import STATS

    return STATS.snapshot()


def reset_stats() -> None:
    """Forget every counter and timing of this process; the once-per-process warnings may be
    logged again."""
    from portable_spec.integrations.sglang.grammars import reset_warnings
    from portable_spec.integrations.sglang.masks import STATS

    STATS.reset()
    reset_warnings()
