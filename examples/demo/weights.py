"""SmolLM2's weights and hyper-parameters, read from its GGUF into framework-neutral numpy.

The GGUF stores quantized blocks (Q4_1, Q8_0) in llama.cpp's conventions: tensor shapes are
listed innermost-first, and the query/key projections have the rows of every head reordered
so that the two halves of each rotary pair sit side by side. :func:`load_weights` dequantizes,
transposes every projection to ``[in, out]`` (so a layer is ``x @ w``), restores the
query/key rows to the half-split order (rotary pairs are ``(i, i + head_dim / 2)``) and stacks
the per-layer tensors along a leading layer axis. Nothing here downloads anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from portable_spec.testing import gguf_reader, smollm2_gguf_path

__all__ = ["LAYER_KEYS", "LlamaConfig", "LlamaWeights", "load_weights"]

# Stacked per-layer tensors: name in LlamaWeights.layers -> GGUF tensor suffix.
LAYER_KEYS = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder, as the GGUF metadata states them."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    context_length: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def group(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class LlamaWeights:
    """Dequantized weights.

    Attributes:
        config: the hyper-parameters.
        embed: ``[vocab, hidden]`` token embeddings (also the output head: tied).
        final_norm: ``[hidden]`` RMSNorm gain before the head.
        layers: stacked per-layer tensors, each with a leading ``[n_layers]`` axis:
            ``attn_norm``/``ffn_norm`` ``[L, hidden]``, ``wq`` ``[L, hidden, heads*hd]``,
            ``wk``/``wv`` ``[L, hidden, kv_heads*hd]``, ``wo`` ``[L, heads*hd, hidden]``,
            ``w_gate``/``w_up`` ``[L, hidden, ffn]``, ``w_down`` ``[L, ffn, hidden]``.
        dtype: numpy dtype of every array (float32 or float64).
    """

    config: LlamaConfig
    embed: np.ndarray
    final_norm: np.ndarray
    layers: dict[str, np.ndarray]
    dtype: np.dtype

    def as_dict(self) -> dict[str, Any]:
        """Flat ``{name: array}`` view (``embed``, ``final_norm`` and the layer keys)."""
        return {"embed": self.embed, "final_norm": self.final_norm, **self.layers}


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"the GGUF has no {key!r} metadata")
    return field.contents()


def _config(reader: Any) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    vocab = reader.fields.get("llama.vocab_size")
    return LlamaConfig(
        n_layers=int(_field(reader, "llama.block_count")),
        hidden=int(_field(reader, "llama.embedding_length")),
        n_heads=int(_field(reader, "llama.attention.head_count")),
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        ffn=int(_field(reader, "llama.feed_forward_length")),
        vocab_size=int(
            vocab.contents() if vocab is not None else len(_field(reader, "tokenizer.ggml.tokens"))
        ),
        rope_base=float(_field(reader, "llama.rope.freq_base")),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, "llama.context_length")),
    )


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the GGUF converter's per-head row interleaving of a ``[out, in]`` Q/K weight.

    In the file, row ``2 * i + j`` of a head holds what the original model kept at row
    ``j * head_dim / 2 + i`` (``j`` in {0, 1}). Returns the original ``[out, in]`` order.
    """
    out, inner = w.shape
    half = out // n_heads // 2
    return w.reshape(n_heads, half, 2, inner).transpose(0, 2, 1, 3).reshape(out, inner)


def _dequantize(tensor: Any) -> np.ndarray:
    import gguf

    # numpy shape is the reverse of the GGUF shape: [out, in] for a projection
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))


def load_weights(path: str | None = None, dtype: str = "float32") -> LlamaWeights:
    """Read and dequantize a Llama GGUF (default: SmolLM2-135M-Instruct). Cached per
    ``(path, dtype)``: the arrays are shared, treat them as read-only.

    Args:
        path: a GGUF file, or None for :func:`smollm2_gguf_path`.
        dtype: ``"float32"`` or ``"float64"`` (the values are the same: dequantized blocks
            are exact in float32).

    Takes a few seconds for SmolLM2, most of it parsing the GGUF's metadata, which is done
    once per process (:func:`portable_spec.testing.gguf_reader`, shared with the
    vocabulary); the float64 weights are widened from the cached float32 ones.
    """
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    return _load(os.path.abspath(path or smollm2_gguf_path()), dtype)


@lru_cache(maxsize=4)
def _load(path: str, dtype: str) -> LlamaWeights:
    if dtype == "float64":  # same values: widen the float32 arrays instead of re-reading
        w = _load(path, "float32")
        return LlamaWeights(
            config=w.config,
            embed=w.embed.astype(np.float64),
            final_norm=w.final_norm.astype(np.float64),
            layers={k: v.astype(np.float64) for k, v in w.layers.items()},
            dtype=np.dtype(np.float64),
        )
    reader = gguf_reader(path)
    config = _config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"the GGUF has no tensor {name!r}")
        return _dequantize(tensors[name])

    embed = get("token_embd.weight")
    if "output.weight" in tensors:
        raise ValueError("this loader expects tied embeddings (no output.weight)")
    if embed.shape != (config.vocab_size, config.hidden):
        raise ValueError(f"token_embd has shape {embed.shape}, config says {config}")
    layers: dict[str, list[np.ndarray]] = {k: [] for k in LAYER_KEYS}
    for i in range(config.n_layers):
        for key, suffix in LAYER_KEYS.items():
            w = get(f"blk.{i}.{suffix}")
            if key == "wq":
                w = unpermute_rows(w, config.n_heads)
            elif key == "wk":
                w = unpermute_rows(w, config.n_kv_heads)
            if w.ndim == 2:
                w = w.T  # [out, in] -> [in, out]
            layers[key].append(w)
    stacked = {k: np.ascontiguousarray(np.stack(v), dtype=np.float32) for k, v in layers.items()}
    return LlamaWeights(
        config=config,
        embed=np.ascontiguousarray(embed, dtype=np.float32),
        final_norm=get("output_norm.weight").astype(np.float32),
        layers=stacked,
        dtype=np.dtype(np.float32),
    )
