"""tpu-inference's runner as the integration patches it: the three replacements.

* ``TPUModelRunner.sample_tokens`` keeps a reference to the step's state
  (``execute_model_state``: the scheduled drafts, the spec-decode metadata, the requests per
  data-parallel rank) for the mask, since tpu-inference clears it before preparing the mask;
* ``StructuredDecodingManager.prepare_structured_decoding_input`` maps every logits row to
  the vLLM row of its own request and position (draft targets first, bonus last, padding and
  unconstrained requests untouched, :mod:`~portable_spec.integrations.tpu_inference.rows`) and
  uploads vLLM's rows as they are, with that index, in one int32 ``[rows, 1 + words]`` array
  (one transfer per step);
* ``StructuredDecodingManager.structured_decode_fn`` masks the logits in one jitted function
  whose inputs have static shapes (that array and the logits, which it donates: the masked
  logits take their buffer; :mod:`~portable_spec.integrations.tpu_inference.apply`), so the
  batch's mix never recompiles it.

Installed only on a release :mod:`.internals` knows (its version and the source hash of the
three methods and of what they rely on, vLLM's ``grammar_bitmask`` among them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from portable_spec.hostbuffers import HostBufferPool
from portable_spec.integrations.tpu_inference import internals
from portable_spec.integrations.tpu_inference.rows import RowMap, map_rows
from portable_spec.integrations.tpu_inference.state import LOG, STATS

__all__ = ["decode_replacement", "prepare_replacement", "prepare_rows", "sample_tokens_replacement"]

_pool = HostBufferPool(max_free=4)


def sample_tokens_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        manager = getattr(self, "structured_decoding_manager", None)
        if grammar_output is None or manager is None:
            return original(self, grammar_output)
        # tpu-inference clears execute_model_state before it prepares the mask
        manager._portable_spec_step = self.execute_model_state
        try:
            return original(self, grammar_output)
        finally:
            manager._portable_spec_step = None

    return sample_tokens


def prepare_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_structured_decoding_input(
        self: Any, logits: Any, grammar_output: Any
    ) -> tuple[Any, None, None]:
        return prepare_rows(self, logits, grammar_output)

    return prepare_structured_decoding_input


def decode_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    from portable_spec.integrations.tpu_inference.apply import apply_flagged, apply_packed

    def structured_decode_fn(
        self: Any, packed_or_flags: Any, bits: Any, logits: Any, arange: Any = None
    ) -> Any:
        """The logits ``[rows, vocab]`` masked per row, from what the patched
        ``prepare_structured_decoding_input`` returned (``packed_or_flags`` int32
        ``[rows, 1 + words]``, ``bits`` and ``arange`` None; the logits are donated:
        tpu-inference's ``sample_tokens`` rebinds them to the result), or from tpu-inference's
        own inputs (bool ``[rows, 1]`` flags, int32 ``[rows, words]`` aligned rows, as its
        start-up precompilation passes them; not donated). Returns the masked logits without
        blocking."""
        if np.dtype(packed_or_flags.dtype) == np.bool_:
            return apply_flagged(packed_or_flags, bits, logits)
        return apply_packed(packed_or_flags, logits)

    return structured_decode_fn


def prepare_rows(manager: Any, logits: Any, grammar_output: Any) -> tuple[Any, None, None]:
    """The patched ``prepare_structured_decoding_input``: this step's grammar rows, placed.

    ``manager``: tpu-inference's ``StructuredDecodingManager``; ``logits``: the step's
    ``[rows, vocab]`` logits (only the shape is read); ``grammar_output``: vLLM's
    ``GrammarOutput`` (``grammar_bitmask`` int32 ``[vLLM rows, words]`` numpy). The step's
    layout comes from the runner's ``execute_model_state`` (kept by the patched
    ``sample_tokens``): requests per data-parallel rank, their draft counts, the scheduled
    drafts vLLM built the rows for.

    Returns ``(packed, None, None)``, ready for the patched ``structured_decode_fn``:
    ``packed`` int32 ``[rows, 1 + words]`` on the runner's mesh (replicated), column 0 per
    logits row the packed row that masks it (``rows``: left as it is), columns ``1 ..`` vLLM's
    rows of the batch's requests in vLLM's order (the rows past them are never read). Does
    not block: one asynchronous upload, from a pooled host buffer that is reused only once
    nothing reads it. A structured request missing from the batch has its rows skipped (one
    ``WARNING`` the first time; counted in ``integration_stats()``).

    Raises:
        TypeError: a bitmask that is not an int32 numpy matrix.
        ValueError: logits wider than the bitmask covers, a step layout that is not known
            (speculative decoding without the step's metadata), or layouts that disagree
            (see :func:`portable_spec.integrations.tpu_inference.rows.map_rows`). Nothing is
            uploaded.
    """
    bitmask = grammar_output.grammar_bitmask
    if not isinstance(bitmask, np.ndarray) or bitmask.ndim != 2 or bitmask.dtype != np.int32:
        raise TypeError(
            f"vLLM's grammar bitmask must be an int32 [rows, words] numpy array, got "
            f"{type(bitmask).__name__} {getattr(bitmask, 'dtype', '')}"
            f"{list(getattr(bitmask, 'shape', ()))}"
        )
    num_logits, vocab = (int(n) for n in logits.shape)
    words = bitmask.shape[1]
    if vocab > 32 * words:
        raise ValueError(
            f"the logits have {vocab} columns but vLLM's grammar bitmask covers {32 * words} "
            f"tokens ({words} words per row)"
        )
    runner = manager.runner
    step = getattr(manager, "_portable_spec_step", None) or runner.execute_model_state
    ranks, drafts, spec_tokens = internals.step_layout(runner, step, num_logits)
    rows = map_rows(
        list(grammar_output.structured_output_request_ids),
        spec_tokens,
        bitmask.shape[0],
        ranks,
        drafts,
        num_logits,
    )
    if rows.skipped:
        STATS.add("skipped_requests", len(rows.skipped))
        LOG.warning(
            "skipped",
            "portable_spec: structured requests %s are not in tpu-inference's batch: their "
            "grammar rows are skipped (counted in integration_stats)",
            list(rows.skipped[:8]),
        )
    packed = _upload(manager, rows, bitmask, num_logits)
    STATS.add("steps")
    STATS.add("rows", rows.rows)
    return packed, None, None


def _upload(manager: Any, rows: RowMap, bitmask: np.ndarray, num_logits: int) -> Any:
    buffer = _pool.acquire((num_logits, 1 + bitmask.shape[1]), np.int32)
    try:
        host = buffer.array
        host[:, 0] = rows.index
        for source, packed, count in rows.spans:
            host[packed : packed + count, 1:] = bitmask[source : source + count]
    except BaseException:
        _pool.release(buffer)
        raise
    return internals.device_array(manager.runner.mesh, _pool.lend(buffer))
