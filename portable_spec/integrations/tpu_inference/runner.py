"""tpu-inference (vLLM on TPU): vLLM's grammar rows on the logits rows they belong to.

tpu-inference 0.32 applies vLLM's structured-output bitmask as if every request had one
logits row: ``StructuredDecodingManager.prepare_structured_decoding_input`` copies row ``i``
of vLLM's bitmask to the ``i``-th request of ``sorted(structured_output_request_ids)``. vLLM
0.32 writes ``1 + len(drafts)`` rows per structured request, in the order of
``structured_output_request_ids``, and with speculative decoding tpu-inference's logits hold
``1 + drafts`` rows per request. So with speculation a request gets another request's draft
row (or the step fails on a reshape), and without it rows go to the wrong requests whenever
vLLM's order is not the sorted one.

Switched on, this module replaces three methods of tpu-inference's runner (its own code runs
around them):

* ``TPUModelRunner.sample_tokens`` keeps a reference to the step's state
  (``execute_model_state``: the scheduled drafts, the spec-decode metadata, the requests per
  data-parallel rank) for the mask, since tpu-inference clears it before preparing the mask;
* ``StructuredDecodingManager.prepare_structured_decoding_input`` maps every logits row to
  the vLLM row of its own request and position (draft targets first, bonus last, padding and
  unconstrained requests untouched) and uploads vLLM's rows as they are, with that index, in
  one int32 ``[rows, 1 + words]`` array (one transfer per step);
* ``StructuredDecodingManager.structured_decode_fn`` masks the logits in one jitted function
  whose inputs have static shapes (that array and the logits, which it donates: the masked
  logits take their buffer), so the batch's mix never recompiles it.

Switches: ``PORTABLE_SPEC_VLLM=1`` (or ``on``) through the vLLM plugin's entry point (vLLM
loads it in tpu-inference's processes too; the runner is patched when tpu-inference imports
it), or :func:`install` in the process that runs the runner. ``shadow``, ``0``, unset: the
runner is left as it is. Known versions: tpu-inference 0.32 with vLLM 0.32; any other gets
one ``WARNING`` line and tpu-inference's own code. The rows themselves are vLLM's (built by
the vLLM plugin when it is on): nothing is built twice.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from portable_spec.hostbuffers import HostBufferPool
from portable_spec.integrations._tpu_rows import RowMap, map_rows

__all__ = [
    "KNOWN_VERSIONS",
    "RUNNER_MODULE",
    "install",
    "integration_stats",
    "is_installed",
    "prepare_rows",
    "register",
    "reset_stats",
    "uninstall",
    "versions_known",
]

#: tpu-inference releases (major.minor) whose runner this module patches.
KNOWN_VERSIONS = ("0.32",)
#: vLLM releases whose packed rows (``1 + len(drafts)`` per structured request) it reads.
VLLM_VERSIONS = ("0.32",)
#: the module that defines ``TPUModelRunner`` (it imports the structured-decoding manager).
RUNNER_MODULE = "tpu_inference.runner.tpu_runner"
MANAGER_MODULE = "tpu_inference.runner.structured_decoding_manager"

logger = logging.getLogger("vllm.portable_spec.tpu_inference")

_lock = threading.Lock()
# (class, attribute) -> tpu-inference's own function, while patched
_originals: dict[tuple[type, str], Any] = {}
_pool = HostBufferPool(max_free=4)
_warned: set[str] = set()


def _new_stats() -> dict[str, int]:
    return {"steps": 0, "rows": 0, "skipped_requests": 0}


_stats = _new_stats()


def integration_stats() -> dict[str, int]:
    """This process's counters: ``steps`` whose mask the integration prepared, ``rows``
    (logits rows given a grammar row), ``skipped_requests`` (structured requests that were not
    in the runner's batch: their rows skipped, with a log line). Never blocks."""
    return dict(_stats)


def reset_stats() -> None:
    """Zero this process's counters; the once-per-process warnings may be logged again."""
    _stats.update(_new_stats())
    _warned.clear()


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def versions_known(tpu_inference_version: str, vllm_version: str) -> bool:
    """Whether this module patches tpu-inference ``tpu_inference_version`` running vLLM
    ``vllm_version`` (``"0.32.0"``, ``"0.32.0"`` -> True)."""
    return _minor(tpu_inference_version) in KNOWN_VERSIONS and _minor(vllm_version) in VLLM_VERSIONS


def _tpu_inference_version() -> str | None:
    for name in ("tpu-inference", "tpu_inference"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_installed() -> bool:
    """Whether tpu-inference's runner is patched in this process."""
    return bool(_originals)


def install() -> bool:
    """Patch tpu-inference's runner in this process (importing it if needed).

    Returns True when the runner is patched (also when it already was), False when the
    tpu-inference or vLLM version is not one whose rows this module knows (one ``WARNING``
    line; tpu-inference's own code stays). Raises ImportError without tpu-inference.
    Idempotent; does not block.
    """
    module = importlib.import_module(RUNNER_MODULE)
    return _patch(module)


def uninstall() -> bool:
    """Give tpu-inference's runner its own methods back. Returns whether it was patched."""
    with _lock:
        if not _originals:
            return False
        for (owner, name), original in _originals.items():
            setattr(owner, name, original)
        _originals.clear()
    _remove_hook()
    return True


def register() -> None:
    """Patch tpu-inference's runner as soon as it is imported in this process (now, if it
    already is). The vLLM plugin's entry point calls this when ``PORTABLE_SPEC_VLLM`` is on;
    it does nothing where tpu-inference is not installed, and imports nothing of it."""
    module = sys.modules.get(RUNNER_MODULE)
    if module is not None:
        _patch(module)
        return
    if importlib.util.find_spec("tpu_inference") is None:
        return
    with _lock:
        if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())


def _remove_hook() -> None:
    with _lock:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds tpu-inference's runner module as the other finders do, with a loader that
    patches it right after it ran; removes itself on first use."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != RUNNER_MODULE:
            return None
        _remove_hook()
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader)
        return spec


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            _patch(module)
        except Exception:  # never break tpu-inference's own import
            logger.exception("portable_spec: tpu-inference's runner could not be patched")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _patch(runner_module: Any) -> bool:
    """Patch the classes of an imported runner module (see :func:`install`)."""
    import vllm

    version = _tpu_inference_version()
    with _lock:
        if _originals:
            return True
        if version is None or not versions_known(version, vllm.__version__):
            logger.warning(
                "portable_spec: tpu-inference %s with vLLM %s is not a pair whose grammar "
                "rows this integration knows (tpu-inference %s with vLLM %s): tpu-inference's "
                "own structured decoding is used",
                version,
                vllm.__version__,
                "/".join(KNOWN_VERSIONS),
                "/".join(VLLM_VERSIONS),
            )
            return False
        runner_cls = runner_module.TPUModelRunner
        manager_cls = sys.modules[MANAGER_MODULE].StructuredDecodingManager
        replacements: list[tuple[type, str, Callable[[Any], Any]]] = [
            (runner_cls, "sample_tokens", _sample_tokens),
            (manager_cls, "prepare_structured_decoding_input", _prepare),
            (manager_cls, "structured_decode_fn", _decode),
        ]
        missing = [name for owner, name, _ in replacements if not hasattr(owner, name)]
        if missing:
            logger.warning(
                "portable_spec: tpu-inference %s has no %s: its own structured decoding is used",
                version,
                ", ".join(missing),
            )
            return False
        for owner, name, make in replacements:
            original = owner.__dict__[name]
            _originals[(owner, name)] = original
            setattr(owner, name, make(original))
    logger.info(
        "portable_spec: tpu-inference %s applies vLLM %s's grammar rows per logits row",
        version,
        vllm.__version__,
    )
    return True


