"""portable_spec: grammar bitmasks over speculative-decoding verify trees, on any backend.

Typical step of a speculative engine::

    import portable_spec as ps

    tree = ps.GrammarTree.from_device(next_token, next_sibling, draft_tokens)  # after drafting
    launch_verify_forward(...)                                                  # async
    mask = ps.build_grammar_vocab_mask(matchers, tree, vocab_size)              # overlaps it
    logits = ps.apply_vocab_mask(logits, mask)

Drafters that grow their tree level by level mask their own logits with a
:class:`DraftSession` (one grammar state per node, the verify mask from the same rows);
drafters whose drafts reach the host extend them by what the grammar forces with
:func:`forced_drafts`.

Importing this package imports numpy only: torch, JAX and xgrammar are used when the caller
hands over their objects (or asks for a backend by name).

The machinery behind these names is importable from its own module: writing a backend
(:mod:`portable_spec.backend`: ``Backend``, ``ArrayInfo``, ``MaskLayout``, ``StagedArrays``;
:mod:`portable_spec.hostbuffers`: ``HostBufferPool``; :mod:`portable_spec.registry`:
``backend_for``), draft-tree helpers (:mod:`portable_spec.drafting`: ``forced_tokens``,
``graft_chain``, ``links_from_parents``) and grammar timing (:mod:`portable_spec.stats`).
"""

from portable_spec.api import apply_vocab_mask, build_grammar_vocab_mask
from portable_spec.builder import build_host_bitmask
from portable_spec.builder.reasoning import Reasoning
from portable_spec.chains import build_chain_bitmask
from portable_spec.drafting import DraftSession, forced_drafts
from portable_spec.errors import MatcherError
from portable_spec.grammars import GrammarMatcherLike
from portable_spec.masks import MAX_VOCAB_SIZE, CompactMask
from portable_spec.pending import PendingMask
from portable_spec.pool import get_num_threads, set_num_threads
from portable_spec.registry import available_backends, get_backend, register_backend
from portable_spec.stats import grammar_stats
from portable_spec.tree import GrammarTree

__version__ = "0.1.0"

__all__ = [
    "MAX_VOCAB_SIZE",
    "CompactMask",
    "DraftSession",
    "GrammarMatcherLike",
    "GrammarTree",
    "MatcherError",
    "PendingMask",
    "Reasoning",
    "apply_vocab_mask",
    "available_backends",
    "build_chain_bitmask",
    "build_grammar_vocab_mask",
    "build_host_bitmask",
    "forced_drafts",
    "get_backend",
    "get_num_threads",
    "grammar_stats",
    "register_backend",
    "set_num_threads",
]
