"""What the sglang-jax integration replaces, in stacking order (each target named in
:mod:`.internals`, its replacement made in the module of its job), and what it only reads.

sglang-jax's fixes come first (:data:`.fixes.FIXES`, one per entry of
``docs/sglang-jax-upstream.md``), so that on a function both patch
(``EagleVerifyInput.sample``) the mask work wraps the fixed function.
"""

from __future__ import annotations

from portable_spec.integrations.patching import Patch
from portable_spec.integrations.sglang_jax import draft, fused, internals, verify
from portable_spec.integrations.sglang_jax.fixes import FIXES
from portable_spec.integrations.sglang_jax.state import SWITCHES

__all__ = ["MASKS", "PATCHES"]


def _drafting() -> bool:
    return SWITCHES["drafting"]


#: The mask work: what the library adds to sglang-jax.
MASKS: tuple[Patch, ...] = (
    Patch(internals.VERIFY, verify.wrap_verify),
    Patch(internals.SAMPLE, verify.wrap_sample),
    Patch(internals.TOPK, draft.wrap_topk),
    Patch(internals.SELECT, draft.wrap_select),
    Patch(internals.DRAFT, lambda own: draft.wrap_draft_forward(own, _drafting)),
    Patch(internals.EXTEND_DECODE, lambda own: draft.wrap_extend(own, "draft_extend_for_decode")),
    Patch(internals.EXTEND_PREFILL, lambda own: draft.wrap_extend(own, "draft_extend_for_prefill")),
    Patch(internals.BUILD_VERIFY, fused.fused_verify_builder),
    Patch(internals.FUSED_VERIFY, fused.spec_decode_verify),
    Patch(internals.LOGITS, fused.logits_processor),
)

#: Everything the integration patches, the fixes innermost; then what it only reads.
PATCHES: tuple[Patch, ...] = (*FIXES, *MASKS, *(Patch(target) for target in internals.READS))