def _sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        manager = getattr(self, "structured_decoding_manager", None)
        if grammar_output is None or manager is None:
            return original(self, grammar_output)
        # tpu-inference clears execute_model_state before it prepares the mask
        manager._portable_spec_step = self.execute_model_state
        try:
            return original(self, grammar_output)
        finally:
            manager._portable_spec_step = None

    sample_tokens.__doc__ = original.__doc__
    return sample_tokens


def _prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_structured_decoding_input(
        self: Any, logits: Any, grammar_output: Any
    ) -> tuple[Any, None, None]:
        return prepare_rows(self, logits, grammar_output)

    prepare_structured_decoding_input.__doc__ = prepare_rows.__doc__
    return prepare_structured_decoding_input


def _decode(original: Callable[..., Any]) -> Callable[..., Any]:
    from portable_spec.integrations._tpu_apply import apply_flagged, apply_packed

    def structured_decode_fn(
        self: Any, packed_or_flags: Any, bits: Any, logits: Any, arange: Any = None
    ) -> Any:
        """The logits ``[rows, vocab]`` masked per row, from what the patched
        ``prepare_structured_decoding_input`` returned (``packed_or_flags`` int32
        ``[rows, 1 + words]``, ``bits`` and ``arange`` None; the logits are donated:
        tpu-inference's ``sample_tokens`` rebinds them to the result), or from tpu-inference's
        own inputs (bool ``[rows, 1]`` flags, int32 ``[rows, words]`` aligned rows, as its
        start-up precompilation passes them; not donated). Returns the masked logits without
        blocking."""
        if np.dtype(packed_or_flags.dtype) == np.bool_:
            return apply_flagged(packed_or_flags, bits, logits)
        return apply_packed(packed_or_flags, logits)

    return structured_decode_fn


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def prepare_rows(manager: Any, logits: Any, grammar_output: Any) -> tuple[Any, None, None]:
    """The patched ``prepare_structured_decoding_input``: this step's grammar rows, placed.

    ``manager``: tpu-inference's ``StructuredDecodingManager``; ``logits``: the step's
    ``[rows, vocab]`` logits (only the shape is read); ``grammar_output``: vLLM's
    ``GrammarOutput`` (``grammar_bitmask`` int32 ``[vLLM rows, words]`` numpy). The step's
    layout comes from the runner's ``execute_model_state`` (kept by the patched
    ``sample_tokens``): requests per data-parallel rank, their draft counts, the scheduled
    drafts vLLM built the rows for.

    Returns ``(packed, None, None)``, ready for the patched ``structured_decode_fn``:
    ``packed`` int32 ``[rows, 1 + words]`` on the runner's mesh (replicated), column 0 per
    logits row the packed row that masks it (``rows``: left as it is), columns ``1 ..`` vLLM's
    rows of the batch's requests in vLLM's order (the rows past them are never read). Does
    not block: one asynchronous upload, from a pooled host buffer that is reused only once
    nothing reads it. A structured request missing from the batch has its rows skipped (one
    ``WARNING`` the first time; counted in :func:`integration_stats`).

    Raises:
        TypeError: a bitmask that is not an int32 numpy matrix.
        ValueError: logits wider than the bitmask covers, a step layout that is not known
            (speculative decoding without the step's metadata), or layouts that disagree
            (see :func:`portable_spec.integrations._tpu_rows.map_rows`). Nothing is uploaded.
    """
    bitmask = grammar_output.grammar_bitmask
    if not isinstance(bitmask, np.ndarray) or bitmask.ndim != 2 or bitmask.dtype != np.int32:
        raise TypeError(
            f"vLLM's grammar bitmask must be an int32 [rows, words] numpy array, got "
            f"{type(bitmask).__name__} {getattr(bitmask, 'dtype', '')}"
            f"{list(getattr(bitmask, 'shape', ()))}"
        )
    num_logits, vocab = (int(n) for n in logits.shape)
    words = bitmask.shape[1]
    if vocab > 32 * words:
        raise ValueError(
            f"the logits have {vocab} columns but vLLM's grammar bitmask covers {32 * words} "
            f"tokens ({words} words per row)"
        )
    runner = manager.runner
    step = getattr(manager, "_portable_spec_step", None) or runner.execute_model_state
    ranks, drafts, spec_tokens = _layout(runner, step, num_logits)
    rows = map_rows(
        list(grammar_output.structured_output_request_ids),
        spec_tokens,
        bitmask.shape[0],
        ranks,
        drafts,
        num_logits,
    )
    if rows.skipped:
        _stats["skipped_requests"] += len(rows.skipped)
        _warn_once(
            "skipped",
            "portable_spec: structured requests %s are not in tpu-inference's batch: their "
            "grammar rows are skipped (counted in integration_stats)",
            list(rows.skipped[:8]),
        )
    packed = _upload(manager, rows, bitmask, num_logits)
    _stats["steps"] += 1
    _stats["rows"] += rows.rows
    return packed, None, None


