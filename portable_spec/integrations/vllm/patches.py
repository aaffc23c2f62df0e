"""What the vLLM plugin replaces, in stacking order (each target named in
:mod:`.internals`, its replacement made in the module of its job), and what it only reads."""

from __future__ import annotations

from portable_spec.integrations.patching import Patch
from portable_spec.integrations.vllm import internals
from portable_spec.integrations.vllm.bitmask import replacement
from portable_spec.integrations.vllm.drafts import make_output, make_update

__all__ = ["PATCHES"]

PATCHES: tuple[Patch, ...] = (
    Patch(internals.GRAMMAR_BITMASK, replacement),
    Patch(internals.UPDATE_DRAFTS, make_update),
    Patch(internals.UPDATE_FROM_OUTPUT, make_output),
    *(Patch(target) for target in internals.READS),
)
