"""What the verify tests share: a fake target model whose logits attack the grammar, and the
check that committed tokens are grammatical.

The target's logits at each accepted node of a request's tree favour a token the grammar
allows there (a draft child where one is allowed, so that verification goes deeper), and at
most nodes put a token the grammar refuses far above it: with sglang's mask applied the
allowed token wins, without it the refused one is committed.
"""

from __future__ import annotations

from typing import Any

import _sgl
import numpy as np
import torch


def node_allowed(grammar: Any, next_token, next_sibling, draft, vocab_size: int) -> list:
    """Per node: the tokens the grammar allows after its path (None for a node the grammar
    refuses or ends before; every token for a request without a grammar), by replaying each
    node's path with sglang's own grammar methods on the request's grammar object (rolled
    back afterwards)."""
    nodes = len(draft)
    words = (vocab_size + 31) // 32
    out: list = [None] * nodes
    if grammar is None:
        return [np.arange(vocab_size)] * nodes
    parent = [-1] * nodes
    for p in range(nodes):
        c = int(next_token[p])
        while c != -1:
            parent[c] = p
            c = int(next_sibling[c])
    for j in range(nodes):
        path, k = [], j
        while k > 0:
            path.append(int(draft[k]))
            k = parent[k]
        if k != 0:
            continue  # not reached from the root
        path.reverse()
        taken = 0
        ok = not grammar.is_terminated()
        for token in path:
            if not ok or grammar.is_terminated():
                ok = False
                break
            if token >= vocab_size or token not in set(_sgl.allowed(grammar, words).tolist()):
                ok = False
                break
            grammar.accept_token(token)
            taken += 1
        if ok and not grammar.is_terminated():
            tokens = _sgl.allowed(grammar, words)
            out[j] = tokens[tokens < vocab_size]
        if taken:
            grammar.rollback(taken)
    return out


def attack_logits(
    reqs: list, tree: tuple, vocab_size: int, rng: np.random.Generator, attack: float = 0.7
) -> torch.Tensor:
    """The fake target's ``[batch * nodes, vocab]`` logits for a step's trees."""
    next_token, next_sibling, draft = (t.numpy() for t in tree)
    batch, nodes = draft.shape
    logits = torch.from_numpy(rng.standard_normal((batch * nodes, vocab_size)).astype(np.float32))
    for b, req in enumerate(reqs):
        allowed = node_allowed(req.grammar, next_token[b], next_sibling[b], draft[b], vocab_size)
        for j in range(nodes):
            row = logits[b * nodes + j]
            options = allowed[j]
            if options is None or len(options) == 0:
                continue
            children = []
            c = int(next_token[b, j])
            while c != -1:
                children.append(int(draft[b, c]))
                c = int(next_sibling[b, c])
            good = [t for t in children if t in set(options.tolist())]
            favourite = good[0] if good and rng.random() < 0.8 else int(rng.choice(options))
            row[favourite] += 8.0
            if req.grammar is not None and rng.random() < attack:
                refused = np.setdiff1d(rng.integers(0, vocab_size, 64), options)
                if len(refused):
                    row[int(refused[0])] += 20.0
    return logits


def grammatical(grammar: Any, tokens: list[int]) -> bool:
    """Whether sglang's grammar object accepts ``tokens`` in order from its state (up to and
    including the first end token; the request ends there), on a copy of it."""
    if grammar is None:
        return True
    kind = type(grammar).__name__
    if kind == "ReasonerGrammarObject":
        raise NotImplementedError
    if kind == "XGrammarGrammar":
        matcher = grammar.matcher.fork()
        for token in tokens:
            if matcher.is_terminated():
                return True
            if not matcher.accept_token(token):
                return False
        return True
    if kind == "GuidanceGrammar":
        copy = type(grammar)(
            grammar.llguidance_tokenizer,
            grammar.serialized_grammar,
            ll_matcher=grammar.ll_matcher.deep_copy(),
        )
        copy.finished = grammar.finished
        for token in tokens:
            if copy.finished:
                return True
            if copy.ll_matcher.is_stopped() and token in copy.eos_tokens:
                return True
            if not copy.ll_matcher.validate_tokens([token]):
                return False
            copy.accept_token(token)
        return True
    raise TypeError(kind)


def committed(next_token_ids: torch.Tensor, accept_lens: torch.Tensor, nodes: int) -> list:
    """Per request, the tokens a step commits (accepted drafts, then the bonus token), read
    from the front of its block of ``next_token_ids``."""
    ids = next_token_ids.view(-1, nodes)
    return [ids[b, : int(n)].tolist() for b, n in enumerate(accept_lens)]
