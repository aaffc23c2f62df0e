"""sglang-jax integration: grammar masks on its speculative verify (EAGLE, EAGLE3, NEXTN; trees
and chains), built by portable_spec while the target forward runs.

Off by default. Two ways to switch it on:

* ``install()`` patches sglang-jax in the calling process (tests, an engine run in-process);
* ``PORTABLE_SPEC_SGLANG_JAX=1`` in the environment of an sglang-jax launch, with the library
  installed in sglang-jax's environment: the ``portable_spec_sglang_jax.pth`` file the library
  ships runs :mod:`portable_spec.integrations.sglang_jax_hook` in every Python process, which
  imports nothing while the variable is unset and otherwise installs the patches when
  sglang-jax creates its scheduler (in whichever process it spawns for it).

What is patched (sglang-jax commit ``cddbf6f1``; any other revision of the patched functions
is recognised by their source, logged in one line, and left running sglang-jax's own code):

* ``BaseSpecWorker.verify``: the draft tree (``retrive_next_token``, ``retrive_next_sibling``,
  ``draft_token``) is staged to the host (``GrammarTree.from_device``: an on-device copy, then
  ``copy_to_host_async``) before the target verify forward is launched, and its mask is built
  on the library's background thread while the forward runs;
* ``EagleVerifyInput.sample``: the mask is applied to the verify logits before greedy
  verification or rejection sampling (requests without a grammar keep their logits), and the
  committed tokens of a tree are the accepted path's (sglang-jax reads ``predict``'s first
  slots, right for chains only); called on its own, ``sample`` stages and builds the mask
  itself;
* ``GuidanceGrammar.accept_token``: a step's list of accepted tokens advances the matcher
  token by token, exactly as far as verify accepted;
* ``overlap_utils.resolve_spec_decode_token_ids``: a grammar that ends inside a step's accepted
  path (its end token) ends the request there; the tokens after it are dropped;
* ``BaseGrammarBackend.get_cached_or_future_value``: every request gets a grammar object of
  its own (sglang-jax hands one cached or compiling object to every request with the same
  grammar, whose matcher then advances for all of them);
* ``ModelWorkerSamplingInfo.update_grammar_vocab_mask`` (sglang-jax's one-row-per-request mask
  of non-speculative steps, the prefill of a speculative run): rows of requests without a
  grammar are all-allowed (sglang-jax leaves them zero, or stale from an earlier batch, so such
  a request batched with grammar requests could only sample a token from nowhere), and the
  mask is a private copy (sglang-jax refills one buffer per grammar object for every batch,
  which the previous batch's device mask may still alias on JAX's CPU backend);
* the EAGLE draft loop (``EagleDraftWorker.draft_forward``, its draft extends,
  ``topk_probs_from_logits``, ``select_top_k_tokens``): grammar-aware drafting through a
  :class:`portable_spec.DraftSession` (:mod:`._sglang_jax_draft`; ``set_drafting``);
* the overlap schedule's fused verify (``draft_extend_fused._build_verify`` and
  ``spec_decode_verify``, ``LogitsProcessor.__call__``, ``Scheduler.run_batch``): the mask is
  a static-shape input of the jitted step, and a step with grammar requests waits for the
  previous step's tokens to reach the grammars (:mod:`._sglang_jax_fused`).

Bad input never crashes a step: a grammar the library refuses, or a tree it finds malformed,
leaves that request on sglang-jax's own (unmasked) verify for the step, with one log line;
the library refuses before any matcher moves.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from portable_spec.integrations._sglang_jax_draft import (
    wrap_draft_forward,
    wrap_extend,
    wrap_select,
    wrap_topk,
)
from portable_spec.integrations._sglang_jax_fused import (
    fused_verify_builder,
    logits_processor,
    run_batch,
    spec_decode_verify,
)
from portable_spec.integrations._sglang_jax_grammar import (
    accept_tokens,
    own_grammar_objects,
    truncate_at_grammar_end,
)
from portable_spec.integrations._sglang_jax_masks import (
    JOB_ATTR,
    MaskJob,
    active_matcher,
    apply_mask,
    commit_accepted,
    slot_grammars,
    start_mask,
)

__all__ = [
    "ENV_VAR",
    "KNOWN_SOURCES",
    "enabled_by_env",
    "install",
    "installed",
    "integration_stats",
    "reset_stats",
    "set_drafting",
    "set_timing",
    "uninstall",
]

ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX"
TIMING_ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX_TIMING"
DRAFTING_ENV_VAR = "PORTABLE_SPEC_SGLANG_JAX_DRAFTING"

logger = logging.getLogger("sgl_jax.portable_spec")

#: The functions the integration replaces or wraps, by ``module:qualname``, with the SHA-256
#: of their source at each sglang-jax revision the integration knows. A function whose source
#: differs means an unknown revision: nothing is patched.
_VERIFY = "sgl_jax.srt.speculative.base_worker:BaseSpecWorker.verify"
_SAMPLE = "sgl_jax.srt.speculative.eagle_info:EagleVerifyInput.sample"
_ACCEPT = "sgl_jax.srt.constrained.llguidance_backend:GuidanceGrammar.accept_token"
_RESOLVE = "sgl_jax.srt.speculative.overlap_utils:resolve_spec_decode_token_ids"
_DRAFT_MODULE = "sgl_jax.srt.speculative.eagle_draft_worker"
_TOPK = f"{_DRAFT_MODULE}:topk_probs_from_logits"
_SELECT = f"{_DRAFT_MODULE}:select_top_k_tokens"
_DRAFT = f"{_DRAFT_MODULE}:EagleDraftWorker.draft_forward"
_EXTEND_DECODE = f"{_DRAFT_MODULE}:EagleDraftWorker.draft_extend_for_decode"
_EXTEND_PREFILL = f"{_DRAFT_MODULE}:EagleDraftWorker.draft_extend_for_prefill"
_GRAMMAR_CACHE = (
    "sgl_jax.srt.constrained.base_grammar_backend:BaseGrammarBackend.get_cached_or_future_value"
)
_BATCH_MASK = (
    "sgl_jax.srt.managers.schedule_batch:ModelWorkerSamplingInfo.update_grammar_vocab_mask"
)

_DRAFTING = [_TOPK, _SELECT, _DRAFT, _EXTEND_DECODE, _EXTEND_PREFILL]
_RUN_BATCH = "sgl_jax.srt.managers.scheduler:Scheduler.run_batch"
_BUILD_VERIFY = "sgl_jax.srt.speculative.draft_extend_fused:_build_verify"
_FUSED_VERIFY = "sgl_jax.srt.speculative.draft_extend_fused:spec_decode_verify"
_LOGITS = "sgl_jax.srt.layers.logits_processor:LogitsProcessor.__call__"
_OVERLAP = [_RUN_BATCH, _BUILD_VERIFY, _FUSED_VERIFY, _LOGITS]

KNOWN_SOURCES: dict[str, dict[str, str]] = {
    "cddbf6f1": {
        _VERIFY: "541dcc18d886bc7bebac8e13989400a19b6b64db44bbe5106859bea99dccdb05",
        _SAMPLE: "01b1b99d1f05fdef854ca55c69f1101e8cbf16a3768039c2924dd5ede4eec61e",
        _ACCEPT: "284b5f597b9ef74cfb0fcc53f765b6387806ff1665d912efab0f1bc4fd777111",
        _RESOLVE: "29ff3731e1a69bca5b51b38d756f411b751cc543ead84ac1d477290b96151ced",
        _GRAMMAR_CACHE: "565b795a95b324bb81ed94b60a3b2be83b2389f86db0b191b5b4730c7c0edd31",
        _BATCH_MASK: "f963ef18e10c8ee8dd9a799ce37bf5bbeaf681d16b23505e9676ed2ba33bcf93",
        _TOPK: "b1ef7b9a0eba0786d390ebf5b990347f5b8c3df3a77e443be9f5248a7daf3f68",
        _SELECT: "3b887b12dd35c660a747452f285d9add72299688e90b30e1375106ed0ab09166",
        _DRAFT: "5ff3fac7cd7c1c2b56184383417cad79c60ae8a83b065bc002e0a8b3d295ee6d",
        _EXTEND_DECODE: "e9bcbd3ac6e684392e9a91441757a6879b049fe17887567ab0b693ed6f9ec924",
        _EXTEND_PREFILL: "99d6a281f6a31f1e18ec62908abff2880d9cfc2e6eb1ad65de7b160a1f523df7",
        _RUN_BATCH: "6b98849c88691ce1638cccafe764f201bdcbc4f04255182214297b8575031d46",
        _BUILD_VERIFY: "82a66ae915e3ded259e5b34ca267c15adaaa3ac5127c5b4d4ed2b56a7336c57b",
        _FUSED_VERIFY: "4378280faa8cccff80a0173a57e39b659e3c2f0da7b60bf8e445a572faa9fb20",
        _LOGITS: "5c35a2eab05d7b360e74418c77c2768a7a5e34aa4bb18d7402cf3e18edd8baa9",
    }
}

_lock = threading.Lock()
_patches: dict[str, tuple[Any, str, Any]] = {}  # key -> (owner, attribute, original)
_timing = {"on": os.environ.get(TIMING_ENV_VAR, "") not in ("", "0")}
_drafting = {"on": os.environ.get(DRAFTING_ENV_VAR, "1").strip().lower() not in ("0", "off", "no")}


def _new_stats() -> dict[str, Any]:
    return {
        "verify_steps": 0,
        "grammar_steps": 0,  # verify steps with a grammar request in the batch
        "masked_steps": 0,
        "masked_rows": 0,
        "refused_requests": 0,
        "grammar_ends": 0,
        "accepted_tokens": 0,  # tokens committed for constrained requests (bonus included)
        "constrained_verifies": 0,  # (request, step) pairs behind accepted_tokens
        "waited_s": [],  # per masked step: time sample() waited for the build
        "exposed_s": [],  # timing mode: mask time not hidden behind the target forward
        "step_s": [],  # timing mode: verify() wall time of the masked steps
        "fused_steps": 0,  # overlap schedule: fused verify steps with a grammar request
        "fused_build_s": [],  # their mask's staging and build, before the launch
    }


_stats = _new_stats()


def enabled_by_env() -> bool:
    """Whether ``PORTABLE_SPEC_SGLANG_JAX`` asks for the integration (``1``, ``on``, ``true``,
    ``yes``); unset, empty, ``0``, ``off`` mean no."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return value not in ("", "0", "off", "false", "no")


