"""tpu-inference (vLLM on TPU): vLLM's grammar rows on the logits rows they belong to.

tpu-inference 0.32 applies vLLM's structured-output bitmask as if every request had one
logits row: ``StructuredDecodingManager.prepare_structured_decoding_input`` copies row ``i``
of vLLM's bitmask to the ``i``-th request of ``sorted(structured_output_request_ids)``. vLLM
0.32 writes ``1 + len(drafts)`` rows per structured request, in the order of
``structured_output_request_ids``, and with speculative decoding tpu-inference's logits hold
``1 + drafts`` rows per request. So with speculation a request gets another request's draft
row (or the step fails on a reshape), and without it rows go to the wrong requests whenever
vLLM's order is not the sorted one.

Installed, this package replaces three methods of tpu-inference's runner (``runner.py``; its
own code runs around them): the step's state kept for the mask, each logits row mapped to its
request's row (``rows.py``), the mask applied in one jitted function (``apply.py``). The
package, as every engine package of the library: ``internals.py`` (the only file that names
tpu-inference's internals: what is replaced and read, the table of known releases, the
version, accessors), ``patches.py`` (what is replaced, and by what), ``state.py`` (the
switch, the counters, the once-per-process lines), then the modules of each job.

Switch: ``PORTABLE_SPEC_VLLM=1`` (or ``on``, :data:`ENV_VAR`: tpu-inference runs inside vLLM
and takes vLLM's switch): vLLM's entry point
(:func:`portable_spec.integrations.entry_points.vllm_general_plugins`) then patches the runner
when tpu-inference imports it (:func:`install_on_import`). ``shadow``, ``0``, unset: the
runner is left as it is. In a process you control, :func:`install` patches it now. Known
releases: tpu-inference 0.32 reading vLLM 0.32's rows (``runner.REVISIONS``: versions and
source hashes); any other gets one ``WARNING`` line and tpu-inference's own code. The rows
themselves are vLLM's (built by the vLLM plugin when it is on): nothing is built twice.
"""

from __future__ import annotations

from typing import Any

from portable_spec.integrations.tpu_inference import internals
from portable_spec.integrations.tpu_inference.state import ENV_VAR, INTEGRATION

__all__ = [
    "ENV_VAR",
    "install",
    "install_on_import",
    "integration_stats",
    "is_installed",
    "reset_stats",
    "uninstall",
]


def install(mode: str = "on") -> bool:
    """Patch tpu-inference's runner in this process now (importing it if needed).

    Returns True when the runner is patched (also when it already was); False without
    tpu-inference (nothing imported, no warning) or when its release is not one this
    integration knows (one ``WARNING`` line; tpu-inference's own code stays). ``mode``: only
    ``"on"`` (tpu-inference has no shadow mode: its own rows are the misplaced ones);
    ValueError otherwise. Idempotent; does not block.
    """
    return INTEGRATION.install(mode)


def install_on_import() -> bool:
    """Patch tpu-inference's runner as soon as tpu-inference imports it in this process (now,
    if it already has). Returns False, importing nothing, where tpu-inference is not
    installed."""
    if internals.version() is None:
        return False
    INTEGRATION.install_on_import(internals.TRIGGER)
    return True


def uninstall() -> None:
    """Give tpu-inference's runner its own methods back (and stop waiting for its import)."""
    INTEGRATION.uninstall()


def is_installed() -> bool:
    """Whether tpu-inference's runner is patched in this process."""
    return INTEGRATION.is_installed()


def integration_stats() -> dict[str, Any]:
    """This process's counters: ``steps`` whose mask the integration prepared, ``rows``
    (logits rows given a grammar row), ``skipped_requests`` (structured requests that were not
    in the runner's batch: their rows skipped, with a log line); ``median_us`` and ``samples``
    empty (no timings kept). Never blocks."""
    return INTEGRATION.integration_stats()


def reset_stats() -> None:
    """Forget every counter of this process; the once-per-process lines, and the warning about
    a tpu-inference release the integration does not know, may be logged again."""
    INTEGRATION.reset_stats()
