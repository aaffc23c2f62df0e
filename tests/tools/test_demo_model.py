"""The demo's Llama forward: GGUF layout, coherent output, JAX == torch, tree attention, KV
compaction and the self drafter's device-built trees."""

from __future__ import annotations

import numpy as np
import pytest
from _demo_models import require_backends

from examples.demo.models import precision
from examples.demo.weights import load_weights, unpermute_rows
from portable_spec import GrammarTree

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode(tok.chat_prompt("What is the capital of France?"))


def _chunk_logits(model, tokens, start):
    """Causal forward of ``tokens`` at positions ``start..``; returns host logits."""
    n = len(tokens)
    launch = model.launch(
        np.asarray(tokens), np.arange(start, start + n), start, np.tril(np.ones((n, n), bool))
    )
    return model.to_host(launch.logits()), launch


def test_config_from_metadata():
    cfg = load_weights().config
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
    assert (cfg.ffn, cfg.vocab_size, cfg.head_dim) == (1536, 49152, 64)
    assert cfg.rope_base == 100000.0
    assert cfg.rms_eps == pytest.approx(1e-5)


def test_unpermute_undoes_the_converters_row_interleaving():
    heads, hd, inner = 3, 8, 5
    original = np.random.default_rng(0).normal(size=(heads * hd, inner))
    # the converter stores row j * hd/2 + i of each head at row 2 * i + j
    stored = np.empty_like(original)
    for h in range(heads):
        for i in range(hd // 2):
            for j in range(2):
                stored[h * hd + 2 * i + j] = original[h * hd + j * hd // 2 + i]
    np.testing.assert_array_equal(unpermute_rows(stored, heads), original)


def test_greedy_answer_is_coherent(request, models, tok, prompt):
    require_backends(request, "torch")
    """A wrong RoPE layout or a broken forward does not answer this."""
    model = models("torch", "float32")
    model.reset()
    model.prefill(np.asarray(prompt[:-1]))
    start, root, out = len(prompt) - 1, prompt[-1], []
    for _ in range(8):
        logits, launch = _chunk_logits(model, [root], start)
        model.commit(launch, np.zeros(1, np.int64), start)
        root = int(np.argmax(logits[0]))
        out.append(root)
        start += 1
    assert "Paris" in tok.decode(out)


@pytest.mark.parametrize("dtype,atol", [("float32", 2e-3), ("float64", 1e-9)])
def test_jax_and_torch_logits_agree(request, models, prompt, dtype, atol):
    require_backends(request, "jax", "torch")
    got = {}
    for backend in ("jax", "torch"):
        with precision(backend, dtype):
            model = models(backend, dtype)
            model.reset()
            model.prefill(np.asarray(prompt[:-3]))
            got[backend], _ = _chunk_logits(model, prompt[-3:], len(prompt) - 3)
    assert got["jax"].shape == (3, 49152)
    assert np.abs(got["jax"]).max() > 10  # real logits, not zeros
    np.testing.assert_allclose(got["jax"], got["torch"], rtol=0, atol=atol)
    np.testing.assert_array_equal(got["jax"].argmax(-1), got["torch"].argmax(-1))


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_tree_attention_and_compaction_match_sequential_decoding(request, models, prompt, backend):
    require_backends(request, backend)
    """Tree root r with children a, b and a's child c: every node's logits equal a causal
    forward of its root path; after compacting r, a, c into the cache, the next token's
    logits equal those of the straight sequence."""
    r, a, b, c, d = prompt[-1], 504, 1780, 314, 260
    with precision(backend, "float64"):
        model = models(backend, "float64")
        ctx = np.asarray(prompt[:-1])
        s = len(ctx)

        def fresh():
            model.reset()
            model.prefill(ctx)

        fresh()
        parent = [-1, 0, 0, 1]
        mask = np.eye(4, dtype=bool)
        for i in range(1, 4):
            mask[i] |= mask[parent[i]]
        depth = np.array([0, 1, 1, 2])
        launch = model.launch(np.array([r, a, b, c]), s + depth, s, mask)
        tree = model.to_host(launch.logits())
        model.commit(launch, np.array([0, 1, 3]), s)
        after, _ = _chunk_logits(model, [d], s + 3)

        fresh()
        straight, _ = _chunk_logits(model, [r, a, c, d], s)
        fresh()
        side, _ = _chunk_logits(model, [r, b], s)
    np.testing.assert_allclose(tree[[0, 1, 3]], straight[:3], rtol=0, atol=1e-9)
    np.testing.assert_allclose(tree[2], side[1], rtol=0, atol=1e-9)
    np.testing.assert_allclose(after[0], straight[3], rtol=0, atol=1e-9)
    assert not np.allclose(tree[1], tree[2])  # siblings really differ


def _ancestors(next_token, next_sibling):
    """Ancestor-or-self matrix from first-child/next-sibling links (host walk)."""
    n = len(next_token)
    anc = np.eye(n, dtype=bool)
    stack = [0]
    while stack:
        p = stack.pop()
        child = next_token[p]
        while child != -1:
            anc[child] |= anc[p]
            stack.append(child)
            child = next_sibling[child]
    return anc


def test_self_draft_tree_is_built_on_device_and_agrees_across_backends(request, models, prompt):
    require_backends(request, "jax", "torch")
    trees = {}
    for backend in ("jax", "torch"):
        with precision(backend, "float64"):
            model = models(backend, "float64")
            model.reset()
            model.prefill(np.asarray(prompt[:-1]))
            out = model.draft_tree(prompt[-1], len(prompt) - 1, nodes=7, branch=2, layers=6)
            assert type(out["tokens"]).__module__.split(".")[0] in ("jax", "jaxlib", "torch")
            tree = GrammarTree.from_device(out["next_token"], out["next_sibling"], out["tokens"])
            tree.topology()  # well-formed links
            nt, ns, tokens = (a[0] for a in tree.resolve())
            host = {k: model.to_host(v) for k, v in out.items()}
            trees[backend] = (nt, ns, tokens, host)
    jx, th = trees["jax"], trees["torch"]
    for x, y in zip(jx[:3], th[:3], strict=True):
        np.testing.assert_array_equal(x, y)
    nt, ns, tokens, host = jx
    assert tokens[0] == prompt[-1]
    assert (nt != -1).sum() >= 3  # grew beyond the root
    np.testing.assert_array_equal(host["tree_mask"], _ancestors(nt, ns))
    depth = host["tree_mask"].sum(axis=1) - 1
    np.testing.assert_array_equal(host["positions"], len(prompt) - 1 + depth)


def test_the_gguf_is_parsed_once_per_process():
    """Vocabulary, tokenizer and weights (both dtypes, default and explicit path) share one
    parsed GGUF."""
    import subprocess
    import sys

    code = """
import gguf

count = 0


class Counting(gguf.GGUFReader):
    def __init__(self, *args, **kwargs):
        global count
        count += 1
        super().__init__(*args, **kwargs)


gguf.GGUFReader = Counting
from examples.demo.constraints import load_constraint
from portable_spec.testing import load_vocab, smollm2_gguf_path
from examples.demo.tokenizer import load_tokenizer
from examples.demo.weights import load_weights

load_vocab()
load_vocab(smollm2_gguf_path())
load_tokenizer()
load_constraint()
load_weights(None, "float32")
load_weights(smollm2_gguf_path(), "float64")
print(count)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "1"


def test_backends_ship_only_staging_upload_and_apply():
    """The demo's models live in examples.demo; no backend module reaches up into it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path in (root / "backends").rglob("*.py"):
        assert path.name != "model.py", path
        assert "examples.demo" not in path.read_text(), path
    assert (root / "examples/demo/jax_model.py").exists()
    assert (root / "examples/demo/torch_model.py").exists()
