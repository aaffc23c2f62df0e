"""How the integration recognises sglang-jax: the functions it patches, and their source at
every sglang-jax revision it knows (one :class:`Revision` each).

sglang-jax reports no version that tells its commits apart (a source archive installs as
``0.0.0.dev0``), so a revision matches any version and is recognised by the SHA-256 of the
source of every function the integration replaces (``source_hash``). Any other source of any
of them: one warning line, nothing patched, sglang-jax's own code runs.

When sglang-jax fixes one of its bugs the integration works around (:mod:`.fixes`), the new
revision's entry drops that fix's target (or, when the mask work also patches the target,
names the bug in ``fixed``): that fix is then left out and every other patch stays.
"""

from __future__ import annotations

from portable_spec.integrations.patching import Revision

__all__ = ["REVISIONS"]

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
RADIX_FINISH = "sgl_jax.srt.mem_cache.radix_cache:RadixCache.cache_finished_req"

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
            RADIX_FINISH: "a9ea7adbedd892e1c4adc052134324f4d8f4de1b3fb20a750290a686def03e32",
        },
    ),
}
