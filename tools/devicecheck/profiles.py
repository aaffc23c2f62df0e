"""What each mode measures: the full set on the GPU machine, a reduced one under ``--cpu``."""

from __future__ import annotations

from dataclasses import dataclass

from tools.bench.timing import RoundPlan

__all__ = ["CPU", "GPU", "Profile", "profile_for"]


@dataclass(frozen=True)
class Profile:
    """Sizes and round budgets of the timing and scaling parts.

    Every workload uses a synthetic ``vocab``-token vocabulary (mask rows of ``vocab / 32``
    int32 words), the sample JSON schema and EAGLE-like trees of ``nodes`` nodes.
    """

    name: str
    vocab: int
    nodes: int
    staging_batches: tuple[int, ...]
    upload_batches: tuple[int, ...]
    apply_shapes: tuple[tuple[int, int], ...]
    apply_dtypes: tuple[str, ...]
    overlap_batch: int
    scaling_batches: tuple[int, ...]
    scaling_nodes: tuple[int, ...]
    scaling_threads: tuple[int, ...]
    plan: RoundPlan
    scaling_plan: RoundPlan


GPU = Profile(
    name="gpu",
    vocab=131072,
    nodes=16,
    staging_batches=(64, 256),
    upload_batches=(64, 256),
    apply_shapes=((512, 131072), (4096, 131072)),
    apply_dtypes=("bfloat16", "float32"),
    overlap_batch=64,
    scaling_batches=(64, 256),
    scaling_nodes=(16, 64),
    scaling_threads=(1, 2, 4, 8, 16),
    plan=RoundPlan(min_rounds=7, max_rounds=31, budget_s=1.0),
    scaling_plan=RoundPlan(min_rounds=5, max_rounds=21, budget_s=2.5),
)

CPU = Profile(
    name="cpu",
    vocab=131072,
    nodes=16,
    staging_batches=(64,),
    upload_batches=(64,),
    apply_shapes=((64, 131072),),
    apply_dtypes=("bfloat16", "float32"),
    overlap_batch=64,
    scaling_batches=(64,),
    scaling_nodes=(16, 64),
    scaling_threads=(1, 2, 4, 8, 16),
    plan=RoundPlan(min_rounds=3, max_rounds=7, budget_s=0.3),
    scaling_plan=RoundPlan(min_rounds=3, max_rounds=7, budget_s=0.5),
)


def profile_for(mode: str) -> Profile:
    """``"gpu"`` or ``"cpu"``."""
    return {"gpu": GPU, "cpu": CPU}[mode]
