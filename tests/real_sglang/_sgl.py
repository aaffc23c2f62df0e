"""What the sglang tests share: sglang's own grammar objects over SmolLM2's tokenizer, random
verify steps built with them, the plugin switched on and off, and state fingerprints.

Every grammar object here is sglang's (its backends' ``dispatch_*``, or its
``ReasonerGrammarObject``), every reference row sglang's own ``generate_token_bitmask``.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from conftest import DEVICE as _DEVICE

from portable_spec import testing
from portable_spec.integrations import sglang as plugin

#: what the run compared, printed at its end (conftest.py)
COUNTS: collections.Counter[str] = collections.Counter()

#: where the masks go (conftest.py): the CPU, or CUDA on a GPU host
DEVICE = torch.device(_DEVICE)
#: for the tests that drive sglang's verify step with CPU tensors and its kernels interpreted
cpu_only = pytest.mark.skipif(
    DEVICE.type != "cpu", reason="drives sglang's verify step on CPU (Triton's interpreter)"
)

VOCAB = 49152  # SmolLM2's tokenizer
PADDED = VOCAB + 64  # a model vocabulary padded past the tokenizer's

#: the grammars requests draw from: (dispatch kind, key)
GRAMMARS = {
    "json_schema": ("json", json.dumps(testing.PERSON_SCHEMA)),
    "object": ("json", json.dumps({"type": "object"})),
    "ebnf": ("ebnf", testing.EBNF_KEY_VALUES),
    "regex": ("regex", testing.REGEX_DATE_EMAIL),
    # grammars that may end or go on (an end token is then consumed by llguidance's matcher)
    "words": ("regex", "[a-z]{1,3}( [0-9]+)*"),
    "loop": ("regex", "(ab|c)+"),
}


@functools.cache
def tokenizer() -> Any:
    return testing.hf_tokenizer()


def eos() -> int:
    return int(tokenizer().eos_token_id)


@functools.cache
def backend(name: str, vocab_size: int = VOCAB) -> Any:
    """sglang's grammar backend ``name`` (``xgrammar``, ``llguidance``, ``outlines``) for the
    model vocabulary ``vocab_size``."""
    if name == "xgrammar":
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

        return XGrammarGrammarBackend(
            tokenizer(), vocab_size=vocab_size, model_eos_token_ids=[eos()]
        )
    if name == "llguidance":
        from sglang.srt.constrained.llguidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer(), n_vocab=vocab_size, eos_token_ids=[eos()])
    if name == "outlines":
        from sglang.srt.constrained.outlines_backend import OutlinesGrammarBackend

        return OutlinesGrammarBackend(tokenizer(), whitespace_pattern=None)
    raise ValueError(name)


def grammar(backend_name: str, kind: str, vocab_size: int = VOCAB) -> Any:
    """A fresh sglang grammar object (what a request holds) of sample grammar ``kind``."""
    dispatch, key = GRAMMARS[kind]
    made = getattr(backend(backend_name, vocab_size), f"dispatch_{dispatch}")(key)
    assert made is not None and type(made).__name__ != "InvalidGrammarObject", made
    return made


def reasoner(inner: Any, end_ids: tuple[int, ...], *, thinking: bool, **kwargs: Any) -> Any:
    """sglang's ``ReasonerGrammarObject`` around ``inner``, still reasoning or answering."""
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    wrapped = ReasonerGrammarObject(inner, end_ids, **kwargs)
    wrapped.maybe_init_reasoning(thinking)
    return wrapped


class Req:
    """What sglang's mask build reads of a request: its grammar."""

    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar


class SamplingInfo:
    """What sglang's mask build reads and writes of ``SamplingBatchInfo``."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.grammar_mask: Any = "left from the extend step"


# -- the plugin switched on and off ------------------------------------------------------------


@contextmanager
def plugin_on(mode: str = "on") -> Iterator[None]:
    assert plugin.install(mode), "the plugin does not recognise this sglang"
    try:
        yield
    finally:
        plugin.uninstall()


def spec_utils() -> Any:
    from sglang.srt.speculative import spec_utils as module

    return module


def sglang_rows(reqs: list[Req], tree: tuple[torch.Tensor, ...], vocab_size: int) -> Any:
    """sglang's own ``generate_token_bitmask``: the host mask (or None)."""
    mask, _ = spec_utils().generate_token_bitmask(reqs, *tree, vocab_size)
    return mask


# -- grammar states ----------------------------------------------------------------------------


