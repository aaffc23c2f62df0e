"""tpu-inference's internals as the integration reads them: the only file of the package that
names them.

The integration replaces three methods of tpu-inference's runner (:mod:`.runner`) and relies on
what they read: the structured-decoding manager's runner, the fields of the runner's step
state (``ExecuteModelState``) and of its spec-decode metadata (``SpecDecodeMetadata``),
tpu-inference's upload helper (``device_array``), the inputs its start-up precompilation
passes, and vLLM 0.32's ``grammar_bitmask`` (the packed rows, in vLLM's request order, that the
patched methods read). Every function and class it relies on is listed in :data:`READS`; each
tpu-inference release it knows is one row of :data:`REVISIONS`: the version tpu-inference
reports and the SHA-256 of the source of each target. Any other source: one warning, then
tpu-inference's own code.

To add a release: install it, run ``python -m portable_spec.integrations.tpu_inference.
internals`` (it prints this process's tpu-inference version and source hashes), check that
the row rules of ``rows.py`` still hold for it, and add the row.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec.integrations.face import engine_version
from portable_spec.integrations.patching import Revision, print_sources

__all__ = [
    "DECODE",
    "DISTRIBUTIONS",
    "ENGINE",
    "MANAGER_MODULE",
    "PACKAGE",
    "PREPARE",
    "READS",
    "REVISIONS",
    "RUNNER_MODULE",
    "SAMPLE_TOKENS",
    "TARGETS",
    "TRIGGER",
    "device_array",
    "logger",
    "step_layout",
    "version",
]

#: A child of vLLM's logger (tpu-inference logs through vLLM's): the integration's lines come
#: out with vLLM's format and level.
logger = logging.getLogger("vllm.portable_spec.tpu_inference")

#: the engine's name in log lines and errors; the package it imports as; its distribution
ENGINE = "tpu-inference"
PACKAGE = "tpu_inference"
DISTRIBUTIONS = ("tpu-inference",)

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
#: every function the integration replaces
TARGETS = (SAMPLE_TOKENS, PREPARE, DECODE)
#: the module whose import installs the integration, from vLLM's entry point
TRIGGER = RUNNER_MODULE
#: what the integration reads or calls (recognised by source hash, never replaced)
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


def version() -> str | None:
    """tpu-inference's installed version (its distribution's metadata: nothing is imported), or
    None without tpu-inference."""
    return engine_version(PACKAGE, DISTRIBUTIONS)


def device_array(mesh: Any, array: np.ndarray) -> Any:
    """``array`` on the runner's ``mesh`` by tpu-inference's own upload helper (its
    ``device_put``, or its multi-host path), as the structured-decoding manager calls it."""
    return sys.modules[MANAGER_MODULE].device_array(mesh, array)


def step_layout(
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


if __name__ == "__main__":  # the row of REVISIONS this process's tpu-inference would need
    print_sources(ENGINE, version(), (*TARGETS, *READS))