def installed() -> bool:
    """Whether the patches are in place in this process."""
    return bool(_patches)


def reset_stats() -> None:
    """Forget this process's counters and timings."""
    global _stats
    with _lock:
        _stats = _new_stats()


def integration_stats() -> dict[str, Any]:
    """A snapshot of this process's counters: ``verify_steps`` (patched verifies run),
    ``grammar_steps`` (those with a grammar request), ``masked_steps`` and ``masked_rows``
    (steps and mask rows built; the fused steps of the overlap schedule included),
    ``refused_requests`` (requests left unmasked for a step), ``grammar_ends`` (requests
    whose grammar ended inside a step's accepted path), ``accepted_tokens`` and
    ``constrained_verifies`` (tokens committed per constrained request and step, bonus
    included), and the lists ``waited_s`` (per masked step, seconds ``sample`` waited for the
    build), ``exposed_s`` and ``step_s`` (timing mode only: mask time not hidden behind the
    target forward, and the step's verify time). Never blocks on the device."""
    with _lock:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in _stats.items()}


def set_drafting(on: bool) -> None:
    """Grammar-aware drafting on (the default; also ``PORTABLE_SPEC_SGLANG_JAX_DRAFTING=0``
    for off): the EAGLE draft loop's logits are masked through a ``DraftSession``, so the
    drafts of grammar requests are tokens their grammar allows. Off: sglang-jax's own drafts
    (the verify masks are applied either way)."""
    _drafting["on"] = bool(on)


