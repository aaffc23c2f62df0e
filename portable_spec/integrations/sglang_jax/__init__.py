"""sglang-jax integration: grammar masks on its speculative verify (EAGLE, EAGLE3, NEXTN; trees
and chains), built by portable_spec while the target forward runs.

Off by default. Two ways to switch it on:

* :func:`install` patches sglang-jax in the calling process (tests, an engine run in-process);
* ``PORTABLE_SPEC_SGLANG_JAX=1`` in the environment of an sglang-jax launch, with the library
  installed in sglang-jax's environment: the ``portable_spec_sglang_jax.pth`` file the library
  ships installs the patches in whichever process sglang-jax creates its scheduler
  (:mod:`.hook`).

The package, as every engine package of the library:

* :mod:`.internals`: the only file that names sglang-jax's internals: the functions patched,
  their source at each sglang-jax revision known (any other source: one warning line, nothing
  patched), the version, what the integration calls of sglang-jax's own;
* :mod:`.patches`: what is replaced, target by target, and by what;
* :mod:`.state`: the switches, the counters, the once-per-process lines;
* :mod:`.verify` and :mod:`.masks`: the verify mask, staged before the target forward and
  applied to the verify logits;
* :mod:`.draft`: grammar-aware EAGLE drafting through a :class:`portable_spec.DraftSession`;
* :mod:`.fused`: the overlap schedule's fused verify, the mask an input of the jitted step;
* :mod:`.fixes` (with :mod:`.grammar`): sglang-jax's own bugs on this path, one patch per
  entry of ``docs/sglang-jax-upstream.md``, each dropped when sglang-jax fixes it;
* :mod:`.hook`: the process switch.
"""

from __future__ import annotations

from typing import Any

from portable_spec.integrations.sglang_jax.state import (
    DRAFTING_ENV_VAR,
    ENV_VAR,
    INTEGRATION,
    SWITCHES,
    TIMING_ENV_VAR,
)

__all__ = [
    "DRAFTING_ENV_VAR",
    "ENV_VAR",
    "TIMING_ENV_VAR",
    "install",
    "integration_stats",
    "is_installed",
    "reset_stats",
    "set_drafting",
    "set_timing",
    "uninstall",
]


def install(mode: str = "on") -> bool:
    """Patch sglang-jax in this process (idempotent, thread-safe). Returns whether the patches
    are in place: ``False`` (one warning line; sglang-jax's own code keeps running) for an
    sglang-jax whose patched functions the integration does not know, ``False`` without a
    word when sglang-jax is not installed. ``mode`` is ``"on"``: sglang-jax's verify has no
    result of its own to compare with (no shadow mode); anything else raises ValueError."""
    return INTEGRATION.install(mode)


def uninstall() -> None:
    """Put sglang-jax's own functions back (this process), and stop the process switch
    (:mod:`.hook`) from installing them again."""
    INTEGRATION.uninstall()


def is_installed() -> bool:
    """Whether the patches are in place in this process."""
    return INTEGRATION.is_installed()


def integration_stats() -> dict[str, Any]:
    """A snapshot of this process's counters and series (:data:`.state.COUNTERS`,
    :data:`.state.SERIES`) in the shape of every integration's stats. Never blocks on the
    device."""
    return INTEGRATION.integration_stats()


def reset_stats() -> None:
    """Forget this process's counters and timings; the once-per-process lines, and the warning
    about an sglang-jax the integration does not know, may be logged again."""
    INTEGRATION.reset_stats()


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
