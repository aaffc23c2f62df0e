"""What the sglang plugin replaces, in stacking order (each target named in
:mod:`.internals`, its replacement made in the module of its job), and what it only reads."""

from __future__ import annotations

from portable_spec.integrations.patching import Patch
from portable_spec.integrations.sglang import internals
from portable_spec.integrations.sglang.masks import build_replacement, chain_replacement
from portable_spec.integrations.sglang.plain import fill_replacement

__all__ = ["PATCHES"]

PATCHES: tuple[Patch, ...] = (
    # rebound: the speculative workers bind it with ``from spec_utils import ...``
    Patch(internals.BUILD, build_replacement, rebind=True),
    Patch(internals.CHAIN, chain_replacement),
    Patch(internals.FILL, fill_replacement),
    *(Patch(target) for target in internals.READS),
)
