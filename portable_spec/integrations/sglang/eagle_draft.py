"""Grammar-aware drafting in sglang's EAGLE v2 draft loop (``EagleDraftWorker``).

sglang's draft loop, for a decode batch: the root's top-k comes from the previous step's draft
extend (the draft head's logits at the last committed token); then per step
``select_top_k_tokens`` picks the nodes to expand, the draft head runs on them, and a top-k of
its logits gives their children; ``organize_draft_results`` keeps the best
``num_draft_tokens - 1`` candidates as the verify tree. With drafting on, for a batch with
grammar requests, the draft runs inside a :class:`portable_spec.DraftSession` of the batch's
grammars:

* ``EAGLEWorkerV2.forward_batch_generation``: the scheduler's grammar barrier (which advances
  the grammars over the previous step's committed tokens) runs before drafting rather than
  inside verify, so that the drafts see the grammars' current state;
* ``_draft_extend_for_decode`` / ``_draft_extend_for_prefill``: the draft head's logits the
  root's top-k comes from are kept, per request (the rows of grammar requests only);
* ``draft``: the session is opened, and the root's top-k taken again, by sglang's own
  ``renorm_draft_probs`` and ``fast_topk``, from the kept logits masked with each request's
  row after its committed tokens; the draft decode's CUDA graph is not replayed (its host
  work could not run inside it: ``EAGLEDraftCudaGraphRunner.can_run_graph`` says no while a
  session drafts);
* ``draft_forward``: each draft-head call sees the rows of the nodes it runs on (the nodes
  ``select_top_k_tokens`` picked join the session as one level), and its logits are masked with
  them before sglang's top-k (``organize_draft_results`` breaks the ties this makes, a forced
  token scoring its parent's score, towards the parent); afterwards the verify tree's nodes
  are mapped to session nodes (candidates never expanded join as one last level, their rows
  computed later) and the step is staged for the verify build (:mod:`.drafting`), which
  gathers its mask from these rows.

A node whose grammar row allows fewer tokens than top-k still fills its top-k slots: the
extra candidates have probability 0 (sglang's top-k picks arbitrary ids among them); the
verify tree takes them only when fewer positive-probability candidates exist, and their
verify rows are all-allowed, as for any refused node.

Left to sglang's own drafts: batches without grammar requests, steps whose grammars the
session cannot hold (a reasoning request, a grammar object sglang's own walk builds, a step
built by sglang as a whole), rejection sampling on a non-greedy batch (its draft
probabilities would have to be masked too), and any failure (one warning line per kind).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import portable_spec as ps
from portable_spec.integrations.sglang import drafting, internals
from portable_spec.integrations.sglang.grammars import plan_step
from portable_spec.integrations.sglang.internals import logger
from portable_spec.integrations.sglang.state import LOG, STATS

__all__ = [
    "EagleStep",
    "wrap_can_run_graph",
    "wrap_draft",
    "wrap_draft_forward",
    "wrap_extend",
    "wrap_forward_batch_generation",
    "wrap_organize",
    "wrap_select",
]

_local = threading.local()  # .step: the EagleStep of the draft running in this thread


def _current() -> EagleStep | None:
    return getattr(_local, "step", None)


class EagleStep:
    """One ``draft()`` call's grammar state: the session and the map from sglang's candidate
    indices to session nodes.

    sglang numbers the candidates of a draft as ``organize_draft_results`` concatenates them:
    the root's top-k first (``0 .. k-1``), then each later step's ``k * k`` children
    (``k + k*k*(i-1) + q`` for step ``i``, child ``q % k`` of the ``q // k``-th node picked at
    step ``i - 1``).
    """

    def __init__(
        self, session: Any, plan: Any, grammars: tuple, topk: int, steps: int, masking: bool
    ) -> None:
        self.session = session
        self.plan = plan
        self.grammars = grammars
        self.topk = topk
        self.steps = steps
        self.masking = masking  # False: shadow mode (rows computed, logits left alone)
        self.batch = session.batch
        self.picked: Any = None  # the candidate indices select_top_k_tokens picked last
        self.levels: list[tuple[int, Any]] = []  # per draft-head call: (first node, picks)
        self.rows = 0
        self.failed = False

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def fail(self, exc: BaseException) -> None:
        """Stop masking this draft (a level or its mask failed): the rest of it is sglang's
        own, its verify mask built afresh. One warning line per kind."""
        self.failed = True
        LOG.warning(f"draft-level:{type(exc).__name__}",
                  "portable_spec: a draft level was not masked (%s); the rest of that draft "
                  "is sglang's own", exc)  # fmt: skip

    # -- the draft head's calls ---------------------------------------------------------------
    def before_head(self, input_ids: Any) -> Any:
        """The level the draft head is about to run on: its nodes join the session; returns
        their rows (``[batch * k, words]``, draft vocabulary)."""
        import torch

        k, i = self.topk, len(self.levels)
        batch = self.batch
        tokens = input_ids.reshape(batch, k)
        if i == 0:
            picks = torch.arange(k, device=tokens.device).expand(batch, k)
            parents = torch.zeros((batch, k), dtype=torch.int64, device=tokens.device)
        else:
            offset = k + k * k * (i - 1)
            picks = self.picked
            if picks is None:  # a chain drafted without select_top_k_tokens (topk 1)
                picks = torch.full((batch, k), offset, dtype=torch.int64, device=tokens.device)
            picks = picks.reshape(batch, k).to(torch.int64)
            parents = self.levels[i - 1][0] + torch.div(picks - offset, k, rounding_mode="floor")
        self.picked = None
        first = self.session.nodes
        rows = self.session.extend(parents, tokens)
        self.levels.append((first, picks))
        self.rows += len(self.session_constrained()) * k
        return rows

    def session_constrained(self) -> list[int]:
        return [b for b, m in enumerate(self.plan.matchers) if m is not None]

    # -- the verify tree ----------------------------------------------------------------------
    def finish(self, top_scores_index: Any, draft_tokens: Any) -> drafting.Drafted | None:
        """Map the verify tree's nodes (``top_scores_index``, ``draft_tokens``: ``[batch,
        nodes - 1]``) to session nodes, the missing ones added as one level (rows computed
        when the verify build asks); the staged step, or None when they cannot be mapped."""
        k = self.topk
        chosen = np.asarray(top_scores_index.cpu(), dtype=np.int64)
        tokens = np.asarray(draft_tokens.cpu(), dtype=np.int64)
        batch = self.batch
        if tokens.shape != chosen.shape or chosen.shape[0] != batch:
            return None
        total = k + k * k * max(self.steps - 1, 0)
        if chosen.size and (chosen.min() < 0 or chosen.max() >= total):
            return None
        node_of = np.full((batch, total), -1, dtype=np.int64)
        for first, picks in self.levels:
            host = np.asarray(picks.cpu(), dtype=np.int64).reshape(batch, k)
            node_of[np.arange(batch)[:, None], host] = first + np.arange(k)
        rows_b = np.arange(batch)[:, None]
        nodes = node_of[rows_b, chosen]
        missing = nodes < 0
        parents = np.zeros_like(chosen)
        later = chosen >= k
        step = np.where(later, (chosen - k) // (k * k) + 1, 0)
        within = np.where(later, (chosen - k) % (k * k), 0)
        for i in np.unique(step[missing & later]).tolist():
            if i - 1 >= len(self.levels):
                return None  # its parent was never run on: not a tree sglang drafts
            first = self.levels[i - 1][0]
            here = missing & later & (step == i)
            parents[here] = first + within[here] // k
        if (missing & ~later).any() and self.levels:
            return None  # a root child the first level lacks
        # the nodes' tokens are compared with the verify tree's once, by the verify build's
        # check that the tree it is given is this one (drafting.drafted_rows)
        if missing.any():  # one level: each request's missing nodes in order, then padding
            slot = np.cumsum(missing, axis=1) - 1
            width = int(slot[:, -1].max()) + 1
            level_parents = np.full((batch, width), -1, dtype=np.int64)
            level_tokens = np.zeros((batch, width), dtype=np.int64)
            b, c = np.nonzero(missing)
            level_parents[b, slot[b, c]] = parents[b, c]
            level_tokens[b, slot[b, c]] = tokens[b, c]
            nodes[b, c] = self.session.nodes + slot[b, c]
            self.session.extend(level_parents, level_tokens, masks=False)
        select = np.concatenate([np.zeros((batch, 1), dtype=np.int64), nodes], axis=1)
        step = drafting.Drafted(
            self.session, self.grammars, tuple(self.plan.matchers), select, "eagle"
        )
        self.session = None
        return step


class _MaskingRunner:
    """sglang's draft ``ModelRunner`` as ``draft_forward`` sees it while a session drafts:
    each ``forward`` first adds the level it runs on to the session, then masks the logits it
    returns with that level's rows."""

    def __init__(self, runner: Any, step: EagleStep) -> None:
        self._runner = runner
        self._step = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def forward(self, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        step = self._step
        rows = None
        if not step.failed:
            try:
                rows = step.before_head(forward_batch.input_ids)
            except Exception as exc:  # never the step's failure: the rest drafts blind
                step.fail(exc)
        out = self._runner.forward(forward_batch, *args, **kwargs)
        if step.masking and rows is not None and not step.failed:
            logits_output = out.logits_output
            try:
                logits_output.next_token_logits = ps.apply_vocab_mask(
                    logits_output.next_token_logits, rows
                )
            except Exception as exc:
                step.fail(exc)
        return out


class _CapturingRunner:
    """sglang's draft ``ModelRunner`` (or draft-extend graph runner) during a draft extend:
    keeps the logits output its ``forward`` (``execute``) returns."""

    def __init__(self, runner: Any, kept: list) -> None:
        self._runner = runner
        self._kept = kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self._runner.forward(*args, **kwargs)
        self._kept.append(out.logits_output)
        return out

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        out = self._runner.execute(*args, **kwargs)
        self._kept.append(out)  # the graph runner returns the logits output itself
        return out


@contextlib.contextmanager
def _swapped(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` replaced by ``make(owner.name)`` for the block (an instance attribute,
    restored as it was)."""
    had = name in vars(owner)
    own = vars(owner).get(name)
    current = getattr(owner, name, None)
    if current is None:
        yield
        return
    setattr(owner, name, make(current))
    try:
        yield
    finally:
        if had:
            setattr(owner, name, own)
        else:
            delattr(owner, name)


# -- the root logits, kept per request ----------------------------------------------------------

_roots: dict[str, tuple[int, Any, int]] = {}  # rid -> (generation, logits rows, row)
_roots_lock = threading.Lock()
_generation = [0]
#: extends after which a request's kept logits are dropped (a request that left the batch)
_KEEP_GENERATIONS = 4


def _keep_roots(reqs: list, logits: Any) -> None:
    """Keep the rows of ``logits`` (``[len(reqs), vocab]``) of the requests with a grammar."""
    import torch

    if logits is None or logits.dim() != 2 or logits.shape[0] != len(reqs):
        return
    picked = [b for b, r in enumerate(reqs) if internals.request_grammar(r) is not None]
    if not picked:
        return
    index = torch.tensor(picked, dtype=torch.int64, device=logits.device)
    rows = logits.index_select(0, index)  # a copy (a graph's output buffer is reused)
    with _roots_lock:
        _generation[0] += 1
        now = _generation[0]
        for j, b in enumerate(picked):
            _roots[internals.request_id(reqs[b])] = (now, rows, j)
        stale = [rid for rid, (g, _, _) in _roots.items() if g <= now - _KEEP_GENERATIONS]
        for rid in stale:
            del _roots[rid]


def forget_roots() -> None:
    """Drop every kept root row (the plugin is uninstalled)."""
    with _roots_lock:
        _roots.clear()


def _kept_roots(reqs: list, constrained: list[int]) -> tuple[list[int], Any]:
    """The requests among ``constrained`` whose root logits are kept, and those logits
    ``[n, vocab]`` (one gather per kept block)."""
    import torch

    with _roots_lock:
        found = [(b, _roots.get(internals.request_id(reqs[b]))) for b in constrained]
    found = [(b, v) for b, v in found if v is not None]
    if not found:
        return [], None
    blocks: dict[int, tuple[Any, list[int], list[int]]] = {}
    for b, (_, rows, j) in found:
        entry = blocks.setdefault(id(rows), (rows, [], []))
        entry[1].append(b)
        entry[2].append(j)
    order: list[int] = []
    parts = []
    for rows, bs, js in blocks.values():
        order.extend(bs)
        parts.append(rows.index_select(0, torch.tensor(js, device=rows.device)))
    return order, torch.cat(parts) if len(parts) > 1 else parts[0]


# -- the patches ---------------------------------------------------------------------------------


def wrap_forward_batch_generation(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EAGLEWorkerV2.forward_batch_generation``: on a decode batch with a grammar request
    and drafting on, the scheduler's grammar barrier first (it is idempotent: verify's call
    then finds nothing to do)."""

    def forward_batch_generation(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        barrier = kwargs.get("grammar_barrier")
        if barrier is None and len(args) >= 2:
            barrier = args[1]
        if (
            barrier is not None
            and drafting.mode() != "off"
            and internals.decode_with_grammar(batch)
        ):
            barrier()
        return original(self, batch, *args, **kwargs)

    return forward_batch_generation


def wrap_draft(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EagleDraftWorker.draft`` under a session of the batch's grammars."""

    def draft(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        drafting.clear()  # a step whose verify never came
        step = _open(self, batch)
        if step is None:
            return original(self, batch, *args, **kwargs)
        _local.step = step
        try:
            return original(self, batch, *args, **kwargs)
        finally:
            _local.step = None
            step.close()  # the session passed on to the verify build, if the draft finished

    return draft


def wrap_draft_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EagleDraftWorker.draft_forward``: the draft head's logits masked level by level; the
    verify tree mapped to session nodes and staged for the verify build."""

    def draft_forward(self: Any, forward_batch: Any) -> Any:
        step = _current()
        if step is None or step.session is None:
            return original(self, forward_batch)
        with _swapped(self, "draft_runner", lambda runner: _MaskingRunner(runner, step)):
            result = original(self, forward_batch)
        _stage(step, result)
        return result

    return draft_forward


def wrap_select(original: Callable[..., Any]) -> Callable[..., Any]:
    """``select_top_k_tokens`` as the draft worker module calls it: the candidates it picks
    are noted for the next draft-head call."""

    def select_top_k_tokens(i: int, topk_p: Any, topk_index: Any, hidden_states: Any,
                            scores: Any, topk: int) -> Any:  # fmt: skip
        out = original(i, topk_p, topk_index, hidden_states, scores, topk)
        step = _current()
        if step is not None and i > 0:
            step.picked = out[3][2]  # the picked candidates' indices, [batch, topk]
        return out

    return select_top_k_tokens


def wrap_organize(original: Callable[..., Any]) -> Callable[..., Any]:
    """``organize_draft_results`` while a session drafts with masks: sglang's own choice of the
    verify tree's candidates, over scores whose ties are broken towards the shallower node.

    Under the mask a forced token has probability 1, so a child scores exactly its parent's
    score (and a zero-probability slot's children score 0 like it): sglang's top-k could then
    keep a child without its parent. The scores are ranked as ``s * (1 - 2**-40) ** depth``
    (float64), zeros as ``-depth``: sglang's order wherever it was strict, every node above its
    descendants."""

    def organize_draft_results(score_list: Any, token_list: Any, parents_list: Any,
                               num_draft_token: int) -> Any:  # fmt: skip
        step = _current()
        if step is None or not step.masking:
            return original(score_list, token_list, parents_list, num_draft_token)
        ranked = [_rank(scores, depth) for depth, scores in enumerate(score_list, start=1)]
        return original(ranked, token_list, parents_list, num_draft_token)

    return organize_draft_results


_SHRINK = 1.0 - 2.0**-40


def _rank(scores: Any, depth: int) -> Any:
    import torch

    wide = scores.to(torch.float64)
    return torch.where(wide > 0, wide * _SHRINK**depth, torch.full_like(wide, -float(depth)))


def wrap_extend(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_draft_extend_for_decode`` / ``_draft_extend_for_prefill``: the logits the next
    draft's root top-k comes from are kept for the requests with a grammar."""

    def draft_extend(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if drafting.mode() != "on" or not internals.has_grammar_request(batch):
            return original(self, batch, *args, **kwargs)
        kept: list = []
        with (
            _swapped(self, "draft_runner", lambda r: _CapturingRunner(r, kept)),
            _swapped(self, "cuda_graph_runner_for_draft_extend",
                     lambda r: _CapturingRunner(r, kept)),
        ):  # fmt: skip
            result = original(self, batch, *args, **kwargs)
        if kept:
            logits_output = kept[-1]
            try:
                _keep_roots(list(batch.reqs), logits_output.next_token_logits)
            except Exception as exc:  # never the step's failure
                LOG.warning("roots", "portable_spec: draft root logits not kept: %s", exc)
        return result

    return draft_extend


def wrap_can_run_graph(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EAGLEDraftCudaGraphRunner.can_run_graph``: no replay while a session drafts (the
    session's host work runs between the draft head's calls)."""

    def can_run_graph(self: Any, forward_batch: Any) -> Any:
        if _current() is not None:
            return False
        return original(self, forward_batch)

    return can_run_graph


# -- opening and staging -------------------------------------------------------------------------

_d2t_cache: dict[int, tuple[Any, np.ndarray]] = {}


def _d2t(worker: Any) -> np.ndarray | None:
    hot = getattr(worker, "hot_token_id", None)
    if hot is None:
        return None
    cached = _d2t_cache.get(id(worker))
    if cached is None or cached[0] is not hot:
        cached = (hot, np.asarray(hot.cpu(), dtype=np.int64))
        _d2t_cache.clear()
        _d2t_cache[id(worker)] = cached
    return cached[1]


def _open(worker: Any, batch: Any) -> EagleStep | None:
    """The draft's session with the root's top-k taken again; None when the step drafts as
    sglang does (see the module's docstring). Never raises."""
    mode = drafting.mode()
    if mode == "off" or not internals.decode_with_grammar(batch):
        return None
    spec = getattr(batch, "spec_info", None)
    if getattr(spec, "topk_index", None) is None:
        return None
    sampling_info = batch.sampling_info
    if internals.draft_probs_needed(sampling_info):
        LOG.warning("draft:rejection", "portable_spec: rejection sampling on a non-greedy "
                  "batch: its drafts are sglang's own")  # fmt: skip
        return None
    reqs = list(batch.reqs)
    vocab = int(sampling_info.vocab_size)
    plan = plan_step(reqs, vocab)
    if not plan.has_grammar or plan.whole_step or plan.own or plan.end_token is not None:
        return None
    if all(m is None for m in plan.matchers):
        return None
    try:
        return _start(worker, batch, spec, plan, reqs, vocab, mode)
    except Exception as exc:
        LOG.warning(f"draft:{type(exc).__name__}",
                  "portable_spec: drafting without grammar masks this step: %s", exc)  # fmt: skip
        return None


def _start(
    worker: Any, batch: Any, spec: Any, plan: Any, reqs: list, vocab: int, mode: str
) -> EagleStep:
    import torch

    topk, steps = int(worker.topk), int(worker.speculative_num_steps)
    # the root, the nodes each draft-head call runs on, the verify tree's other candidates
    most = 1 + topk * max(steps - 1, 0) + int(worker.speculative_num_draft_tokens)
    session = drafting.open_session(
        plan.matchers, vocab, device=torch.device(spec.topk_index.device), d2t=_d2t(worker),
        max_nodes=most,
    )  # fmt: skip
    step = EagleStep(
        session, plan, tuple(plan.grammars), topk, steps, masking=mode == "on",
    )  # fmt: skip
    try:
        if mode == "on":
            _mask_root(worker, batch, spec, step, reqs)
    except BaseException:
        step.close()
        raise
    return step


def _mask_root(worker: Any, batch: Any, spec: Any, step: EagleStep, reqs: list) -> None:
    """The root's top-k of the grammar requests whose draft logits were kept, taken again
    from those logits masked with their root rows (the others keep sglang's)."""
    import torch

    order, logits = _kept_roots(reqs, step.session_constrained())
    if not order:
        return
    if logits.shape[-1] != step.session.draft_vocab_size:
        LOG.warning("root:width", "portable_spec: the kept draft logits are %d wide, the "
                  "draft vocabulary %d: roots left unmasked", logits.shape[-1],
                  step.session.draft_vocab_size)  # fmt: skip
        return
    index = torch.tensor(order, dtype=torch.int64, device=spec.topk_index.device)
    rows = step.session.root_mask().index_select(0, index.to(logits.device))
    masked = ps.apply_vocab_mask(logits.clone(), rows)
    topk = step.topk
    if topk == 1:
        top_index = torch.argmax(masked, dim=-1, keepdim=True)
        top_p = torch.ones_like(top_index, dtype=spec.topk_p.dtype)
    else:
        probs = internals.draft_probs(masked, batch.sampling_info)
        top_p, top_index = internals.eagle_topk(probs, topk)
    topk_p, topk_index = spec.topk_p.clone(), spec.topk_index.clone()
    topk_p[index] = top_p.to(topk_p.dtype)
    topk_index[index] = top_index.to(topk_index.dtype)
    spec.topk_p, spec.topk_index = topk_p, topk_index


def _stage(step: EagleStep, result: Any) -> None:
    """Stage the drafted step for its verify build (never raises)."""
    try:
        _, top_scores_index, draft_tokens, _ = result
        staged = None
        if top_scores_index is not None and step.session is not None and not step.failed:
            staged = step.finish(top_scores_index, draft_tokens)
        STATS.update({"draft_steps": 1, "draft_rows": step.rows})
        if staged is None and not step.failed:
            LOG.warning(
                "draft:unmapped",
                "portable_spec: a draft tree sglang built could not be mapped to the drafted "
                "nodes; its verify mask is built afresh",
            )
            return
        drafting.stage(staged)
    except Exception as exc:
        logger.warning("portable_spec: drafted step not staged: %s", exc)
