"""What the tpu-inference integration replaces, in stacking order (each target named in
:mod:`.internals`, its replacement made in :mod:`.runner`), and what it only reads."""

from __future__ import annotations

from portable_spec.integrations.patching import Patch
from portable_spec.integrations.tpu_inference import internals
from portable_spec.integrations.tpu_inference.runner import (
    decode_replacement,
    prepare_replacement,
    sample_tokens_replacement,
)

__all__ = ["PATCHES"]

PATCHES: tuple[Patch, ...] = (
    Patch(internals.SAMPLE_TOKENS, sample_tokens_replacement),
    Patch(internals.PREPARE, prepare_replacement),
    Patch(internals.DECODE, decode_replacement),
    *(Patch(target) for target in internals.READS),
)
