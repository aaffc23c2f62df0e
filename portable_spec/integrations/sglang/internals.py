"""sglang's internals as the plugin reads them: the only file of the plugin that names them.

The plugin replaces three functions of sglang:

* ``spec_utils.build_grammar_vocab_mask``, the speculative workers' mask build (EAGLE v2,
  standalone, frozen-KV MTP, multi-layer EAGLE, UNO through ``run_eagle_verify``; NGRAM;
  DFlash and DSpark), also where a worker bound it with ``from ... import`` before the plugin
  was installed;
* ``spec_utils.GrammarTree.from_linear_chain``, wrapped: the trees it makes are marked as
  chains, which the library builds without walking links;
* ``BaseGrammarObject.fill_vocab_mask_batched``, the plain one-row-per-request fill of
  ``SamplingBatchInfo.update_regex_vocab_mask``;

and, in patch sets of their own installed when their worker module is imported (grammar-aware
drafting, :data:`DRAFT_SETS`), eight functions of the EAGLE v2 draft loop and two of the NGRAM
worker, with their own table of source hashes (:data:`DRAFT_SOURCES`).

It relies on sglang's grammar objects as they are at the releases listed below: the fields
and methods of ``XGrammarGrammar`` (``matcher``), ``GuidanceGrammar`` (``ll_matcher``,
``finished``, ``eos_tokens``; a copy is made through its constructor) and
``ReasonerGrammarObject`` (its phase, end tokens and inner grammar), on ``GrammarTree``'s
host tensors, and on sglang's own ``generate_token_bitmask`` and ``traverse_tree``, which
build what the library leaves to sglang. Everything replaced or read is listed in
:data:`TARGETS` and :data:`READS`; each sglang release the plugin knows is one row of
:data:`REVISIONS`: the version sglang reports and the SHA-256 of the source of each of them.
An sglang whose source differs in any of them is not patched: one warning, then sglang's own
code.

To add a release: install it, run ``python -m portable_spec.integrations.sglang.internals``
(it prints this process's sglang version and source hashes), check that the rules of
``grammars.py`` still describe its grammar objects, and add the row.
"""

from __future__ import annotations

import logging
from typing import Any

from portable_spec.integrations.face import engine_version
from portable_spec.integrations.patching import Revision, print_sources, resolve

__all__ = [
    "BUILD",
    "CHAIN",
    "CHAIN_MARK",
    "DISTRIBUTIONS",
    "ENGINE",
    "FILL",
    "PACKAGE",
    "READS",
    "REVISIONS",
    "TARGETS",
    "TRIGGER",
    "generate_token_bitmask",
    "grammar_mask",
    "kind_of",
    "logger",
    "traverse_tree",
    "version",
    "xgrammar_rows",
]

#: A child of sglang's logger: the plugin's lines come out with sglang's format and level.
logger = logging.getLogger("sglang.portable_spec")

#: the engine's name in log lines and errors; the package it imports as; its distribution
ENGINE = "sglang"
PACKAGE = "sglang"
DISTRIBUTIONS = ("sglang",)
_SPEC = "sglang.srt.speculative.spec_utils"
_BASE = "sglang.srt.constrained.base_grammar_backend"
_XGR = "sglang.srt.constrained.xgrammar_backend"
_LLG = "sglang.srt.constrained.llguidance_backend"
_REASONER_MODULE = "sglang.srt.constrained.reasoner_grammar_backend"

#: the speculative workers' mask build (replaced, and rebound where a worker imported it)
BUILD = f"{_SPEC}:build_grammar_vocab_mask"
#: the chain-verify trees' constructor (wrapped: its trees are marked as chains)
CHAIN = f"{_SPEC}:GrammarTree.from_linear_chain"
#: the plain fill (replaced)
FILL = f"{_BASE}:BaseGrammarObject.fill_vocab_mask_batched"
#: every function the plugin replaces
TARGETS = (BUILD, CHAIN, FILL)
#: the module whose import (in the scheduler's process) installs the plugin, from sglang's
#: entry point
TRIGGER = _SPEC

