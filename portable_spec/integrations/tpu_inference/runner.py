"""tpu-inference's runner as the integration patches it: the table of known releases and the
three replacements.

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

Recognised by :data:`REVISIONS`: tpu-inference's version and the source hash of the three
methods and of what they rely on, vLLM's ``grammar_bitmask`` among them (the packed rows, in
vLLM's request order, that the patched methods read).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from portable_spec.hostbuffers import HostBufferPool
from portable_spec.integrations.patching import LogOnce, Patch, PatchSet, Revision, Stats
from portable_spec.integrations.tpu_inference.rows import RowMap, map_rows

__all__ = [
    "REVISIONS",
    "RUNNER_MODULE",
    "STATS",
    "patch_set",
    "prepare_rows",
    "version",
]

#: the module that defines ``TPUModelRunner`` (it imports the structured-decoding manager)
RUNNER_MODULE = "tpu_inference.runner.tpu_runner"
MANAGER_MODULE = "tpu_inference.runner.structured_decoding_manager"

logger = logging.getLogger("vllm.portable_spec.tpu_inference")

_RUNNER = f"{RUNNER_MODULE}:TPUModelRunner"
_MANAGER = f"{MANAGER_MODULE}:StructuredDecodingManager"
SAMPLE_TOKENS = f"{_RUNNER}.sample_tokens"
PREPARE = f"{_MANAGER}.prepare_structured_decoding_input"
DECODE = f"{_MANAGER}.structured_decode_fn"
# what the replacements read: the manager's runner, the step state's and the spec-decode
# metadata's fields, tpu-inference's upload, the inputs its start-up precompilation passes,
# and vLLM's packed rows
_INIT = f"{_MANAGER}.__init__"
_STATE = f"{RUNNER_MODULE}:ExecuteModelState"
_META = "tpu_inference.runner.utils:SpecDecodeMetadata"
_UPLOAD = "tpu_inference.utils:device_array"
_PRECOMPILE = (
    "tpu_inference.runner.compilation_manager:CompilationManager._precompile_structured_decoding"
)
_VLLM_ROWS = "vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask"
READS = (_INIT, _STATE, _META, _UPLOAD, _PRECOMPILE, _VLLM_ROWS)

#: The tpu-inference releases this integration knows (with the vLLM release whose rows they
#: read): version prefix and the source hash of every target at that release.
REVISIONS: dict[str, Revision] = {
    "0.32": Revision(
        "0.32",
        {
            SAMPLE_TOKENS: "6e202795a762dce5a2a1dcbc41c625402e0787422cb02a3f56a0766f3fc504fe",
            PREPARE: "284dc17855c0fd07a1c484ac2296e9acb880cfaafe991563eeb2c44519b73edb",
            DECODE: "8f9c16a5f6cc21f95bcb8076714bf214286e94be82ff536c64740bec9fa168eb",
            _INIT: "989bbfccc41b2c6eb09cc17d3d4a20105979bdfca81f105c3c862df79c32fa39",
            _STATE: "f2a0f2d90e4f566c5f72e5eba83fd31fba51565d7b4be47ce1b69d81570f5eab",
            _META: "61cbf78a2d4017b71259f7c8f1eba2a4900312e96bc9dc53e715a92d7ebeac9a",
            _UPLOAD: "13973abbdcafb7e514451f23a0a4207d0736aea8f7cda049718eb30df88dd159",
            _PRECOMPILE: "d85dc4489b240c02977ee85773648b58ab2288e6fddcd9e291b3033fff0b9f9e",
            # vLLM 0.32's grammar_bitmask: packed rows in structured_output_request_ids order
            _VLLM_ROWS: "46f2867ad31aea096ea3a719c5336d4736df94cf2142fd6b0eb68b006aa2a30c",
        },
    ),
}

STATS = Stats(("steps", "rows", "skipped_requests"))
once = LogOnce(logger)
_pool = HostBufferPool(max_free=4)


def version() -> str | None:
    """tpu-inference's installed version, or None without tpu-inference (imports nothing)."""
    if importlib.util.find_spec("tpu_inference") is None:
        return None
    for name in ("tpu-inference", "tpu_inference"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def patch_set() -> PatchSet:
    """tpu-inference's patch set: the three replacements, :data:`READS` recognised."""
    return PatchSet(
        "tpu-inference",
        patches=[
            Patch(SAMPLE_TOKENS, _sample_tokens),
            Patch(PREPARE, _prepare),
            Patch(DECODE, _decode),
            *(Patch(target) for target in READS),
        ],
        revisions=REVISIONS,
        version=lambda: version(),
        logger=logger,
    )


def _sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
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


def _prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_structured_decoding_input(
        self: Any, logits: Any, grammar_output: Any
    ) -> tuple[Any, None, None]:
        return prepare_rows(self, logits, grammar_output)

    return prepare_structured_decoding_input


def _decode(original: Callable[..., Any]) -> Callable[..., Any]:
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
    ranks, drafts, spec_tokens = _layout(runner, step, num_logits)
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
        once.warning(
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
    # tpu-inference's own upload helper (its device_put, or its multi-host path)
    device_array = sys.modules[MANAGER_MODULE].device_array
    return device_array(manager.runner.mesh, _pool.lend(buffer))


def _layout(
    runner: Any, step: Any, num_logits: int
) -> tuple[list[Sequence[str]], list[np.ndarray] | None, dict[str, Sequence[int]]]:
    """The step's requests per rank in logits order, their draft counts per rank (None:
    one row each) and vLLM's scheduled drafts, from tpu-inference's step state."""
    if step is None:
        if getattr(runner, "speculative_config", None) is not None:
            raise ValueError(
                "speculative decoding: the grammar rows need the step's spec-decode metadata; "
                "prepare_structured_decoding_input must run inside TPUModelRunner.sample_tokens "
                "(or while execute_model_state is set)"
            )
        if getattr(runner, "dp_size", 1) != 1:
            raise ValueError("data parallelism: the step's state is needed to place rows")
        batch = runner.input_batch
        return [list(batch.req_ids[: batch.num_reqs])], None, {}
    spec_tokens = step.scheduler_output.scheduled_spec_decode_tokens
    meta = step.spec_decode_metadata
    by_rank = step.req_ids_dp or (meta.req_ids_dp if meta is not None else None)
    if not by_rank:
        raise ValueError("the step's state lists no requests per data-parallel rank")
    ranks = [by_rank[rank] for rank in range(len(by_rank))]
    if meta is None:
        return ranks, None, spec_tokens
    logits_rows = int(meta.final_logits_indices.shape[0])
    if logits_rows != num_logits:
        raise ValueError(
            f"the logits have {num_logits} rows, the step's spec-decode metadata {logits_rows}"
        )
    lengths = np.asarray(meta.draft_lengths_cpu)
    per_rank = len(lengths) // len(ranks)
    drafts = [lengths[rank * per_rank : (rank + 1) * per_rank] for rank in range(len(ranks))]
    return ranks, drafts, spec_tokens
