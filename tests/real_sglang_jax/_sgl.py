"""Shared material of the sglang-jax tests: SmolLM2's tokenizer as sglang-jax takes it, grammars
from sglang-jax's own llguidance backend, real EAGLE trees and chains built by sglang-jax's own
draft-loop functions, and an independent reference (a fresh matcher replayed per node).

The reference shares no code with the library or the integration: a node's row is the mask of
a *new* ``LLMatcher`` (sglang-jax's tokenizer and serialized grammar) after the request's
prefix and the node's root path, consumed token by token.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np

VOCAB = 49152
#: what the tests checked against the reference (printed at the end of the run)
CHECKED = {"rows": 0, "tokens": 0, "requests": 0}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
KEY_VALUES = r"""
start: line+
line: KEY "=" VALUE "\n"
KEY: /[a-z]{1,8}/
VALUE: /[0-9]{1,4}/
"""
GRAMMARS = {
    "json": ("json", json.dumps(PERSON)),
    "regex": ("regex", DATE),
    "ebnf": ("ebnf", 'root ::= "{" ("\\"a\\"" | "\\"bc\\"") ":" [0-9]+ "}"'),
}


@lru_cache(maxsize=1)
def hf_tokenizer() -> Any:
    """SmolLM2's tokenizer as a ``transformers.PreTrainedTokenizerFast`` (what sglang-jax's
    llguidance backend takes), rebuilt from the GGUF on disk."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from portable_spec.testing import load_tokenizer, load_vocab

    vocab = load_vocab()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(load_tokenizer().backend_json()),
        eos_token=vocab.tokens[vocab.eos_id],
        bos_token=vocab.tokens[1],
        unk_token=vocab.tokens[0],
        pad_token=vocab.tokens[2],
    )
    return tok


@lru_cache(maxsize=1)
def backend() -> Any:
    """sglang-jax's own ``GuidanceBackend`` for SmolLM2 (as its scheduler creates it)."""
    from sgl_jax.srt.constrained.llguidance_backend import get_guidance_backend

    return get_guidance_backend(tokenizer=hf_tokenizer(), n_vocab=VOCAB, num_threads=1)


def grammar(kind: str, prefix: Sequence[int] = ()) -> Any:
    """A fresh sglang-jax ``GuidanceGrammar`` of a sample, advanced over ``prefix`` with its own
    ``accept_token``."""
    key_type, key_string = GRAMMARS[kind]
    g = backend()._dispatch(key_type, key_string)
    for t in prefix:
        g.accept_token(int(t))
    return g


def oracle_for(case: dict) -> Oracle | None:
    """The reference of an engine_run case's constraint (None: unconstrained)."""
    for key, kind in (("json_schema", "json"), ("regex", "regex")):
        if key in case:
            g = backend()._dispatch(kind, case[key])
            return Oracle.of(g, [])
    return None


def encode(text: str) -> list[int]:
    return list(hf_tokenizer().encode(text, add_special_tokens=False))


def eos() -> int:
    return int(hf_tokenizer().eos_token_id)