_GENERATE = f"{_SPEC}:generate_token_bitmask"
_TRAVERSE = f"{_SPEC}:traverse_tree"
_XGRAMMAR = f"{_XGR}:XGrammarGrammar"
_GUIDANCE = f"{_LLG}:GuidanceGrammar"
_REASONER = f"{_REASONER_MODULE}:ReasonerGrammarObject"
#: what the plugin reads or calls (recognised by source hash, never replaced): the tree's
#: fields and constructors, sglang's own build (shadow mode; what the library leaves to it),
#: the mask wrapper, the plain fill's caller and entries, and the grammar objects
READS = (
    _GENERATE,
    _TRAVERSE,
    f"{_SPEC}:GrammarTree.__init__",
    f"{_SPEC}:GrammarTree.from_device",
    f"{_SPEC}:GrammarTree.from_host",
    f"{_SPEC}:GrammarTree.resolve",
    f"{_BASE}:GrammarMask",
    f"{_BASE}:GrammarRow",
    "sglang.srt.sampling.sampling_batch_info:SamplingBatchInfo.update_regex_vocab_mask",
    _XGRAMMAR,
    f"{_XGR}:_allocate_token_bitmask",
    _GUIDANCE,
    _REASONER,
)

#: The sglang releases the plugin knows: version prefix and the source hash of every target.
REVISIONS: dict[str, Revision] = {
    "0.5.23": Revision(
        "0.5.23",
        {
            BUILD: "daf0729f28eb1d0ea509c276911cb78c7fa4940a8ad510e50a68a016991908bc",
            CHAIN: "a0e9ff3e86c4809af4e0047b1971c30bdfd1a69e87d2d38749792d6e45e137ee",
            FILL: "f3afe29c6c70b50ea2ca1188723bd060575542707e2f607c7dc0b27fbfba7055",
            _GENERATE: "1ba2d02e64d5e4be749d206b4d451a1164d112aa31a686c278587f0a82404535",
            _TRAVERSE: "ade4b1cee6a7b22bb53eb6e755faca2f2016dda8a5c02fc0b9bc329262ffe116",
            f"{_SPEC}:GrammarTree.__init__": (
                "6513f405aa8b28d2e43eddb836522a88ad590bcf85d09a08d5229cd2bf35bef2"
            ),
            f"{_SPEC}:GrammarTree.from_device": (
                "6c4a9b60f060063ce2491da48fcad2f8b4520c669b53406bbc0ec11ec413b498"
            ),
            f"{_SPEC}:GrammarTree.from_host": (
                "6ed61008398ee35392be1cc0e55b2d0e55d9bf960145489622c48de87978ce58"
            ),
            f"{_SPEC}:GrammarTree.resolve": (
                "b66c4f71ee70d6d542b6806865a34d44ac63b880216bc024b8c923ea17b2a2f1"
            ),
            f"{_BASE}:GrammarMask": (
                "db3885dcf902951722429f569a52a25f0a4d944e95c37dfc611de1800aa0156c"
            ),
            f"{_BASE}:GrammarRow": (
                "d3ed817d1b171f69619e6fd8f0848b55914cc7789d2abeef7900011e3e316925"
            ),
            "sglang.srt.sampling.sampling_batch_info:SamplingBatchInfo.update_regex_vocab_mask": (
                "2e03a7b8cf9993c92a51b5867edb07a225916ef708ba5836e3a13d37ed00cbaa"
            ),
            _XGRAMMAR: "bbfb81afa55b294da951ddd443e6026f7a769951fcb6619ca971811478941482",
            f"{_XGR}:_allocate_token_bitmask": (
                "13e33bd5819e63c982489ee9a2db483e491ff5d86910f99d48bb9ea84aaf0286"
            ),
            _GUIDANCE: "94ba69c244ba271300ef7588441470a87e6ef95abbb18ec9d4889ed6c46c4780",
            _REASONER: "1c0088a5ae7b97d46fddbf3a04847c14e620f1555137fcf33d079620e8b886bf",
        },
    )
}


def version() -> str | None:
    """The installed sglang's version (its distribution's metadata: nothing is imported), or
    None without sglang."""
    return engine_version(PACKAGE, DISTRIBUTIONS)


# -- what the plugin calls of sglang's own (the modules are imported once it is installed) ----


def generate_token_bitmask(*args: Any) -> Any:
    """sglang's own ``generate_token_bitmask(reqs, next_token, next_sibling, draft, vocab)``:
    ``(host mask or None, the last grammar)``."""
    return resolve(_GENERATE)[2](*args)


def traverse_tree(*args: Any, **kwargs: Any) -> None:
    """sglang's own ``traverse_tree`` of one request into its rows."""
    resolve(_TRAVERSE)[2](*args, **kwargs)