def _upload(manager: Any, rows: RowMap, bitmask: np.ndarray, num_logits: int) -> Any:
    buffer = _pool.acquire((num_logits, 1 + bitmask.shape[1]), np.int32)
    try:
        host = buffer.array
        host[:, 0] = rows.index
        for source, packed, count in rows.spans:
            host[packed : packed + count, 1:] = bitmask[source : source + count]
    except BaseException:
        _pool.release(buffer)
        raise
    # tpu-inference's own upload helper (its device_put, or its multi-host path)
    device_array = sys.modules[MANAGER_MODULE].device_array
    return device_array(manager.runner.mesh, _pool.lend(buffer))


def _layout(
    runner: Any, step: Any, num_logits: int
) -> tuple[list[Sequence[str]], list[np.ndarray] | None, dict[str, Sequence[int]]]:
    """The step's requests per rank in logits order, their draft counts per rank (None:
    one row each) and vLLM's scheduled drafts, from tpu-inference's step state."""
    if step is None:
        if getattr(runner, "speculative_config", None) is not None:
            raise ValueError(
                "speculative decoding: the grammar rows need the step's spec-decode metadata; "
                "prepare_structured_decoding_input must run inside TPUModelRunner.sample_tokens "
                "(or while execute_model_state is set)"
            )
        if getattr(runner, "dp_size", 1) != 1:
            raise ValueError("data parallelism: the step's state is needed to place rows")
        batch = runner.input_batch
        return [list(batch.req_ids[: batch.num_reqs])], None, {}
    spec_tokens = step.scheduler_output.scheduled_spec_decode_tokens
    meta = step.spec_decode_metadata
    by_rank = step.req_ids_dp or (meta.req_ids_dp if meta is not None else None)
    if not by_rank:
        raise ValueError("the step's state lists no requests per data-parallel rank")
    ranks = [by_rank[rank] for rank in range(len(by_rank))]
    if meta is None:
        return ranks, None, spec_tokens
    logits_rows = int(meta.final_logits_indices.shape[0])
    if logits_rows != num_logits:
        raise ValueError(
            f"the logits have {num_logits} rows, the step's spec-decode metadata {logits_rows}"
        )
    lengths = np.asarray(meta.draft_lengths_cpu)
    per_rank = len(lengths) // len(ranks)
    drafts = [lengths[rank * per_rank : (rank + 1) * per_rank] for rank in range(len(ranks))]
    return ranks, drafts, spec_tokens
