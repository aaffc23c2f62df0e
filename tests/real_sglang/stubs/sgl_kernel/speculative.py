"""Test stub (see ../README.md): the NGRAM tree kernel, forwarded to sglang's own Triton
implementation (run by Triton's interpreter in these tests)."""

from typing import Any


def reconstruct_indices_from_tree_mask(*args: Any, **kwargs: Any) -> None:
    from sglang.kernels.ops.speculative.reconstruct_tree import (
        reconstruct_indices_from_tree_mask_triton,
    )

    reconstruct_indices_from_tree_mask_triton(*args, **kwargs)
