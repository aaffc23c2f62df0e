"""What the sglang plugin replaces, in stacking order (each target named in
:mod:`.internals`, its replacement made in the module of its job), and what it only reads."""

from __future__ import annotations

from portable_spec.integrations.patching import Patch
from portable_spec.integrations.sglang import eagle_draft, internals, ngram
from portable_spec.integrations.sglang.masks import build_replacement, chain_replacement
from portable_spec.integrations.sglang.plain import fill_replacement

__all__ = ["PATCHES", "drafting_patches"]

PATCHES: tuple[Patch, ...] = (
    # rebound: the speculative workers bind it with ``from spec_utils import ...``
    Patch(internals.BUILD, build_replacement, rebind=True),
    Patch(internals.CHAIN, chain_replacement),
    Patch(internals.FILL, fill_replacement),
    *(Patch(target) for target in internals.READS),
)


def drafting_patches() -> dict[str, tuple[Patch, ...]]:
    """The drafting patch sets (:data:`.internals.DRAFT_SETS`), each installed when its worker
    module is imported (:mod:`.draft_sets`): name -> its patches, then its reads."""
    makers = {
        internals.NGRAM_PREPARE: ngram.wrap_prepare,
        internals.NGRAM_STEP: ngram.wrap_step,
        internals.EAGLE_STEP: eagle_draft.wrap_forward_batch_generation,
        internals.EAGLE_DRAFT: eagle_draft.wrap_draft,
        internals.EAGLE_DRAFT_FORWARD: eagle_draft.wrap_draft_forward,
        internals.EAGLE_SELECT: eagle_draft.wrap_select,
        internals.EAGLE_EXTEND_DECODE: eagle_draft.wrap_extend,
        internals.EAGLE_EXTEND_PREFILL: eagle_draft.wrap_extend,
        internals.EAGLE_ORGANIZE: eagle_draft.wrap_organize,
        internals.EAGLE_DRAFT_GRAPH: eagle_draft.wrap_can_run_graph,
    }
    return {
        name: (
            *(Patch(target, makers[target]) for target in targets),
            *(Patch(target) for target in reads),
        )
        for name, (_module, targets, reads) in internals.DRAFT_SETS.items()
    }
