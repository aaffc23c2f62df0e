"""sglang-jax's internals as the integration reads them: the only file of the package that names
them.

The integration replaces the functions below (the mask work: :mod:`.verify`, :mod:`.draft`,
:mod:`.fused`; sglang-jax's own bugs on this path: :mod:`.fixes`) and calls a few more of
sglang-jax's (accessors at the end of this file). Each sglang-jax revision it knows is one row
of :data:`REVISIONS`: the SHA-256 of the source of every function replaced (``source_hash``).
sglang-jax reports no version that tells its commits apart (a source archive installs as
``0.0.0.dev0``), so a revision matches any version and is recognised by those hashes alone.
Any other source of any of them: one warning line, nothing patched, sglang-jax's own code runs.

When sglang-jax fixes one of its bugs the integration works around (:mod:`.fixes`), the new
revision's entry drops that fix's target (or, when the mask work also patches the target,
names the bug in ``fixed``): that fix is then left out and every other patch stays.

To add a revision: install it, run ``python -m portable_spec.integrations.sglang_jax.
internals`` (it prints this process's sglang-jax version and source hashes), check the fixes
against docs/sglang-jax-upstream.md, and add the row.
"""

from __future__ import annotations

import logging
from typing import Any

from portable_spec.integrations.face import engine_version
from portable_spec.integrations.patching import Revision, print_sources, resolve

__all__ = [
    "DISTRIBUTIONS",
    "ENGINE",
    "PACKAGE",
    "READS",
    "REVISIONS",
    "TARGETS",
    "TRIGGER",
    "chain_verify_functions",
    "dummy_first_mode",
    "finish_on_token",
    "invalid_grammar_object",
    "logger",
    "logits_metadata_class",
    "topk_probs_from_logits",
    "version",
]

#: sglang-jax's child logger: the lines land in the scheduler's log.
logger = logging.getLogger("sgl_jax.portable_spec")

#: the engine's name in log lines and errors; the package it imports as; its distribution
ENGINE = "sglang-jax"
PACKAGE = "sgl_jax"
DISTRIBUTIONS = ("sglang-jax",)

_SPEC = "sgl_jax.srt.speculative"
_DRAFT_WORKER = f"{_SPEC}.eagle_draft_worker"
_FUSED = f"{_SPEC}.draft_extend_fused"

# the verify mask (.verify)
VERIFY = f"{_SPEC}.base_worker:BaseSpecWorker.verify"
SAMPLE = f"{_SPEC}.eagle_info:EagleVerifyInput.sample"
# grammar-aware drafting (.draft)
TOPK = f"{_DRAFT_WORKER}:topk_probs_from_logits"
SELECT = f"{_DRAFT_WORKER}:select_top_k_tokens"
DRAFT = f"{_DRAFT_WORKER}:EagleDraftWorker.draft_forward"
EXTEND_DECODE = f"{_DRAFT_WORKER}:EagleDraftWorker.draft_extend_for_decode"
EXTEND_PREFILL = f"{_DRAFT_WORKER}:EagleDraftWorker.draft_extend_for_prefill"
# the overlap schedule's fused verify (.fused)
BUILD_VERIFY = f"{_FUSED}:_build_verify"
FUSED_VERIFY = f"{_FUSED}:spec_decode_verify"
LOGITS = "sgl_jax.srt.layers.logits_processor:LogitsProcessor.__call__"
# sglang-jax's own bugs (.fixes; SAMPLE also carries one)
ACCEPT = "sgl_jax.srt.constrained.llguidance_backend:GuidanceGrammar.accept_token"
RESOLVE = f"{_SPEC}.overlap_utils:resolve_spec_decode_token_ids"
BATCH_MASK = "sgl_jax.srt.managers.schedule_batch:ModelWorkerSamplingInfo.update_grammar_vocab_mask"
RUN_BATCH = "sgl_jax.srt.managers.scheduler:Scheduler.run_batch"
GRAMMAR_CACHE = (
    "sgl_jax.srt.constrained.base_grammar_backend:BaseGrammarBackend.get_cached_or_future_value"
)

#: every function the integration replaces (the mask work's and the fixes')
TARGETS = (
    VERIFY,
    SAMPLE,
    TOPK,
    SELECT,
    DRAFT,
    EXTEND_DECODE,
    EXTEND_PREFILL,
    BUILD_VERIFY,
    FUSED_VERIFY,
    LOGITS,
    ACCEPT,
    RESOLVE,
    BATCH_MASK,
    RUN_BATCH,
    GRAMMAR_CACHE,
)
#: what the integration only reads or calls, recognised by source hash: none yet (the calls
#: below go to functions the replaced ones call themselves)
READS: tuple[str, ...] = ()
#: the module whose import, in the process that then creates sglang-jax's scheduler, makes
#: that ``Scheduler`` install the integration (:mod:`.hook`)
TRIGGER = "sgl_jax.srt.managers.scheduler"

