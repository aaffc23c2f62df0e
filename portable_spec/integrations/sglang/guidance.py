"""The rows where sglang's llguidance grammar and the library's llguidance walk part ways.

sglang's ``GuidanceGrammar`` ends (``finished``) only on an end token given to a matcher that
has already stopped; an end token given to a matcher that may stop *or* go on is consumed by
the matcher, and sglang then fills that node's row (the end token alone) where the library
ends the path (an all-allowed row). Its children are refused or ended in both builds, so only
that node's row differs, and the root's when the matcher consumed an end token that way.

Those rows are rebuilt here by sglang's own methods, on a copy of the grammar replaying the
node's path: the request's matcher never moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec.integrations.sglang import internals
from portable_spec.integrations.sglang.grammars import Guided

__all__ = ["repaired_rows"]

_ENDED = "EndOfSentence"


def repaired_rows(
    guided: Sequence[Guided],
    tree: tuple[np.ndarray, np.ndarray, np.ndarray],
    valid: np.ndarray | None,
    end_token: int | None,
    words: int,
) -> list[tuple[int, Any]]:
    """``(mask row, int32 [words] torch row)`` for every row of the llguidance requests that
    sglang builds differently from the library. ``tree``: the step's host arrays (next token,
    next sibling, draft; ``[batch, nodes]``); ``valid``: the library's accepted nodes."""
    next_token, next_sibling, draft = tree
    nodes = draft.shape[1]
    out: list[tuple[int, Any]] = []
    for entry in guided:
        b = entry.index
        base = b * nodes
        matcher, _, eos = internals.guidance_parts(entry.grammar)
        if not entry.reasoning and matcher.stop_reason() == _ENDED:
            out.append((base, _row_after(entry.grammar, [], words)))
        if valid is None or nodes == 1:
            continue
        tokens = draft[b]
        candidates = [j for j in range(1, nodes) if valid[b, j] and int(tokens[j]) in eos]
        if not candidates:
            continue
        parent = _parents(next_token[b], next_sibling[b])
        for j in candidates:
            path = _grammar_path(parent, tokens, j, end_token if entry.reasoning else None)
            if not path:
                continue
            row = _row_after(entry.grammar, path, words)
            if row is not None:
                out.append((base + j, row))
    return out


def _parents(next_token: np.ndarray, next_sibling: np.ndarray) -> list[int]:
    nodes = len(next_token)
    parent = [-1] * nodes
    first = next_token.tolist()
    sibling = next_sibling.tolist()
    for p in range(nodes):
        child = first[p]
        seen = 0
        while child != -1 and seen < nodes:  # links are valid: the library checked them
            parent[child] = p
            child = sibling[child]
            seen += 1
    return parent


def _grammar_path(
    parent: list[int], tokens: np.ndarray, node: int, end_token: int | None
) -> list[int]:
    """The tokens the grammar consumes from the root to ``node`` (after the node that ends the
    reasoning, when ``end_token`` is given; empty if ``node`` is not below one)."""
    path = []
    j = node
    while j > 0:
        path.append(int(tokens[j]))
        j = parent[j]
    path.reverse()
    if end_token is None:
        return path
    if end_token not in path:
        return []
    return path[path.index(end_token) + 1 :]


def _row_after(grammar: Any, path: list[int], words: int) -> Any:
    """sglang's row after ``path``, as its walk fills it (None when sglang's grammar ends
    there: an all-allowed row, as the library's), on a copy of ``grammar``."""
    import torch

    copy = internals.guidance_copy(grammar)
    *before, last = path or [None]
    for token in before:
        copy.accept_token(token)
    if last is not None:
        matcher, _, _ = internals.guidance_parts(copy)
        if matcher.is_stopped():  # sglang ends the grammar on this end token
            return None
        copy.accept_token(last)
    if copy.is_terminated():
        return None
    row = torch.full((1, words), -1, dtype=torch.int32)
    copy.fill_vocab_mask(row, 0)
    return row[0]