# -- the reference -----------------------------------------------------------------------------
@dataclass
class Oracle:
    """Rows of one request's grammar by replay on fresh matchers (``None``: all-allowed, the
    path was refused by the grammar or ended it)."""

    tokenizer: Any
    serialized: str
    prefix: list[int]
    cache: dict[tuple[int, ...], np.ndarray | None] = field(default_factory=dict)

    @classmethod
    def of(cls, g: Any, prefix: Sequence[int]) -> Oracle:
        return cls(g.llguidance_tokenizer, g.serialized_grammar, [int(t) for t in prefix])

    def fresh(self) -> Any:
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, self.serialized, log_level=0)
        for t in self.prefix:
            if m.is_stopped():
                break
            assert m.consume_token(t), f"prefix token {t} refused"
        return m

    def row(self, path: Sequence[int]) -> np.ndarray | None:
        """bool ``[VOCAB]`` of the tokens allowed after ``path``, or None (all allowed)."""
        key = tuple(int(t) for t in path)
        if key in self.cache:
            return self.cache[key]
        m = self.fresh()
        result: np.ndarray | None = None
        ok = m.stop_reason() != "EndOfSentence"
        for t in key:
            if not ok:
                break
            allowed = _bits(m)
            if not (0 <= t < VOCAB and allowed[t]):
                ok = False
                break
            if m.is_stopped():  # complete grammar: the allowed token is an end token
                ok = False
                break
            m.consume_token(t)
            if m.stop_reason() == "EndOfSentence":
                ok = False
        if ok:
            result = _bits(m)
        self.cache[key] = result
        return result

    def end_of(self, tokens: Sequence[int]) -> int | None:
        """Index of the token of ``tokens`` that ends the grammar (an end token consumed), or
        None: the length a scheduler keeps of a step's accepted tokens is that + 1."""
        m = self.fresh()
        for i, t in enumerate(tokens):
            allowed = _bits(m)
            if not (0 <= int(t) < VOCAB and allowed[int(t)]):
                return None
            if m.is_stopped():
                return i
            m.consume_token(int(t))
            if m.stop_reason() == "EndOfSentence":
                return i
        return None

    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether a fresh matcher takes ``tokens`` (up to an end token) one by one."""
        m = self.fresh()
        for t in tokens:
            if m.stop_reason() == "EndOfSentence":
                return True
            allowed = _bits(m)
            if not (0 <= int(t) < VOCAB and allowed[int(t)]):
                return False
            if m.is_stopped():
                return True
            m.consume_token(int(t))
        return True


def _bits(matcher: Any) -> np.ndarray:
    raw = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    bits = np.unpackbits(raw, bitorder="little").astype(bool)
    out = np.zeros(VOCAB, dtype=bool)
    n = min(VOCAB, len(bits))
    out[:n] = bits[:n]
    return out


def children_of(next_token: np.ndarray, next_sibling: np.ndarray, node: int) -> list[int]:
    out, c, steps = [], int(next_token[node]), 0
    while c != -1 and steps <= len(next_token):
        out.append(c)
        c, steps = int(next_sibling[c]), steps + 1
    return out


def paths_of(next_token: np.ndarray, next_sibling: np.ndarray, draft: np.ndarray) -> dict:
    """node -> its root path (draft tokens after the root), by a plain walk of the links."""
    paths = {0: ()}
    stack = [0]
    while stack:
        u = stack.pop()
        for c in children_of(next_token, next_sibling, u):
            paths[c] = (*paths[u], int(draft[c]))
            stack.append(c)
    return paths


def greedy_walk(
    oracle: Oracle | None,
    logits: np.ndarray,
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    steps: int,
) -> list[int]:
    """The tokens a masked greedy verify commits for one request: from the root, the masked
    argmax of each node's logits; the first child (in sibling order) holding it is accepted,
    at most ``steps`` drafts; the last argmax is the bonus. ``oracle`` None: unmasked."""
    node, path, out = 0, [], []
    for depth in range(steps + 1):
        row = oracle.row(path) if oracle is not None else None
        values = logits[node]
        if row is not None:
            values = np.where(row, values, -np.inf)
        target = int(np.argmax(values))
        out.append(target)
        if depth == steps:
            break
        nxt = [c for c in children_of(next_token, next_sibling, node) if int(draft[c]) == target]
        if not nxt:
            break
        node = nxt[0]
        path.append(target)
    return out


# -- trees and chains built by sglang-jax's own draft-loop functions ---------------------------
@dataclass
class Case:
    """A verify batch: sglang-jax's ``EagleVerifyInput`` arrays (host copies) and per request
    its grammar object (or None), prefix and oracle."""

    grammars: list[Any]
    oracles: list[Oracle | None]
    draft: np.ndarray  # [bs, N]
    next_token: np.ndarray  # [bs, N]
    next_sibling: np.ndarray  # [bs, N]
    retrive_index: np.ndarray  # [bs, N]
    positions: np.ndarray  # [bs * N]
    tree_mask: Any
    topk: int
    steps: int
    nodes: int

    @property
    def batch(self) -> int:
        return len(self.grammars)


def _pick(rng: np.random.Generator, row: np.ndarray | None, k: int, valid_share: float) -> list:
    """``k`` distinct tokens: grammar-allowed ones with probability ``valid_share`` each."""
    allowed = np.flatnonzero(row) if row is not None else np.arange(VOCAB)
    out: list[int] = []
    while len(out) < k:
        if len(allowed) and rng.random() < valid_share:
            t = int(rng.choice(allowed[:4096] if len(allowed) > 4096 else allowed))
        else:
            t = int(rng.integers(0, VOCAB))
        if t not in out:
            out.append(t)
    return out


def build_case(
    kinds: Sequence[str | None],
    prefixes: Sequence[Sequence[int]],
    topk: int,
    steps: int,
    nodes: int,
    seed: int,
    valid_share: float = 0.75,
) -> Case:
    """A batch of real verify trees (``topk > 1``: sglang-jax's ``select_top_k_tokens``,
    ``update_eagle_lists`` and ``build_tree_kernel_efficient``; ``topk == 1``:
    ``build_chain_verify_inputs``), the draft tokens picked level by level from each node's
    grammar row (mostly allowed tokens, some random)."""
    import jax.numpy as jnp
    from sgl_jax.srt.speculative.eagle_draft_worker import (
        select_top_k_tokens,
        update_eagle_lists,
    )
    from sgl_jax.srt.speculative.eagle_util import (
        build_chain_verify_inputs,
        build_tree_kernel_efficient,
    )

    rng = np.random.default_rng(seed)
    bs = len(kinds)
    grammars = [grammar(k, p) if k else None for k, p in zip(kinds, prefixes, strict=True)]
    oracles = [
        Oracle.of(g, p) if g is not None else None for g, p in zip(grammars, prefixes, strict=True)
    ]
    roots = np.array([p[-1] if len(p) else 0 for p in prefixes], dtype=np.int32)
    seq_lens = np.array([len(p) + 8 for p in prefixes], dtype=np.int32)

    def row(b: int, path: Sequence[int]) -> np.ndarray | None:
        return oracles[b].row(path) if oracles[b] is not None else None

    mesh = mesh_1()
    if topk == 1:
        chains = np.zeros((bs, steps), dtype=np.int32)
        for b in range(bs):
            path: list[int] = []
            for i in range(steps):
                t = _pick(rng, row(b, path), 1, valid_share)[0]
                chains[b, i] = t
                path.append(t)
        packed = build_chain_verify_inputs(roots, chains, seq_lens, nodes, bs)
        draft, positions, retrive_index, nt, ns = (np.array(a) for a in packed)
        return Case(grammars, oracles, draft.reshape(bs, nodes), nt.reshape(bs, nodes),
                    ns.reshape(bs, nodes), retrive_index.reshape(bs, nodes), positions, None,
                    topk, steps, nodes)  # fmt: skip

    # level 1: the root's children
    tokens = np.array([_pick(rng, row(b, []), topk, valid_share) for b in range(bs)], np.int32)
    probs = rng.dirichlet(np.ones(topk), size=bs).astype(np.float32)
    paths = [[(int(t),) for t in tokens[b]] for b in range(bs)]  # the step's input nodes
    hidden = jnp.zeros((bs, 8), jnp.float32)
    score_list = jnp.empty((bs, 1 + (steps - 1) * topk, topk))
    token_list = jnp.empty((bs, topk + (steps - 1) * topk * topk), dtype=jnp.int32)
    parents_list = jnp.empty((bs, topk + 1 + (steps - 1) * topk))
    scores = None
    topk_p, topk_index = jnp.asarray(probs), jnp.asarray(tokens)
    for i in range(steps):
        _, hidden, scores, tree_info = select_top_k_tokens(
            i, topk_p, topk_index, hidden, scores, topk
        )
        score_list, token_list, parents_list = update_eagle_lists(
            i, score_list, token_list, parents_list, tree_info, topk
        )
        if i > 0:  # the nodes selected for the next step: children of this step's inputs
            chosen = np.asarray(tree_info[2]) - (topk * topk * (i - 1) + topk)
            children = np.asarray(topk_index).reshape(bs, topk * topk)
            paths = [
                [(*paths[b][c // topk], int(children[b, c])) for c in chosen[b]] for b in range(bs)
            ]
        if i == steps - 1:
            break
        # the draft head's top-k after each input node: tokens picked from its grammar row
        nxt = np.array(
            [[_pick(rng, row(b, p), topk, valid_share) for p in paths[b]] for b in range(bs)],
            dtype=np.int32,
        ).reshape(bs * topk, topk)
        topk_index = jnp.asarray(nxt)
        topk_p = jnp.asarray(rng.dirichlet(np.ones(topk), size=bs * topk).astype(np.float32))
    with interpret():
        tree_mask, positions, retrive_index, nt, ns, draft = build_tree_kernel_efficient(
            jnp.asarray(roots), score_list, token_list, parents_list, jnp.asarray(seq_lens),
            int(seq_lens.sum()), topk, nodes, 256, bs, steps, mesh,
        )  # fmt: skip
    return Case(grammars, oracles, np.array(draft).reshape(bs, nodes), np.array(nt),
                np.array(ns), np.array(retrive_index), np.array(positions), tree_mask,
                topk, steps, nodes)  # fmt: skip


def logits_for(case: Case, seed: int, accept_share: float = 0.8) -> np.ndarray:
    """float32 ``[bs * N, VOCAB]`` verify logits that make the mask matter: at each node a
    token the grammar refuses gets the highest logit, and with probability ``accept_share`` an
    allowed child's draft token is the highest allowed one (so masked verification accepts
    deep paths, unmasked verification stops at the refused token)."""
    rng = np.random.default_rng(seed)
    bs, n = case.batch, case.nodes
    logits = rng.standard_normal((bs * n, VOCAB), dtype=np.float32)
    for b in range(bs):
        paths = paths_of(case.next_token[b], case.next_sibling[b], case.draft[b])
        for node, path in paths.items():
            r = b * n + node
            allowed = case.oracles[b].row(path) if case.oracles[b] is not None else None
            if allowed is not None:
                refused = np.flatnonzero(~allowed)
                if len(refused):
                    logits[r, int(rng.choice(refused))] = 30.0
            kids = children_of(case.next_token[b], case.next_sibling[b], node)
            ok = [c for c in kids if allowed is None or allowed[int(case.draft[b, c])]]
            if ok and rng.random() < accept_share:
                logits[r, int(case.draft[b, ok[int(rng.integers(len(ok)))]])] = 20.0
    return logits


def expected(case: Case, logits: np.ndarray, masked: bool = True) -> list[list[int]]:
    return [
        greedy_walk(
            case.oracles[b] if masked else None,
            logits[b * case.nodes : (b + 1) * case.nodes],
            case.next_token[b],
            case.next_sibling[b],
            case.draft[b],
            case.steps,
        )
        for b in range(case.batch)
    ]


# -- sglang-jax's own objects ------------------------------------------------------------------
@lru_cache(maxsize=1)
def mesh_1() -> Any:
    import jax

    return jax.make_mesh((1, 1), ("data", "tensor"))


@contextlib.contextmanager
def interpret() -> Iterator[None]:
    """sglang-jax's Pallas-TPU kernels run in interpret mode on CPU."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode(), jax.set_mesh(mesh_1()):
        yield


