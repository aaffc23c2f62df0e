"""The grammar mask of sglang-jax's EAGLE verify (trees and chains, the non-overlap schedule).

* ``BaseSpecWorker.verify``: the draft tree (``retrive_next_token``, ``retrive_next_sibling``,
  ``draft_token``) is staged to the host (``GrammarTree.from_device``: an on-device copy, then
  ``copy_to_host_async``) before the target verify forward is launched, and its mask is built
  on the library's background thread while the forward runs;
* ``EagleVerifyInput.sample``: the mask is applied to the verify logits before greedy
  verification or rejection sampling (requests without a grammar keep their logits); called
  on its own, ``sample`` stages and builds the mask itself.

Bad input never crashes a step: a grammar the library refuses, or a tree it finds malformed,
leaves that request on sglang-jax's own (unmasked) verify for the step, with one log line;
the library refuses before any matcher moves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from portable_spec.integrations.sglang_jax.masks import (
    JOB_ATTR,
    MaskJob,
    apply_mask,
    slot_grammars,
    start_mask,
)
from portable_spec.integrations.sglang_jax.state import LOG, STATS, SWITCHES

__all__ = ["wrap_sample", "wrap_verify"]


def _start_job(spec_info: Any, model_worker_batch: Any) -> MaskJob | None:
    """Stage the tree of ``spec_info`` and start its mask build; ``None`` when no request of
    the batch has a grammar. Never raises (a failure leaves the step unmasked, logged)."""
    try:
        batch = spec_info.retrive_next_token.shape[0]
        slots = slot_grammars(model_worker_batch, batch)
        if slots is None:
            return None
        vocab = int(model_worker_batch.sampling_info.vocab_size)
        return start_mask(
            spec_info.retrive_next_token,
            spec_info.retrive_next_sibling,
            spec_info.draft_token,
            slots,
            vocab,
        )
    except Exception as exc:
        LOG.warning(
            f"verify:{type(exc).__name__}",
            "portable_spec: verify mask not started (this step unmasked, and any other failing "
            "so): %s",
            exc,
        )
        return None


def wrap_verify(original: Callable[..., Any]) -> Callable[..., Any]:
    """``BaseSpecWorker.verify``: the mask build starts before the target forward."""

    def verify(self: Any, model_worker_batch: Any, cur_allocate_lens: Any) -> Any:
        spec_info = model_worker_batch.spec_info_padded
        started = time.perf_counter()
        job = None
        fresh = getattr(spec_info, JOB_ATTR, None) is None
        if hasattr(spec_info, "retrive_next_sibling") and fresh:
            job = _start_job(spec_info, model_worker_batch)
            if job is not None:
                setattr(spec_info, JOB_ATTR, job)
        result = original(self, model_worker_batch, cur_allocate_lens)
        if job is not None and SWITCHES["timing"]:
            STATS.sample("step_s", time.perf_counter() - started)
        return result

    return verify


def wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EagleVerifyInput.sample``: the verify logits masked before verification."""

    def sample(self: Any, model_worker_batch: Any, logits_output: Any, rng: Any, mesh: Any) -> Any:
        job = self.__dict__.pop(JOB_ATTR, None)
        if job is None:
            job = _start_job(self, model_worker_batch)
        if job is not None:
            _mask_logits(job, logits_output)
        out = original(self, model_worker_batch, logits_output, rng, mesh)
        if job is None:
            STATS.add("verify_steps")
            return out
        lengths = np.asarray(out[2])  # accept_length
        live = [b for b, m in enumerate(job.grammars) if m is not None and b < len(lengths)]
        accepted = int(lengths[live].sum()) if live else 0
        STATS.update(
            {"verify_steps": 1, "accepted_tokens": accepted, "constrained_verifies": len(live)}
        )
        return out

    return sample


def _mask_logits(job: MaskJob, logits_output: Any) -> None:
    logits = logits_output.next_token_logits
    watcher = _ForwardWatch(logits) if SWITCHES["timing"] else None
    mask = job.finish()
    exposed = watcher.exposed(job.finished_at) if watcher is not None else None
    if mask is not None:
        logits_output.next_token_logits = apply_mask(logits, mask, job.vocab_size)
    counts = {"grammar_steps": 1, "refused_requests": len(job.refused)}
    samples = {}
    if mask is not None:
        counts.update(masked_steps=1, masked_rows=int(mask.shape[0]))
        samples["waited_s"] = job.waited
        if exposed is not None:
            samples["exposed_s"] = exposed
    STATS.update(counts, samples)


class _ForwardWatch:
    """When the verify logits became ready (timing mode): a thread blocks on them."""

    def __init__(self, logits: Any) -> None:
        self.ready_at = 0.0
        self._thread = threading.Thread(target=self._wait, args=(logits,), daemon=True)
        self._thread.start()

    def _wait(self, logits: Any) -> None:
        try:
            logits.block_until_ready()
        finally:
            self.ready_at = time.perf_counter()

    def exposed(self, mask_ready_at: float) -> float:
        """Seconds between the logits being ready and the mask being ready (0 if the mask
        was first)."""
        self._thread.join()
        return max(0.0, mask_ready_at - self.ready_at)
