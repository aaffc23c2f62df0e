"""Write a random-weight EAGLE-3 draft head for SmolLM2-135M (sglang-jax's
``LlamaForCausalLMEagle3`` layout), for engine runs that need a drafter but no checkpoint.

Usage: ``python scripts/smollm2_eagle3_draft.py TARGET_DIR OUT_DIR [--draft-vocab N]``
(numpy only). The head is one decoder layer over the target's embeddings and three of its
hidden layers, with seeded random weights: its drafts are noise, which is what a drafter
looks like to the grammar (the verify masks must hold whatever it proposes). With
``--draft-vocab N`` the head drafts over the N most frequent ids (the first N here: SmolLM2's
merges put common tokens first) and ``d2t`` maps them to target ids, as EAGLE-3 checkpoints do.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def main() -> None:
    """Write the draft's ``config.json`` and ``model.safetensors`` into ``OUT_DIR``."""
    from safetensors.numpy import save_file

    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("out")
    parser.add_argument("--draft-vocab", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(os.path.join(args.target, "config.json")) as f:
        target = json.load(f)
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    kv_heads, head_dim = target["num_key_value_heads"], target["head_dim"]
    inter, vocab = target["intermediate_size"], target["vocab_size"]
    draft_vocab = args.draft_vocab or vocab
    layers = target["num_hidden_layers"]
    rng = np.random.default_rng(args.seed)

    def dense(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    ones = np.ones(hidden, dtype=np.float32)
    tensors = {
        "fc.weight": dense(hidden, 3 * hidden),
        "midlayer.hidden_norm.weight": ones,
        "midlayer.input_layernorm.weight": ones,
        "midlayer.post_attention_layernorm.weight": ones,
        "midlayer.self_attn.q_proj.weight": dense(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": dense(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": dense(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": dense(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": dense(inter, hidden),
        "midlayer.mlp.up_proj.weight": dense(inter, hidden),
        "midlayer.mlp.down_proj.weight": dense(hidden, inter),
        "norm.weight": ones,
        "lm_head.weight": dense(draft_vocab, hidden),
        # draft id i -> target id i + d2t[i] (EAGLE-3's offsets)
        "d2t": np.zeros(draft_vocab, dtype=np.int64),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": target["rope_theta"],
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": target["bos_token_id"],
        "eos_token_id": target["eos_token_id"],
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, layers // 2 - 1, layers - 4]},
    }
    tmp = args.out.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        source = os.path.join(args.target, name)
        if os.path.exists(source):
            with open(source) as src, open(os.path.join(tmp, name), "w") as dst:
                dst.write(src.read())
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
