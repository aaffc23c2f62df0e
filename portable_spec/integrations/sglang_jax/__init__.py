"""sglang-jax integration: grammar masks on its speculative verify (EAGLE, EAGLE3, NEXTN; trees
and chains), built by portable_spec while the target forward runs.

Off by default. Two ways to switch it on:

* :func:`install` patches sglang-jax in the calling process (tests, an engine run in-process);
* ``PORTABLE_SPEC_SGLANG_JAX=1`` in the environment of an sglang-jax launch, with the library
  installed in sglang-jax's environment: the ``portable_spec_sglang_jax.pth`` file the library
  ships installs the patches in whichever process sglang-jax creates its scheduler
  (:mod:`.hook`).

The package, by job:

* :mod:`.revisions`: the functions patched and their source at each sglang-jax revision known
  (any other source: one warning line, nothing patched);
* :mod:`.verify` and :mod:`.masks`: the verify mask, staged before the target forward and
  applied to the verify logits;
* :mod:`.draft`: grammar-aware EAGLE drafting through a :class:`portable_spec.DraftSession`;
* :mod:`.fused`: the overlap schedule's fused verify, the mask an input of the jitted step;
* :mod:`.fixes` (with :mod:`.grammar`): sglang-jax's own bugs on this path, one patch per
  entry of ``docs/sglang-jax-upstream.md``, each dropped when sglang-jax fixes it;
* :mod:`.state`: the switches, the logger, the counters; :mod:`.hook`: the process switch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

from portable_spec.integrations.patching import Patch, PatchSet
from portable_spec.integrations.sglang_jax import draft, fused, revisions, verify
from portable_spec.integrations.sglang_jax.fixes import FIXES
from portable_spec.integrations.sglang_jax.revisions import REVISIONS
from portable_spec.integrations.sglang_jax.state import (
    DRAFTING_ENV_VAR,
    ENV_VAR,
    STATS,
    SWITCHES,
    TIMING_ENV_VAR,
    logger,
)

__all__ = [
    "DRAFTING_ENV_VAR",
    "ENV_VAR",
    "MASKS",
    "PATCHES",
    "REVISIONS",
    "TIMING_ENV_VAR",
    "install",
    "integration_stats",
    "is_installed",
    "reset_stats",
    "set_drafting",
    "set_timing",
    "uninstall",
]


def _drafting() -> bool:
    return SWITCHES["drafting"]


#: The mask work: what the library adds to sglang-jax.
MASKS: tuple[Patch, ...] = (
    Patch(revisions.VERIFY, verify.wrap_verify),
    Patch(revisions.SAMPLE, verify.wrap_sample),
    Patch(revisions.RESOLVE, verify.wrap_resolve),
    Patch(revisions.TOPK, draft.wrap_topk),
    Patch(revisions.SELECT, draft.wrap_select),
    Patch(revisions.DRAFT, lambda own: draft.wrap_draft_forward(own, _drafting)),
    Patch(revisions.EXTEND_DECODE, lambda own: draft.wrap_extend(own, "draft_extend_for_decode")),
    Patch(revisions.EXTEND_PREFILL, lambda own: draft.wrap_extend(own, "draft_extend_for_prefill")),
    Patch(revisions.BUILD_VERIFY, fused.fused_verify_builder),
    Patch(revisions.FUSED_VERIFY, fused.spec_decode_verify),
    Patch(revisions.LOGITS, fused.logits_processor),
)

#: Everything the integration patches: sglang-jax's fixes first, so that on a function both
#: patch (``EagleVerifyInput.sample``) the mask work wraps the fixed function.
PATCHES: tuple[Patch, ...] = (*FIXES, *MASKS)


def _version() -> str | None:
    """sglang-jax's reported version, ``None`` when it is not installed."""
    if importlib.util.find_spec("sgl_jax") is None:
        return None
    try:
        return importlib.metadata.version("sglang-jax")
    except importlib.metadata.PackageNotFoundError:  # importable from a source tree
        return ""


_PATCH_SET = PatchSet(
    "sglang-jax", patches=PATCHES, revisions=REVISIONS, version=_version, logger=logger
)


def install(mode: str = "on") -> bool:
    """Patch sglang-jax in this process (idempotent, thread-safe). Returns whether the patches
    are in place: ``False`` (one warning line; sglang-jax's own code keeps running) for an
    sglang-jax whose patched functions the integration does not know, ``False`` without a
    word when sglang-jax is not installed. ``mode`` is ``"on"``: sglang-jax's verify has no
    result of its own to compare with (no shadow mode); anything else raises ValueError."""
    if mode != "on":
        raise ValueError(f"sglang-jax integration mode {mode!r}: only 'on' (no shadow mode)")
    return _PATCH_SET.install()


def uninstall() -> None:
    """Put sglang-jax's own functions back (this process)."""
    _PATCH_SET.uninstall()


def is_installed() -> bool:
    """Whether the patches are in place in this process."""
    return _PATCH_SET.is_installed()


def integration_stats() -> dict[str, Any]:
    """A snapshot of this process's counters and series (:data:`.state.COUNTERS`,
    :data:`.state.SERIES`) in the shape of every integration's stats. Never blocks on the
    device."""
    return STATS.snapshot()


def reset_stats() -> None:
    """Forget this process's counters and timings; the warning for an sglang-jax the
    integration does not know may be logged again."""
    STATS.reset()
    _PATCH_SET.reset_warning()


def set_drafting(on: bool) -> None:
    """Grammar-aware drafting on (the default; ``PORTABLE_SPEC_SGLANG_JAX_DRAFTING=0`` for
    off): the EAGLE draft loop's logits are masked through a ``DraftSession``, so the drafts of
    grammar requests are tokens their grammar allows. Off: sglang-jax's own drafts (the verify
    masks are applied either way)."""
    SWITCHES["drafting"] = bool(on)


def set_timing(on: bool) -> None:
    """Timing mode (also ``PORTABLE_SPEC_SGLANG_JAX_TIMING=1``): each masked step also waits
    for the verify logits to measure how much of the mask build the forward did not hide.
    The extra wait happens only after the mask is ready; it is for measurements, not for
    production."""
    SWITCHES["timing"] = bool(on)