def grammar_mask(grammar: Any, mask: Any) -> Any:
    """sglang's ``GrammarMask(grammar, vocab_mask)``."""
    return resolve(f"{_BASE}:GrammarMask")[2](grammar, mask)


#: the attribute the chain constructor's wrapper sets on the trees it returns
CHAIN_MARK = "_portable_spec_chain"

# -- the grammar objects ----------------------------------------------------------------------

XGRAMMAR, GUIDANCE, REASONER = "xgrammar", "guidance", "reasoner"
_KINDS = {
    ("sglang.srt.constrained.xgrammar_backend", "XGrammarGrammar"): XGRAMMAR,
    ("sglang.srt.constrained.llguidance_backend", "GuidanceGrammar"): GUIDANCE,
    ("sglang.srt.constrained.reasoner_grammar_backend", "ReasonerGrammarObject"): REASONER,
}
_kind_cache: dict[type, str | None] = {}


def kind_of(grammar: Any) -> str | None:
    """:data:`XGRAMMAR`, :data:`GUIDANCE` or :data:`REASONER` for sglang's grammar objects of
    exactly those classes, None for any other object (subclasses included: their overrides
    are unknown)."""
    cls = type(grammar)
    try:
        return _kind_cache[cls]
    except KeyError:
        kind = _KINDS.get((cls.__module__, cls.__qualname__))
        _kind_cache[cls] = kind
        return kind


def xgrammar_matcher(grammar: Any) -> Any:
    """An ``XGrammarGrammar``'s ``xgrammar.GrammarMatcher``."""
    return grammar.matcher


_classes: dict[str, Any] = {}


def xgrammar_rows(entries: Any, words: int) -> tuple[list[int], list[Any], list[Any]]:
    """Split the plain fill's ``GrammarRow`` entries: the rows and ``xgrammar.GrammarMatcher``
    of the ``XGrammarGrammar`` objects (exactly that class) whose vocabulary fills ``words``
    words, and the other entries. One pass, a few attribute reads per entry."""
    cls = _classes.get(_XGRAMMAR)
    if cls is None:
        cls = _classes.setdefault(_XGRAMMAR, resolve(_XGRAMMAR)[2])
    rows: list[int] = []
    matchers: list[Any] = []
    rest: list[Any] = []
    for entry in entries:
        grammar = entry.grammar
        if type(grammar) is cls and (grammar.vocab_size + 31) >> 5 == words:
            rows.append(entry.row)
            matchers.append(grammar.matcher)
        else:
            rest.append(entry)
    return rows, matchers, rest


def xgrammar_vocab_size(grammar: Any) -> int:
    """The vocabulary an ``XGrammarGrammar``'s matcher was made for (the model's)."""
    return int(grammar.vocab_size)


def guidance_parts(grammar: Any) -> tuple[Any, bool, Any]:
    """A ``GuidanceGrammar``'s ``(llguidance.LLMatcher, finished, end tokens)``: sglang ends
    the grammar (``finished``) on an end token consumed by a matcher that had stopped, and
    otherwise gives every token, end tokens included, to the matcher."""
    return grammar.ll_matcher, bool(grammar.finished), grammar.eos_tokens


def guidance_words(grammar: Any) -> int:
    """The width in words of the masks a ``GuidanceGrammar`` allocates (its tokenizer's)."""
    return (int(grammar.llguidance_tokenizer.vocab_size) + 31) // 32


def guidance_copy(grammar: Any) -> Any:
    """A ``GuidanceGrammar`` in the same state on a copy of its matcher (sglang's own methods
    then replay a path on it without moving the original)."""
    copy = type(grammar)(
        grammar.llguidance_tokenizer,
        grammar.serialized_grammar,
        ll_matcher=grammar.ll_matcher.deep_copy(),
    )
    copy.finished = grammar.finished
    return copy


def reasoner_parts(grammar: Any) -> dict[str, Any]:
    """A ``ReasonerGrammarObject``'s state as the plugin's rules read it (nothing moves)."""
    return {
        "inner": grammar.grammar,
        "thinking": bool(grammar._is_thinking()),
        "answering": bool(grammar._is_generation()),
        "grammar_covers_reasoning": bool(grammar.reasoning_in_grammar),
        "token_filter": bool(grammar.enable_token_filter),
        "end_ids": tuple(grammar.think_end_ids),
        "end_matched": int(grammar._matched_think_end_tokens),
    }


def allocate_rows(grammar: Any, vocab_size: int, rows: int) -> Any:
    """Host rows as sglang allocates them for a step whose first grammar is ``grammar``."""
    return grammar.allocate_vocab_mask(vocab_size=vocab_size, batch_size=rows, device="cpu")


