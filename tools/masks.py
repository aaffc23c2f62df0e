"""``scripts/masks.sh`` (``python -m tools masks``): build grammar masks for a sample batch
on a real vocabulary.

A quick, self-contained look at the builder: SmolLM2's 49152-token vocabulary, the sample
grammars, EAGLE-like draft trees whose tokens mostly follow the grammar, and a report of what
each request's tree looked like to the grammar.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

__all__ = ["decode_tokens", "main", "sample_batch"]


def decode_tokens(info: Any, tokens: list[int]) -> str:
    """The text of ``tokens`` (UTF-8, invalid bytes replaced), from an
    ``xgrammar.TokenizerInfo``'s decoded vocabulary: what the model writes, not the
    tokenizer's byte-level alphabet ("Ġ" for a space)."""
    table = info.decoded_vocab
    return b"".join(table[t] for t in tokens).decode("utf-8", errors="replace")


def _allowed(matcher: Any, words: int, size: int) -> np.ndarray:
    buf = np.zeros((1, words), dtype=np.int32)
    matcher.fill_next_token_bitmask(buf, 0)
    return np.flatnonzero(np.unpackbits(buf.view(np.uint8), bitorder="little")[:size])


def sample_batch(
    compiled: Any, batch: int, nodes: int, size: int, rng: np.random.Generator, p_valid: float
) -> tuple[list[Any], np.ndarray, np.ndarray, np.ndarray]:
    """Matchers advanced by a random valid prefix, and EAGLE-like trees (1-3 children per
    node, breadth first) whose draft tokens follow the grammar with probability ``p_valid``.

    Returns ``(matchers, next_token, next_sibling, draft)``, arrays int64 ``[batch, nodes]``.
    """
    import xgrammar as xgr

    words = -(-size // 32)
    next_token = np.full((batch, nodes), -1, dtype=np.int64)
    next_sibling = np.full((batch, nodes), -1, dtype=np.int64)
    draft = np.zeros((batch, nodes), dtype=np.int64)
    matchers = []
    for b in range(batch):
        m = xgr.GrammarMatcher(compiled)
        for _ in range(int(rng.integers(0, 12))):
            options = _allowed(m, words, size)
            if len(options) < 2:
                break
            m.accept_token(int(rng.choice(options[:-1])))
        matchers.append(m)
        states = {0: m.fork()}
        frontier, j = [0], 1
        while j < nodes and frontier:
            upcoming = []
            for parent in frontier:
                state = states.get(parent)
                live = state is not None and not state.is_terminated()
                options = _allowed(state, words, size) if live else np.empty(0, np.int64)
                previous = -1
                for _ in range(int(rng.integers(1, 4))):
                    if j >= nodes:
                        break
                    valid = len(options) > 0 and rng.random() < p_valid
                    token = int(rng.choice(options)) if valid else int(rng.integers(0, size))
                    draft[b, j] = token
                    if previous == -1:
                        next_token[b, parent] = j
                    else:
                        next_sibling[b, previous] = j
                    previous = j
                    if live:
                        child = state.fork()
                        if child.accept_token(token):
                            states[j] = child
                    upcoming.append(j)
                    j += 1
            frontier = upcoming
    return matchers, next_token, next_sibling, draft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/masks.sh",
        description="Build grammar bitmasks for a sample batch of draft trees on SmolLM2's "
        "vocabulary and report what the grammar accepted.",
    )
    parser.add_argument(
        "--grammar", default="json_schema", choices=["json_schema", "ebnf", "regex", "builtin_json"]
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument(
        "--backend",
        default="numpy",
        choices=["numpy", "torch", "jax"],
        help="where the mask is uploaded (the host build is the same)",
    )
    parser.add_argument(
        "--valid",
        type=float,
        default=0.85,
        help="probability that a draft token follows the grammar",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.nodes < 1:
        parser.error("--batch and --nodes must be positive")

    import xgrammar as xgr

    import portable_spec as ps
    from portable_spec.testing import compile_sample, load_vocab, tokenizer_info

    vocab = load_vocab()
    info = tokenizer_info(vocab)
    compiler = xgr.GrammarCompiler(info)
    compiled = compile_sample(compiler, args.grammar)
    rng = np.random.default_rng(args.seed)
    matchers, nt, ns, dt = sample_batch(
        compiled, args.batch, args.nodes, vocab.size, rng, args.valid
    )

    device: Any = None
    arrays: tuple[Any, ...] = (nt, ns, dt)
    if args.backend == "torch":
        import torch

        arrays = tuple(torch.from_numpy(a) for a in arrays)
        device = torch.device("cpu")
    elif args.backend == "jax":
        import jax.numpy as jnp

        arrays = tuple(jnp.asarray(a, dtype=jnp.int32) for a in arrays)
    ps.build_host_bitmask(matchers, ps.GrammarTree.from_host(nt, ns, dt), vocab.size)  # warm-up
    start = time.perf_counter()
    tree = ps.GrammarTree.from_device(*arrays)
    mask = ps.build_grammar_vocab_mask(matchers, tree, vocab.size, device=device)
    elapsed = time.perf_counter() - start
    host = np.asarray(mask)
    print(f"vocabulary: SmolLM2-135M, {vocab.size} tokens; grammar: {args.grammar}")
    print(
        f"built a {type(mask).__module__}.{type(mask).__name__} mask of shape {tuple(host.shape)} "
        f"in {elapsed * 1e3:.2f} ms on {ps.get_num_threads()} thread(s) ({args.backend} backend)"
    )
    rows = host.reshape(args.batch, args.nodes, -1)
    for b in range(args.batch):
        filled = (rows[b] != -1).any(axis=1)
        path, node = [], 0
        while nt[b, node] != -1:  # follow first children that the grammar accepted
            child = nt[b, node]
            while child != -1 and not filled[child]:
                child = ns[b, child]
            if child == -1:
                break
            path.append(int(dt[b, child]))
            node = child
        text = decode_tokens(info, path)
        allowed = int(np.unpackbits(rows[b, 0].view(np.uint8)).sum())
        print(
            f"  request {b}: {int(filled.sum()):3d}/{args.nodes} nodes accepted, "
            f"{allowed:5d} tokens allowed at the root, a deepest accepted path: {text!r}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