def set_timing(on: bool) -> None:
    """Timing mode (also ``PORTABLE_SPEC_SGLANG_JAX_TIMING=1``): each masked step also waits
    for the verify logits to measure how much of the mask build the forward did not hide.
    The extra wait happens only after the mask is ready; it is for measurements, not for
    production."""
    _timing["on"] = bool(on)


# -- source fingerprints -----------------------------------------------------------------------
def _resolve(key: str) -> tuple[Any, str, Any]:
    """``module:Qual.name`` -> (owner object, attribute name, current value)."""
    import importlib

    module_name, qualname = key.split(":")
    owner: Any = importlib.import_module(module_name)
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1], getattr(owner, parts[-1])


def source_hash(function: Any) -> str:
    """SHA-256 of a function's source text (``inspect.getsource``)."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def _revision(keys: list[str]) -> tuple[str | None, str]:
    """The known revision whose sources all the ``keys`` match, or ``(None, why not)``."""
    hashes = {}
    for key in keys:
        try:
            _, _, value = _resolve(key)
            hashes[key] = source_hash(getattr(value, "_portable_spec_original", value))
        except Exception as exc:  # missing module, attribute or source
            return None, f"{key}: {type(exc).__name__}: {exc}"
    for revision, known in KNOWN_SOURCES.items():
        if all(known.get(k) == h for k, h in hashes.items()):
            return revision, ""
    known = KNOWN_SOURCES.values()
    differing = [k for k, h in hashes.items() if all(h != each.get(k) for each in known)]
    return None, "source differs: " + ", ".join(differing)


# -- install -----------------------------------------------------------------------------------
def install() -> bool:
    """Patch sglang-jax in this process (idempotent). Returns whether the patches are in place:
    ``False`` for an sglang-jax whose patched functions the integration does not know (one
    warning line; sglang-jax's own code keeps running) or that is not installed."""
    with _lock:
        if _patches:
            return True
        keys = [_VERIFY, _SAMPLE, _ACCEPT, _RESOLVE, _GRAMMAR_CACHE, _BATCH_MASK]
        keys += [*_DRAFTING, *_OVERLAP]
        revision, why = _revision(keys)
        if revision is None:
            logger.warning(
                "portable_spec: this sglang-jax is not a revision the integration knows (%s); "
                "its own speculative verify runs, without grammar masks",
                why,
            )
            return False
        _patch(_VERIFY, _verify)
        _patch(_SAMPLE, _sample)
        _patch(_ACCEPT, _accept_token)
        _patch(_RESOLVE, _resolve_token_ids)
        _patch(_GRAMMAR_CACHE, _own_grammar_objects)
        _patch(_BATCH_MASK, _batch_mask)
        _patch(_TOPK, wrap_topk)
        _patch(_SELECT, wrap_select)
        _patch(_DRAFT, lambda original: wrap_draft_forward(original, lambda: _drafting["on"]))
        _patch(_EXTEND_DECODE, lambda original: wrap_extend(original, "draft_extend_for_decode"))
        _patch(_EXTEND_PREFILL, lambda original: wrap_extend(original, "draft_extend_for_prefill"))
        _patch(_RUN_BATCH, lambda original: run_batch(original, _batch_has_grammar))
        _patch(_BUILD_VERIFY, lambda original: fused_verify_builder(original, _refused, _fused))
        _patch(_FUSED_VERIFY, spec_decode_verify)
        _patch(_LOGITS, logits_processor)
    logger.info(
        "portable_spec: grammar masks on sglang-jax's speculative verify (sglang-jax %s)", revision
    )
    return True


def uninstall() -> None:
    """Put sglang-jax's own functions back (this process)."""
    with _lock:
        for owner, attribute, original in _patches.values():
            setattr(owner, attribute, original)
        _patches.clear()


def _own_grammar_objects(original: Any) -> Any:
    """Every request its own grammar object (sglang-jax shares cached ones)."""
    from sgl_jax.srt.constrained.base_grammar_backend import INVALID_GRAMMAR_OBJ

    return own_grammar_objects(original, INVALID_GRAMMAR_OBJ)


def _patch(key: str, make: Callable[[Any], Any]) -> None:
    owner, attribute, original = _resolve(key)
    replacement = make(original)
    replacement._portable_spec_original = original
    replacement.__doc__ = original.__doc__
    replacement.__name__ = original.__name__
    replacement.__qualname__ = original.__qualname__
    setattr(owner, attribute, replacement)
    _patches[key] = (owner, attribute, original)


# -- the verify step ---------------------------------------------------------------------------
def _start_job(spec_info: Any, model_worker_batch: Any) -> MaskJob | None:
    """Stage the tree of ``spec_info`` and start its mask build; ``None`` when no request of
    the batch has a grammar. Never raises (a failure leaves the step unmasked, logged)."""
    try:
        batch = spec_info.retrive_next_token.shape[0]
        slots = slot_grammars(model_worker_batch, batch)
        if slots is None:
            return None
        vocab = int(model_worker_batch.sampling_info.vocab_size)
        return start_mask(
            spec_info.retrive_next_token,
            spec_info.retrive_next_sibling,
            spec_info.draft_token,
            slots,
            vocab,
        )
    except Exception as exc:
        logger.warning("portable_spec: verify mask not started (unmasked step): %s", exc)
        return None


def _verify(original: Callable[..., Any]) -> Callable[..., Any]:
    def verify(self: Any, model_worker_batch: Any, cur_allocate_lens: Any) -> Any:
        spec_info = model_worker_batch.spec_info_padded
        started = time.perf_counter()
        job = None
        fresh = getattr(spec_info, JOB_ATTR, None) is None
        if hasattr(spec_info, "retrive_next_sibling") and fresh:
            job = _start_job(spec_info, model_worker_batch)
            if job is not None:
                setattr(spec_info, JOB_ATTR, job)
        result = original(self, model_worker_batch, cur_allocate_lens)
        if job is not None and _timing["on"]:
            with _lock:
                _stats["step_s"].append(time.perf_counter() - started)
        return result

    return verify


def _sample(original: Callable[..., Any]) -> Callable[..., Any]:
    def sample(self: Any, model_worker_batch: Any, logits_output: Any, rng: Any, mesh: Any) -> Any:
        job = self.__dict__.pop(JOB_ATTR, None)
        if job is None:
            job = _start_job(self, model_worker_batch)
        if job is not None:
            _mask_logits(self, job, logits_output)
        predict, verified_id, accept_length, accept_index = original(
            self, model_worker_batch, logits_output, rng, mesh
        )
        predict = commit_accepted(
            predict, accept_index, accept_length, self.draft_token_num, self.spec_steps + 1
        )
        with _lock:
            _stats["verify_steps"] += 1
            if job is not None:
                lengths = np.asarray(accept_length)
                live = [b for b, m in enumerate(job.grammars) if m is not None and b < len(lengths)]
                _stats["accepted_tokens"] += int(lengths[live].sum()) if live else 0
                _stats["constrained_verifies"] += len(live)
        return predict, verified_id, accept_length, accept_index

    return sample


def _mask_logits(spec_info: Any, job: MaskJob, logits_output: Any) -> None:
    logits = logits_output.next_token_logits
    watcher = _ForwardWatch(logits) if _timing["on"] else None
    mask = job.finish()
    exposed = watcher.exposed(job.finished_at) if watcher is not None else None
    if mask is not None:
        logits_output.next_token_logits = apply_mask(logits, mask, job.vocab_size)
    with _lock:
        _stats["grammar_steps"] += 1
        _stats["refused_requests"] += len(job.refused)
        if mask is not None:
            _stats["masked_steps"] += 1
            _stats["masked_rows"] += int(mask.shape[0])
            _stats["waited_s"].append(job.waited)
            if exposed is not None:
                _stats["exposed_s"].append(exposed)


class _ForwardWatch:
    """When the verify logits became ready (timing mode): a thread blocks on them."""

    def __init__(self, logits: Any) -> None:
        self.ready_at = 0.0
        self._thread = threading.Thread(target=self._wait, args=(logits,), daemon=True)
        self._thread.start()

    def _wait(self, logits: Any) -> None:
        try:
            logits.block_until_ready()
        finally:
            self.ready_at = time.perf_counter()

    def exposed(self, mask_ready_at: float) -> float:
        """Seconds between the logits being ready and the mask being ready (0 if the mask
        was first)."""
        self._thread.join()
        return max(0.0, mask_ready_at - self.ready_at)


# -- after the step: accepted tokens and the grammar -------------------------------------------
def _accept_token(original: Callable[..., Any]) -> Callable[..., Any]:
    def accept_token(self: Any, token: Any) -> Any:
        if isinstance(token, (list, tuple, np.ndarray)):
            return accept_tokens(self, token, original)
        return original(self, token)

    return accept_token


def _resolve_token_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    def resolve_spec_decode_token_ids(result: Any, batch: Any, draft_token_num: int) -> Any:
        tokens, accept_lens = original(result, batch, draft_token_num)
        per_dp = batch.per_dp_bs_size
        reqs = [
            (dp_rank * per_dp + j, req)
            for dp_rank, info in enumerate(batch.reqs_info)
            for j, req in enumerate(info.reqs or [])
            if not req.finished()
        ]
        cut = truncate_at_grammar_end(reqs, tokens, accept_lens, _finish_request)
        if cut:
            with _lock:
                _stats["grammar_ends"] += cut
        return tokens, accept_lens

    return resolve_spec_decode_token_ids


def _batch_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_grammar_vocab_mask(self: Any) -> Any:
        result = original(self)
        mask = getattr(self, "vocab_mask", None)
        if mask is not None and self.grammars:
            # a private copy: sglang-jax refills one buffer per grammar object for every batch,
            # and on JAX's CPU backend the previous batch's device mask may alias it
            mask = np.array(mask, copy=True)
            free = np.ones(len(mask), dtype=bool)
            for i, grammar in enumerate(self.grammars[: len(mask)]):
                if grammar and not grammar.finished and not grammar.is_terminated():
                    free[i] = False
            mask[free] = -1  # rows sglang-jax leaves zero (or stale): nothing was allowed
            self.vocab_mask = mask
        return result

    return update_grammar_vocab_mask


def _batch_has_grammar(batch: Any) -> bool:
    """Whether a request of an sglang-jax ``ScheduleBatch`` has an active grammar."""
    return any(
        active_matcher(getattr(req, "grammar", None)) is not None
        for info in batch.reqs_info
        for req in info.reqs or []
    )


def _refused(slot: int, error: Exception) -> None:
    logger.warning(
        "portable_spec: verify slot %d keeps sglang-jax's unmasked verify this step: %s",
        slot,
        error,
    )
    with _lock:
        _stats["refused_requests"] += 1


def _fused(seconds: float, mask: Any) -> None:
    """One fused (overlap schedule) verify step's mask: staged and built before the launch."""
    with _lock:
        _stats["fused_steps"] += 1
        _stats["grammar_steps"] += 1
        _stats["fused_build_s"].append(seconds)
        if mask is not None:
            _stats["masked_steps"] += 1
            _stats["masked_rows"] += int(mask.shape[0])


def _finish_request(req: Any, token: int) -> None:
    """Finish ``req`` on ``token`` (its grammar's end) when the scheduler next checks it."""
    if req.finished() or getattr(req, "to_finish", None) is not None:
        return
    from sgl_jax.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN

    req.to_finish = FINISH_MATCHED_TOKEN(matched=int(token))
