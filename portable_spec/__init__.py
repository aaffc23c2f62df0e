"""portable_spec: grammar bitmasks over speculative-decoding verify trees, on any backend.

Typical step of a speculative engine::

    import portable_spec as ps

    tree = ps.GrammarTree.from_device(next_token, next_sibling, draft_tokens)  # after drafting
    launch_verify_forward(...)                                                  # async
    mask = ps.build_grammar_vocab_mask(matchers, tree, vocab_size)              # overlaps it
    logits = ps.apply_vocab_mask(logits, mask)

Drafters that grow their tree level by level mask their own logits with a
:class:`DraftSession` (one grammar state per node, the verify mask from the same rows).

Importing this package imports numpy only: torch, JAX and xgrammar are used when the caller
hands over their objects (or asks for a backend by name).
"""

from portable_spec.api import apply_vocab_mask, build_grammar_vocab_mask
from portable_spec.backend import ArrayInfo, Backend, MaskLayout, StagedArrays
from portable_spec.builder import build_host_bitmask
from portable_spec.builder.reasoning import Reasoning
from portable_spec.drafting import DraftSession, forced_tokens, graft_chain, links_from_parents
from portable_spec.errors import MatcherError
from portable_spec.grammars import GrammarMatcherLike
from portable_spec.hostbuffers import HostBuffer, HostBufferPool
from portable_spec.masks import CompactMask
from portable_spec.pending import PendingMask
from portable_spec.pool import get_num_threads, set_num_threads
from portable_spec.registry import available_backends, backend_for, get_backend, register_backend
from portable_spec.stats import (
    get_slow_grammar_threshold,
    grammar_stats,
    reset_grammar_stats,
    set_slow_grammar_threshold,
)
from portable_spec.tree import GrammarTree

__version__ = "0.1.0"

__all__ = [
    "ArrayInfo",
    "Backend",
    "CompactMask",
    "DraftSession",
    "GrammarMatcherLike",
    "GrammarTree",
    "HostBuffer",
    "HostBufferPool",
    "MaskLayout",
    "MatcherError",
    "PendingMask",
    "Reasoning",
    "StagedArrays",
    "apply_vocab_mask",
    "available_backends",
    "backend_for",
    "build_grammar_vocab_mask",
    "build_host_bitmask",
    "forced_tokens",
    "get_backend",
    "get_num_threads",
    "get_slow_grammar_threshold",
    "graft_chain",
    "grammar_stats",
    "links_from_parents",
    "register_backend",
    "reset_grammar_stats",
    "set_num_threads",
    "set_slow_grammar_threshold",
]