def verify_input(case: Case) -> Any:
    import jax.numpy as jnp
    from sgl_jax.srt.speculative.eagle_info import EagleVerifyInput

    return EagleVerifyInput(
        draft_token=jnp.asarray(case.draft.reshape(-1)),
        custom_mask=case.tree_mask,
        positions=jnp.asarray(case.positions),
        retrive_index=jnp.asarray(case.retrive_index),
        retrive_next_token=jnp.asarray(case.next_token),
        retrive_next_sibling=jnp.asarray(case.next_sibling),
        spec_steps=case.steps,
        draft_token_num=case.nodes,
    )


def worker_batch(case: Case, *, greedy: bool = True, temperature: float = 1.0) -> Any:
    """sglang-jax's ``ModelWorkerBatch`` of a verify step (the fields verify and sample read)."""
    from sgl_jax.srt.managers.schedule_batch import ModelWorkerBatch, ModelWorkerSamplingInfo
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    bs, n = case.batch, case.nodes
    info = ModelWorkerSamplingInfo(
        temperatures=np.full((bs, 1), 1.0 if greedy else temperature, np.float32),
        top_ps=np.ones(bs, np.float32),
        top_ks=np.full(bs, 1 if greedy else VOCAB, np.int32),
        min_ps=np.zeros(bs, np.float32),
        vocab_size=VOCAB,
        is_all_greedy=greedy,
        grammars=list(case.grammars) if any(g is not None for g in case.grammars) else None,
    )
    return ModelWorkerBatch(
        bid=0,
        forward_mode=ForwardMode.DECODE,
        input_ids=np.zeros(bs * n, np.int32),
        real_input_ids_len=bs * n,
        seq_lens=np.full(bs, 16, np.int32),
        out_cache_loc=np.zeros(bs * n, np.int32),
        req_pool_indices=np.arange(bs, dtype=np.int32),
        sampling_info=info,
        positions=case.positions,
        cache_loc=np.zeros(1, np.int32),
        return_logprob=False,
        return_output_logprob_only=False,
        top_logprobs_nums=None,
        token_ids_logprobs=None,
        extend_seq_lens=None,
        extend_prefix_lens=None,
        extend_logprob_start_lens=None,
        extend_input_logprob_token_ids=None,
        logits_indices=None,
        real_bs=bs,
        real_bs_per_dp=[bs],
        logits_indices_selector=np.arange(bs, dtype=np.int32),
        per_dp_bs_size=bs,
        speculative_eagle_topk=case.topk,
        speculative_num_steps=case.steps,
        speculative_num_draft_tokens=n,
    )


def committed(case: Case, predict: Any, accept_length: Any) -> list[list[int]]:
    """What sglang-jax's scheduler commits from a verify's outputs: its own
    ``resolve_spec_decode_token_ids`` (patched or not, as the process has it)."""
    from sgl_jax.srt.speculative import overlap_utils

    reqs = [
        SimpleNamespace(finished=lambda: False, grammar=g, to_finish=None) for g in case.grammars
    ]
    batch = SimpleNamespace(
        per_dp_bs_size=case.batch, dp_size=1, reqs_info=[SimpleNamespace(reqs=reqs)]
    )
    result = SimpleNamespace(
        next_token_ids=np.asarray(predict), accept_lens=np.asarray(accept_length)
    )
    tokens, _ = overlap_utils.resolve_spec_decode_token_ids(result, batch, case.nodes)
    return [list(map(int, t)) for t in tokens]