def allocates_bitmask(grammar: Any, words: int) -> bool:
    """Whether ``grammar`` allocates int32 bitmask rows of ``words`` words (one row is
    allocated to see)."""
    import torch

    try:
        row = allocate_rows(grammar, 32 * words, 1)
    except Exception:
        return False
    return (
        isinstance(row, torch.Tensor)
        and row.dtype == torch.int32
        and tuple(row.shape) == (1, words)
    )


# -- grammar-aware drafting (patch sets of their own: .drafting, .eagle_draft, .ngram) ----------

_EAGLE = "sglang.srt.speculative.eagle_worker_v2"
_NGRAM = "sglang.srt.speculative.ngram_worker"
#: the EAGLE v2 worker's step (the grammar barrier moved before drafting)
EAGLE_STEP = f"{_EAGLE}:EAGLEWorkerV2.forward_batch_generation"
#: the EAGLE v2 draft (the session opened, the root's top-k masked)
EAGLE_DRAFT = f"{_EAGLE}:EagleDraftWorker.draft"
#: the EAGLE v2 draft loop (each level's logits masked; the verify tree staged)
EAGLE_DRAFT_FORWARD = f"{_EAGLE}:EagleDraftWorker.draft_forward"
#: the draft loop's node picking, as the draft worker module binds it
EAGLE_SELECT = f"{_EAGLE}:select_top_k_tokens"
#: the draft extends whose logits the next root's top-k comes from
EAGLE_EXTEND_DECODE = f"{_EAGLE}:EagleDraftWorker._draft_extend_for_decode"
EAGLE_EXTEND_PREFILL = f"{_EAGLE}:EagleDraftWorker._draft_extend_for_prefill"
#: the verify tree's choice among the candidates (ties broken towards the parent)
EAGLE_ORGANIZE = f"{_EAGLE}:organize_draft_results"
#: the draft decode's CUDA graph (not replayed while a session drafts)
EAGLE_DRAFT_GRAPH = (
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner:EAGLEDraftCudaGraphRunner.can_run_graph"
)
#: the NGRAM worker's draft trees, from its corpus (refused nodes replaced)
NGRAM_PREPARE = f"{_NGRAM}:NGRAMWorker._prepare_draft_tokens"
#: the NGRAM step (its result read at the next step: forced tokens accepted)
NGRAM_STEP = f"{_NGRAM}:NGRAMWorker.forward_batch_generation"
EAGLE_TARGETS = (
    EAGLE_STEP,
    EAGLE_DRAFT,
    EAGLE_DRAFT_FORWARD,
    EAGLE_SELECT,
    EAGLE_EXTEND_DECODE,
    EAGLE_EXTEND_PREFILL,
    EAGLE_ORGANIZE,
    EAGLE_DRAFT_GRAPH,
)
NGRAM_TARGETS = (NGRAM_PREPARE, NGRAM_STEP)
_EAGLE_TOPK = f"{_EAGLE}:fast_topk"
_EAGLE_PROBS = f"{_EAGLE}:renorm_draft_probs"
#: read, not replaced: the draft loop's top-k and probabilities (the root's top-k is taken
#: again with them)
EAGLE_READS = (_EAGLE_TOPK, _EAGLE_PROBS)
#: read, not replaced: the NGRAM worker's use of its trees and its tree-mask format's reader
NGRAM_READS = (
    f"{_NGRAM}:NGRAMWorker._prepare_for_speculative_decoding",
    f"{_NGRAM}:_derive_tree_links",
)
#: the drafting patch sets: name -> (the module whose import installs it, targets, reads)
DRAFT_SETS = {
    "EAGLE drafting": (_EAGLE, EAGLE_TARGETS, EAGLE_READS),
    "NGRAM drafting": (_NGRAM, NGRAM_TARGETS, NGRAM_READS),
}

