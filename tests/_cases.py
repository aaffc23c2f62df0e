"""Hypothesis-driven generation of verify-tree batches with realistic and hostile drafts."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xgrammar as xgr
from _oracle import ProtocolMatcher, Request, expected_mask
from hypothesis import strategies as st


@dataclass
class Case:
    requests: list[Request | None]
    matchers: list[Any]
    next_token: np.ndarray
    next_sibling: np.ndarray
    draft: np.ndarray
    vocab_size: int


def allowed_tokens(matcher: Any, words: int, size: int) -> np.ndarray:
    buf = np.zeros((1, words), dtype=np.int32)
    matcher.fill_next_token_bitmask(buf, 0)
    bits = np.unpackbits(buf.view(np.uint8), bitorder="little")[:size]
    return np.flatnonzero(bits)


def draw_case(
    data: st.DataObject,
    vocab: Any,
    *,
    max_batch: int = 4,
    max_nodes: int = 24,
    kinds: tuple[str, ...] = ("json_schema", "ebnf", "regex", "builtin_json"),
    protocol: bool = True,
    make_request: Callable[[str], Request] | None = None,
) -> Case:
    """Draw a batch: per request a grammar (or None) advanced by a valid prefix, a tree of
    random shape and sibling order with padding nodes, and drafts mixing grammar-valid,
    off-grammar, EOS and out-of-range tokens. Node ids are randomly permuted.

    ``make_request(kind)`` builds a request of another grammar engine (default: xgrammar on
    ``vocab.grammars``); the library gets its ``native()`` object."""
    if make_request is None:
        make_request = lambda kind: Request(vocab.grammars[kind])  # noqa: E731
    size, words = vocab.size, vocab.words
    batch = data.draw(st.integers(1, max_batch), label="batch")
    nodes = data.draw(st.integers(1, max_nodes), label="nodes")
    pad = data.draw(st.sampled_from([0, 0, 1, 31, 33, 200]), label="vocab padding")
    vocab_size = size + pad
    requests: list[Request | None] = []
    matchers: list[Any] = []
    nt = np.full((batch, nodes), -1, dtype=np.int64)
    ns = np.full((batch, nodes), -1, dtype=np.int64)
    dt = np.zeros((batch, nodes), dtype=np.int64)
    for b in range(batch):
        kind = data.draw(st.sampled_from((None, *kinds)), label="grammar")
        request = None
        if kind is not None:
            request = make_request(kind)
            m = request.fresh()
            for _ in range(data.draw(st.integers(0, 6), label="prefix length")):
                if m.is_terminated():
                    break
                options = allowed_tokens(m, words, size)
                options = options[options != vocab.eos] if len(options) > 1 else options
                if len(options) == 0:
                    break
                t = int(options[data.draw(st.integers(0, 10**6)) % len(options)])
                if t == vocab.eos and not getattr(m, "records_end", True):
                    break  # the engine could not show that this prefix ended
                assert m.accept_token(t)
                request.prefix.append(t)
            if (
                data.draw(st.integers(0, 9), label="terminate?") == 0
                and not m.is_terminated()
                and getattr(m, "records_end", True)  # the engine can show it ended
                and m.fork().accept_token(vocab.eos)
            ):
                m.accept_token(vocab.eos)
                request.prefix.append(vocab.eos)
        requests.append(request)
        # Tree in creation order (parent created first), then a random relabelling.
        states: dict[int, Any] = {}
        if request is not None:
            states[0] = request.fresh()
        children: dict[int, list[int]] = {0: []}
        tokens = [0] * nodes
        for j in range(1, nodes):
            if data.draw(st.integers(0, 9), label="padding?") == 0:
                continue  # no link will reach it
            parent = data.draw(st.sampled_from(sorted(children)), label="parent")
            position = data.draw(st.integers(0, len(children[parent])), label="sibling slot")
            children[parent].insert(position, j)
            children[j] = []
            category = data.draw(st.integers(0, 9), label="token category")
            st_parent = states.get(parent)
            if category <= 5 and st_parent is not None and not st_parent.is_terminated():
                options = allowed_tokens(st_parent, words, size)
                token = (
                    int(options[data.draw(st.integers(0, 10**6)) % len(options)])
                    if len(options)
                    else 0
                )
            elif category == 6:
                token = data.draw(st.integers(0, size - 1))
            elif category == 7:
                token = vocab.eos
            elif category == 8:
                token = data.draw(
                    st.sampled_from([-1, -(2**31), size, vocab_size, vocab_size + 5, 2**31 - 1])
                )
            else:
                token = data.draw(st.integers(size, max(size, vocab_size - 1)))
            tokens[j] = token
            if st_parent is not None and not st_parent.is_terminated() and 0 <= token < size:
                fork = st_parent.fork()
                if fork.accept_token(token):
                    states[j] = fork
        relabel = [0, *data.draw(st.permutations(range(1, nodes)), label="relabel")]
        for u, kids in children.items():
            for a, c in itertools.pairwise(kids):
                ns[b, relabel[a]] = relabel[c]
            if kids:
                nt[b, relabel[u]] = relabel[kids[0]]
        for j in range(nodes):
            dt[b, relabel[j]] = tokens[j]
        if request is None:
            matchers.append(None)
        elif protocol and data.draw(st.booleans(), label="protocol matcher?"):
            matchers.append(ProtocolMatcher(request.fresh(), vocab_size=size))
        else:
            matchers.append(request.native())
    return Case(requests, matchers, nt, ns, dt, vocab_size)


def fresh_xgrammar(request: Request) -> xgr.GrammarMatcher:
    return request.fresh()


def matrix_case(smollm2: Any, batch: int, nodes: int) -> tuple:
    """The backend matrix's batch: eight requests (four grammars, an unconstrained one, one
    padded tree) of six-node EAGLE-like trees with real tokens: accepted, rejected, EOS,
    negative and too-large ids. Returns ``(requests, nt, ns, dt, oracle mask)``."""
    assert (batch, nodes) == (8, 6), "the case is drawn for 8 requests of 6 nodes"
    rng = np.random.default_rng(11)
    kinds = ["json_schema", "ebnf", "regex", "builtin_json", None, "json_schema", "ebnf", "regex"]
    requests = [None if k is None else Request(smollm2.grammars[k]) for k in kinds]
    nt = np.full((batch, nodes), -1, np.int64)
    ns = np.full((batch, nodes), -1, np.int64)
    dt = np.zeros((batch, nodes), np.int64)
    for b, request in enumerate(requests):
        # root -> 1, 2 (siblings); 1 -> 3 -> 4; 2 -> 5 (node 5 left as padding in request 7)
        nt[b, [0, 1, 3, 2]] = [1, 3, 4, 5]
        ns[b, 1] = 2
        m = request.fresh() if request else None
        options = []
        if m is not None:
            buf = np.zeros((1, smollm2.words), np.int32)
            m.fill_next_token_bitmask(buf, 0)
            options = np.flatnonzero(np.unpackbits(buf.view(np.uint8), bitorder="little"))
        first = int(rng.choice(options)) if len(options) else 7
        dt[b, 1] = first
        dt[b, 2] = [smollm2.eos, -4, 2**31 - 1, int(rng.integers(0, smollm2.size))][b % 4]
        if m is not None and m.accept_token(first):
            m.fill_next_token_bitmask(buf, 0)
            options = np.flatnonzero(np.unpackbits(buf.view(np.uint8), bitorder="little"))
            if len(options):
                dt[b, 3] = int(rng.choice(options))
                dt[b, 4] = int(rng.choice(options))
        dt[b, 5] = int(rng.integers(0, smollm2.size))
    nt[7, 2] = -1  # node 5 of request 7 becomes unreachable padding
    want = expected_mask(requests, nt, ns, dt, smollm2.size, smollm2.words)
    return requests, nt, ns, dt, want
