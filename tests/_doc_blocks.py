"""Run each ```python block of a Markdown file by itself: ``python _doc_blocks.py DOC OUT
[LINE]``.

Every block is compiled, then executed in a namespace of its own (as if it were a script of
its own: only what it imports or defines exists), one after the other in this process; one
JSON line per block goes to OUT: ``{"line", "status": "passed" | "failed" | "compiled",
"detail"}``. With ``LINE``, only the block whose fence opens on that line (for blocks that
need a fresh process, such as those that configure JAX's devices). A block whose first line is ``# needs: cuda``, ``# needs: tpu``,
``# needs: multi-host``, ``# needs: vllm``, ``# needs: sglang-jax`` or ``# needs: sglang`` is only
compiled where that is missing here ("compiled", with the reason).
"""

from __future__ import annotations

import json
import re
import sys
import traceback

BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
NEEDS = re.compile(r"#\s*needs:\s*(cuda|tpu|multi-host|vllm|sglang-jax|sglang)\b")


def blocks(text: str) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` of every python block of ``text``."""
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in BLOCK.finditer(text)]


def missing(need: str) -> str | None:
    """Why ``need`` cannot be met here, or None if it can."""
    if need == "cuda":
        import torch

        return None if torch.cuda.is_available() else "needs a CUDA GPU"
    if need == "tpu":
        import jax

        return None if jax.devices()[0].platform == "tpu" else "needs a TPU"
    if need == "vllm":
        import importlib.util

        return None if importlib.util.find_spec("vllm") else "needs vLLM (scripts/setup-vllm.sh)"
    if need == "sglang-jax":
        import importlib.util

        found = importlib.util.find_spec("sgl_jax")
        return None if found else "needs sglang-jax (scripts/setup-sglang-jax.sh)"
    if need == "sglang":
        import importlib.util

        found = importlib.util.find_spec("sglang")
        return None if found else "needs sglang (scripts/setup-sglang.sh)"
    return "needs several hosts"


def main(doc: str, out: str, only: int | None = None) -> int:
    with open(doc, encoding="utf-8") as f:
        found = [(line, code) for line, code in blocks(f.read()) if only in (None, line)]
    with open(out, "w", encoding="utf-8") as results:
        for line, code in found:
            record = {"line": line, "status": "passed", "detail": ""}
            try:
                compiled = compile(code, f"{doc}:{line}", "exec")
                first = code.lstrip().split("\n", 1)[0]
                need = NEEDS.match(first)
                reason = missing(need.group(1)) if need else None
                if reason:
                    record.update(status="compiled", detail=reason)
                else:
                    exec(compiled, {"__name__": "__main__", "__file__": f"{doc}:{line}"})
            except BaseException:
                record.update(status="failed", detail=traceback.format_exc()[-4000:])
            results.write(json.dumps(record) + "\n")
            results.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None))