#: the source hash of every drafting target and read, per sglang release
DRAFT_SOURCES: dict[str, dict[str, str]] = {
    "0.5.23": {
        EAGLE_STEP: "e41ad8d8053cf2c0dcde7ffd41140afd92c11081fe7745af38336aa225593f84",
        EAGLE_DRAFT: "bc895b907be4e337d61ef7adc700a144bbbad2781d3af057dc8c5163be2108d9",
        EAGLE_DRAFT_FORWARD: "e1dc83274e26941e2716cbd0e112cabe05a4ae1e02490fd7447358b16bc9661e",
        EAGLE_SELECT: "042cc9d58cf2b4be95a8d4b5055c31a48c93f5bfdeaa935f4ff7c8cf81279f6b",
        EAGLE_EXTEND_DECODE: "43fac9eb9ad0ac5e727ea719ca861f4bcb3d8e78aa310c370a5d9fd203a6eaa6",
        EAGLE_EXTEND_PREFILL: "3189eb126ef534d395191094af233edb11f7abfc4e1c301401074a17b2cfc227",
        EAGLE_ORGANIZE: "6ab14180a2850075afce961d2146a5608e5b9d6300852de7760860b241532698",
        EAGLE_DRAFT_GRAPH: "e04ca2fad3674b1193cb6bc25a7a3c9bef1395996a8d49fc1944a721d324d319",
        _EAGLE_TOPK: "9f726d9c84d83fa4bffe4f83b7d463306be771c8e40ed44bfb7b0ed8e1970fb4",
        _EAGLE_PROBS: "0962a891a575fe7d0c9f8c956bbd6b98bb4c300106a5cd3fdad5e24814b0f8cf",
        NGRAM_PREPARE: "2f429d144dc2d6f1c8d40288823a509ffb9d4ade872d8db2b9b24b044108fb8d",
        NGRAM_STEP: "62a0fa9f388804a727d05eedb0a4e2c4dadf255e5e31f6c091ae233a8f0d35b1",
        f"{_NGRAM}:NGRAMWorker._prepare_for_speculative_decoding": (
            "7417a9ce177df7756643c4efbb5558b1c2821833fc9d4da873d8ca75f533bc16"
        ),
        f"{_NGRAM}:_derive_tree_links": (
            "dfffb60c87edad61a2d44065a46aaa80e75a3c3b724415fe6289a247dd9a2e91"
        ),
    }
}


def draft_revisions(listed: tuple[str, ...]) -> dict[str, Revision]:
    """The known releases as a drafting patch set over ``listed`` recognises them: each
    release's hashes of those targets and reads."""
    return {
        label: Revision(label, {t: sources[t] for t in listed})
        for label, sources in DRAFT_SOURCES.items()
    }


def draft_module(name: str) -> str:
    """The sglang module whose import installs the drafting patch set ``name``."""
    return DRAFT_SETS[name][0]


def ngram_tokenizer(worker: Any) -> Any:
    """The model's tokenizer as an ``NGRAMWorker``'s target worker holds it (None without)."""
    return getattr(worker._target_worker, "tokenizer", None)


def ngram_device(worker: Any) -> Any:
    """The ``torch.device`` an ``NGRAMWorker``'s verify runs on."""
    import torch

    return torch.device(worker.device)


def request_grammar(req: Any) -> Any:
    """A scheduled request's grammar object (None without one)."""
    return req.grammar


def request_id(req: Any) -> str:
    """A scheduled request's id."""
    return req.rid


def has_grammar_request(batch: Any) -> bool:
    """Whether a request of the batch has a grammar."""
    return any(req.grammar is not None for req in batch.reqs)


def decode_with_grammar(batch: Any) -> bool:
    """Whether ``batch`` is a decode batch (not idle) with a grammar request."""
    mode = batch.forward_mode
    return bool(batch.has_grammar) and mode.is_decode() and not mode.is_idle()


def draft_probs_needed(sampling_info: Any) -> bool:
    """Whether the draft loop keeps draft probabilities (rejection sampling, non-greedy)."""
    from sglang.srt.runtime_context import get_spec

    return bool(get_spec().speculative_use_rejection_sampling) and not sampling_info.is_all_greedy


def draft_probs(logits: Any, sampling_info: Any) -> Any:
    """sglang's draft distribution over ``logits`` (``renorm_draft_probs``, greedy draft)."""
    return resolve(_EAGLE_PROBS)[2](logits, sampling_info, False)


def eagle_topk(probs: Any, topk: int) -> tuple[Any, Any]:
    """sglang's ``fast_topk(probs, topk, dim=-1)``: ``(values, indices)``."""
    return resolve(_EAGLE_TOPK)[2](probs, topk, dim=-1)


if __name__ == "__main__":  # the row of REVISIONS this process's sglang would need
    print_sources(ENGINE, version(), (*TARGETS, *READS))
    for _module, targets, reads in DRAFT_SETS.values():
        print_sources(ENGINE, version(), (*targets, *reads))