REVISIONS: dict[str, Revision] = {
    "cddbf6f1": Revision(
        "",
        {
            VERIFY: "541dcc18d886bc7bebac8e13989400a19b6b64db44bbe5106859bea99dccdb05",
            SAMPLE: "01b1b99d1f05fdef854ca55c69f1101e8cbf16a3768039c2924dd5ede4eec61e",
            TOPK: "b1ef7b9a0eba0786d390ebf5b990347f5b8c3df3a77e443be9f5248a7daf3f68",
            SELECT: "3b887b12dd35c660a747452f285d9add72299688e90b30e1375106ed0ab09166",
            DRAFT: "5ff3fac7cd7c1c2b56184383417cad79c60ae8a83b065bc002e0a8b3d295ee6d",
            EXTEND_DECODE: "e9bcbd3ac6e684392e9a91441757a6879b049fe17887567ab0b693ed6f9ec924",
            EXTEND_PREFILL: "99d6a281f6a31f1e18ec62908abff2880d9cfc2e6eb1ad65de7b160a1f523df7",
            BUILD_VERIFY: "82a66ae915e3ded259e5b34ca267c15adaaa3ac5127c5b4d4ed2b56a7336c57b",
            FUSED_VERIFY: "4378280faa8cccff80a0173a57e39b659e3c2f0da7b60bf8e445a572faa9fb20",
            LOGITS: "5c35a2eab05d7b360e74418c77c2768a7a5e34aa4bb18d7402cf3e18edd8baa9",
            ACCEPT: "284b5f597b9ef74cfb0fcc53f765b6387806ff1665d912efab0f1bc4fd777111",
            RESOLVE: "29ff3731e1a69bca5b51b38d756f411b751cc543ead84ac1d477290b96151ced",
            BATCH_MASK: "f963ef18e10c8ee8dd9a799ce37bf5bbeaf681d16b23505e9676ed2ba33bcf93",
            RUN_BATCH: "6b98849c88691ce1638cccafe764f201bdcbc4f04255182214297b8575031d46",
            GRAMMAR_CACHE: "565b795a95b324bb81ed94b60a3b2be83b2389f86db0b191b5b4730c7c0edd31",
        },
    ),
}


def version() -> str | None:
    """sglang-jax's installed version (its distribution's metadata: nothing is imported; ``""``
    from a source tree), or None without sglang-jax."""
    return engine_version(PACKAGE, DISTRIBUTIONS)


# -- what the integration calls of sglang-jax's own (imported once it is installed) ---------


def finish_on_token(token: int) -> Any:
    """sglang-jax's finish reason for a request ended by ``token`` (``FINISH_MATCHED_TOKEN``)."""
    from sgl_jax.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN

    return FINISH_MATCHED_TOKEN(matched=int(token))


def dummy_first_mode() -> Any:
    """``ForwardMode.DUMMY_FIRST``: the overlap loop's entry that processes nothing."""
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode.DUMMY_FIRST


def invalid_grammar_object() -> Any:
    """sglang-jax's marker for a grammar that failed to compile (``INVALID_GRAMMAR_OBJ``)."""
    from sgl_jax.srt.constrained.base_grammar_backend import INVALID_GRAMMAR_OBJ

    return INVALID_GRAMMAR_OBJ


def logits_metadata_class() -> type:
    """sglang-jax's ``LogitsMetadata`` (a JAX pytree node class)."""
    from sgl_jax.srt.layers.logits_processor import LogitsMetadata

    return LogitsMetadata


def chain_verify_functions() -> tuple[Any, Any, Any]:
    """The fused step's own chain functions: ``(_build_chain_verify_arrays,
    _map_eagle3_token_ids, gather_spec_relay_buffers)``."""
    from sgl_jax.srt.speculative.draft_extend_fused import (
        _build_chain_verify_arrays,
        _map_eagle3_token_ids,
    )
    from sgl_jax.srt.speculative.relay_buffer import gather_spec_relay_buffers

    return _build_chain_verify_arrays, _map_eagle3_token_ids, gather_spec_relay_buffers


def topk_probs_from_logits() -> Any:
    """The draft worker's ``topk_probs_from_logits`` as it is now (the integration's, while
    installed)."""
    return resolve(TOPK)[2]


if __name__ == "__main__":  # the row of REVISIONS this process's sglang-jax would need
    print_sources(ENGINE, version(), (*TARGETS, *READS))
