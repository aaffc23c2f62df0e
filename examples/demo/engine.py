"""The backend-neutral generation loop: grammar-constrained greedy decoding, speculative or not.

One speculative step, in the order the library is designed for::

    draft      drafter -> tree arrays (device or host) -> GrammarTree (its host copy starts);
               a grammar-aware drafter masks its own logits level by level with a
               DraftSession, which already holds every node's row
    launch     target forward over every tree node, tree attention (asynchronous)
    mask       blind drafts: build_grammar_vocab_mask over the tree; grammar-aware drafts:
               the session's verify_mask (the last level's rows, then one gather); host
               work that overlaps the forward
    sample     apply_vocab_mask to every node's logits, argmax per node (waits for both)
    accept     longest root path whose tokens equal the parent's argmax, plus the bonus token
    commit     KV cache rows of the accepted path compacted to consecutive positions;
               the matcher advanced by exactly the committed tokens

The plain path (``drafter=None``) is ordinary constrained greedy decoding: one token per step,
its mask filled straight from the xgrammar matcher (not through the library's tree builder),
so it is an independent reference for the speculative path.

The model is any object with the interface of ``examples.demo.jax_model.JaxLlama``
(``torch``: ``examples.demo.torch_model.TorchLlama``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from examples.demo.drafters import Draft, Drafter, GrammarContext
from portable_spec import build_grammar_vocab_mask, grammar_stats

__all__ = ["Generation", "StepReport", "accept_path", "generate", "required_max_len"]


@dataclass
class StepReport:
    """What one step did (times in milliseconds, ``perf_counter`` based).

    Attributes:
        tokens: the tokens this step committed (accepted drafts, then the bonus token).
        draft_ms: drafting until the tree arrays were on the host (the launch of the verify
            forward, which a device draft runs under, not counted).
        mask_build_ms: the grammar mask build (after the tree was on the host): for a
            grammar-aware draft, the session's verify mask (its last level's rows and the
            gather).
        verify_ms: the target forward, from its launch (or the draft's arrival, whichever is
            later) until its logits were ready.
        hidden_ms: the part of ``mask_build_ms`` during which the forward was still running.
        draft_nodes: drafted nodes of the verify tree (the root and padding not counted).
        valid_nodes: those whose root path the grammar accepts (an end token included).
        draft_mask_ms: host time a grammar-aware drafter spent on grammar rows while drafting
            (part of ``draft_ms``; 0 for blind drafts).
    """

    tokens: list[int]
    draft_ms: float
    mask_build_ms: float
    verify_ms: float
    hidden_ms: float
    draft_nodes: int = 0
    valid_nodes: int = 0
    draft_mask_ms: float = 0.0


@dataclass
class Generation:
    """The result of :func:`generate`.

    Attributes:
        tokens: generated token ids (the stop token included if it was produced).
        finished: the grammar accepted the stop token (the output is complete).
        steps: one report per decoding step.
        prefill_s, decode_s: wall time of the prompt prefill and of the decoding loop.
    """

    tokens: list[int]
    finished: bool
    steps: list[StepReport] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def accepted_per_step(self) -> list[int]:
        """Tokens committed per step (accepted draft tokens + the bonus token)."""
        return [len(s.tokens) for s in self.steps]

    @property
    def draft_nodes_per_step(self) -> list[int]:
        """Drafted nodes per step (0 without speculation)."""
        return [s.draft_nodes for s in self.steps]

    @property
    def valid_nodes_per_step(self) -> list[int]:
        """Grammar-valid drafted nodes per step."""
        return [s.valid_nodes for s in self.steps]

    @property
    def mean_accepted(self) -> float:
        """Mean tokens committed per step (1.0 without speculation)."""
        return len(self.tokens) / max(1, len(self.steps))

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (prefill excluded)."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def hidden_fraction(self) -> float:
        """Share of the total mask build time that overlapped the verify forward."""
        build = sum(s.mask_build_ms for s in self.steps)
        return sum(s.hidden_ms for s in self.steps) / build if build > 0 else 0.0


def required_max_len(prompt_len: int, max_new_tokens: int, nodes: int) -> int:
    """KV cache positions a generation needs, rounded up to a multiple of 64 (so nearby
    prompt lengths share JAX compilations)."""
    need = prompt_len + max_new_tokens + nodes + 1
    return -(-need // 64) * 64


def accept_path(
    next_token: np.ndarray, next_sibling: np.ndarray, draft: np.ndarray, argmax: np.ndarray
) -> list[int]:
    """Greedy acceptance: the longest root path whose every node's token equals its parent's
    (masked) argmax.

    Args:
        next_token, next_sibling, draft: one request's ``[nodes]`` host tree arrays.
        argmax: ``[nodes]`` masked greedy token of each node.

    Returns:
        Node indices of the accepted path, starting with the root (0). The bonus token is
        ``argmax[path[-1]]``.
    """
    path = [0]
    node = 0
    for _ in range(len(draft)):  # bounded by the node count even on a malformed tree
        want = argmax[node]
        child = int(next_token[node])
        while child != -1 and draft[child] != want:
            child = int(next_sibling[child])
        if child == -1:
            break
        path.append(child)
        node = child
    return path


def _accept_tokens(matcher: Any, tokens: Sequence[int]) -> bool:
    """Advance the matcher; returns whether it terminated (accepted the stop token)."""
    for t in tokens:
        if not matcher.accept_token(int(t)):
            raise RuntimeError(f"the grammar matcher refused token {t}, which its mask allowed")
    return bool(matcher.is_terminated())


def _commit_list(path_tokens: list[int], remaining: int, stop_ids: set[int]) -> list[int]:
    """Cut at the budget and after the first stop token."""
    out = []
    for t in path_tokens[:remaining]:
        out.append(t)
        if t in stop_ids:
            break
    return out


def generate(
    model: Any,
    matcher: Any,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    drafter: Drafter | None = None,
    on_step: Callable[[int, StepReport, list[int]], None] | None = None,
) -> Generation:
    """Grammar-constrained greedy generation, speculative when ``drafter`` is given.

    Args:
        model: a ``JaxLlama``/``TorchLlama`` whose ``max_len`` covers
            :func:`required_max_len` (its cache is reset here).
        matcher: an ``xgrammar.GrammarMatcher`` in its initial state; advanced by every
            generated token (terminated if the stop token was generated).
        prompt: prompt token ids (at least one).
        max_new_tokens: generation budget.
        stop_ids: tokens that end the generation (the grammar's stop tokens).
        drafter: a tree drafter, or None for one-token steps.
        on_step: called after each step with ``(step index, report, all tokens so far)``.

    Returns:
        The generated tokens and per-step measurements. Blocks until done.
    """
    if len(prompt) < 1:
        raise ValueError("the prompt must have at least one token")
    nodes = drafter.nodes if drafter is not None else 1
    need = required_max_len(len(prompt), max_new_tokens, nodes)
    if need > model.max_len:
        raise ValueError(f"the model's cache has {model.max_len} positions, {need} are needed")
    stops = {int(t) for t in stop_ids}
    vocab = model.config.vocab_size
    model.reset()
    t0 = time.perf_counter()
    model.prefill(np.asarray(prompt[:-1], dtype=np.int64))
    context = [int(t) for t in prompt]
    start = len(prompt) - 1  # tokens in the cache; the root context[-1] sits at `start`
    result = Generation(tokens=[], finished=False)
    t1 = time.perf_counter()
    result.prefill_s = t1 - t0
    bitmask = None if drafter is not None else _plain_bitmask(vocab)
    while len(result.tokens) < max_new_tokens and not result.finished:
        remaining = max_new_tokens - len(result.tokens)
        if drafter is None:
            report = _plain_step(model, matcher, context[-1], start, bitmask)
        else:
            report = _spec_step(model, matcher, drafter, context, start, vocab)
        report.tokens = _commit_list(report.tokens, remaining, stops)
        result.finished = _accept_tokens(matcher, report.tokens) or bool(
            stops.intersection(report.tokens)
        )
        start += len(report.tokens)
        context += report.tokens
        result.tokens += report.tokens
        result.steps.append(report)
        if on_step is not None:
            on_step(len(result.steps) - 1, report, result.tokens)
    result.decode_s = time.perf_counter() - t1
    return result


def _plain_bitmask(vocab: int) -> np.ndarray:
    return np.empty((1, -(-vocab // 32)), dtype=np.int32)


def _plain_step(model: Any, matcher: Any, root: int, start: int, bitmask: np.ndarray) -> StepReport:
    """One token: forward the root, fill the matcher's mask meanwhile, masked argmax."""
    import torch  # xgrammar's fill takes a torch view of the numpy buffer (no copy)

    launch = model.launch(
        np.array([root], np.int64), np.array([start], np.int64), start, np.ones((1, 1), bool)
    )
    t_launch = time.perf_counter()
    matcher.fill_next_token_bitmask(torch.from_numpy(bitmask))
    t_mask = time.perf_counter()
    token = int(model.masked_argmax(launch.logits(), bitmask)[0])
    finished_at = launch.wait()
    model.commit(launch, np.zeros(1, np.int64), start)
    return StepReport(
        tokens=[token],
        draft_ms=0.0,
        mask_build_ms=(t_mask - t_launch) * 1e3,
        verify_ms=(finished_at - t_launch) * 1e3,
        hidden_ms=max(0.0, min(t_mask, finished_at) - t_launch) * 1e3,
    )


def _spec_step(
    model: Any, matcher: Any, drafter: Drafter, context: list[int], start: int, vocab: int
) -> StepReport:
    """One speculative step (see the module docstring for the order)."""
    t_draft = time.perf_counter()
    grammar = GrammarContext(matcher, vocab, model.mask_device) if drafter.masked else None
    draft: Draft = drafter.draft(model, context, start, grammar)
    t_drafted = time.perf_counter()  # host drafts are done; device drafts are queued
    session = draft.session
    try:
        launch = model.launch(draft.tokens, draft.positions, start, draft.tree_mask)
        t_launch = time.perf_counter()
        next_token, next_sibling, tokens = draft.tree.resolve()  # waits for the draft only
        t_tree = time.perf_counter()
        if session is not None:
            mask = session.verify_mask(draft.select)  # no second walk: rows from drafting
            valid = int(session.valid(draft.select)[0, 1:].sum())
        else:
            before = grammar_stats()
            mask = build_grammar_vocab_mask([matcher], draft.tree, vocab, device=model.mask_device)
            after = grammar_stats()
            checked = after["checked_nodes"] - before["checked_nodes"]
            valid = int(checked - (after["rejected_nodes"] - before["rejected_nodes"]))
        t_mask = time.perf_counter()
    finally:
        if session is not None:
            session.close()
    argmax = model.masked_argmax(launch.logits(), mask)
    finished_at = launch.wait()
    path = accept_path(next_token[0], next_sibling[0], tokens[0], argmax)
    committed = [int(tokens[0][i]) for i in path[1:]] + [int(argmax[path[-1]])]
    src = np.full(drafter.nodes, path[-1], dtype=np.int64)  # static length; extras harmless
    src[: len(path)] = path
    model.commit(launch, src, start)
    # every drafted node has exactly one incoming link
    drafted = int((next_token[0] != -1).sum() + (next_sibling[0] != -1).sum())
    return StepReport(
        tokens=committed,
        draft_ms=((t_drafted - t_draft) + (t_tree - t_launch)) * 1e3,
        mask_build_ms=(t_mask - t_tree) * 1e3,
        verify_ms=(finished_at - max(t_launch, t_tree)) * 1e3,
        hidden_ms=max(0.0, min(t_mask, finished_at) - t_tree) * 1e3,
        draft_nodes=drafted,
        valid_nodes=valid,
        draft_mask_ms=draft.grammar_ms,
    )