def allowed(grammar: Any, words: int) -> np.ndarray:
    """The tokens sglang's own fill allows next (every token where the fill writes nothing)."""
    if type(grammar).__name__ == "OutlinesGrammar":  # a boolean row: True bans the token
        banned = torch.zeros((1, 32 * words), dtype=torch.bool)
        grammar.fill_vocab_mask(banned, 0)
        return np.flatnonzero(~banned[0].numpy())
    row = torch.full((1, words), -1, dtype=torch.int32)
    grammar.fill_vocab_mask(row, 0)
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def advance(
    grammar: Any, steps: int, rng: np.random.Generator, words: int, end: float = 0.0
) -> None:
    """Accept ``steps`` tokens the grammar allows (sglang's ``accept_token``); each step ends
    the grammar with its end token where allowed, with probability ``end``."""
    for _ in range(steps):
        if grammar.is_terminated():
            return
        tokens = allowed(grammar, words)
        if len(tokens) == 0:
            return
        if eos() in tokens and rng.random() < end:
            grammar.accept_token(eos())
            return
        tokens = tokens[tokens != eos()]
        if len(tokens) == 0:
            return
        grammar.accept_token(int(rng.choice(tokens)))


def fingerprint(grammar: Any, words: int) -> tuple:
    """What a later step reads of ``grammar``: its next row, whether it ended, and the fields
    sglang's wrappers keep."""
    if grammar is None:
        return (None,)
    state: list[Any] = [type(grammar).__name__, grammar.is_terminated()]
    if not grammar.is_terminated():
        state.append(allowed(grammar, words).tobytes())
    for field in ("accepted_tokens", "finished", "tokens_in_think", "tokens_after_end",
                  "_matched_think_end_tokens", "_thinking_match_history"):  # fmt: skip
        if hasattr(grammar, field):
            state.append(repr(getattr(grammar, field)))
    inner = getattr(grammar, "grammar", None)
    if inner is not None and type(grammar).__name__ == "ReasonerGrammarObject":
        state.append(fingerprint(inner, words))
    matcher = getattr(grammar, "ll_matcher", None)
    if matcher is not None:
        state.append((matcher.is_stopped(), matcher.stop_reason()))
    return tuple(state)


# -- random steps ------------------------------------------------------------------------------


def random_tree(
    rng: np.random.Generator,
    grammar: Any,
    nodes: int,
    vocab_size: int,
    words: int,
    chain: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random tree (random parents and sibling order; a chain with ``chain``) whose drafts
    mix tokens the grammar allows where they stand (chosen by walking it with sglang's own
    methods), end tokens, ids past the vocabulary and random ids."""
    if chain:
        parent = [-1, *range(nodes - 1)]
    else:
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, nodes)]
    children: list[list[int]] = [[] for _ in range(nodes)]
    for j in range(1, nodes):
        children[parent[j]].append(j)
    next_token = np.full(nodes, -1, np.int64)
    next_sibling = np.full(nodes, -1, np.int64)
    draft = np.zeros(nodes, np.int64)
    draft[0] = int(rng.integers(0, vocab_size))
    for p in range(nodes):
        kids = children[p]
        rng.shuffle(kids)
        if kids:
            next_token[p] = kids[0]
        for a, b in itertools.pairwise(kids):
            next_sibling[a] = b

    ends = tuple(getattr(grammar, "think_end_ids", ()))  # a reasoner's end of reasoning

    def visit(p: int, live: bool) -> None:
        for c in children[p]:
            options = allowed(grammar, words) if live and not grammar.is_terminated() else None
            r = rng.random()
            follows = [k + 1 for k, t in enumerate(ends[:-1]) if t == draft[p]]
            if follows and r < 0.5:  # the rest of a multi-token end
                token = int(ends[follows[0]])
            elif ends and r < 0.15:
                token = int(ends[int(rng.integers(0, len(ends)))])
            elif options is not None and len(options) and r < 0.55:
                token = int(rng.choice(options))
            elif r < 0.67:
                token = eos()
            elif r < 0.77:
                token = vocab_size + int(rng.integers(0, 40))
            else:
                token = int(rng.integers(0, vocab_size))
            draft[c] = token
            if options is not None and token < vocab_size and token in set(options.tolist()):
                grammar.accept_token(token)
                visit(c, True)
                grammar.rollback(1)
            else:
                visit(c, False)

    if grammar is not None:
        visit(0, True)
    else:
        draft[1:] = rng.integers(0, vocab_size, nodes - 1)
    return next_token, next_sibling, draft


def random_step(
    rng: np.random.Generator,
    make: Callable[[np.random.Generator], Any],
    batch: int,
    nodes: int,
    vocab_size: int,
    chain: bool = False,
) -> tuple[list[Req], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``batch`` requests whose grammars ``make(rng)`` returns (None: unconstrained), each
    with a random tree (or chain) of ``nodes`` nodes."""
    words = (vocab_size + 31) // 32
    reqs, trees = [], []
    for _ in range(batch):
        made = make(rng)
        reqs.append(Req(made))
        trees.append(random_tree(rng, made, nodes, vocab_size, words, chain))
    tree = tuple(torch.from_numpy(np.stack([t[i] for t in trees])) for i in range(3))
    return reqs, tree  # type: ignore[return-value]
