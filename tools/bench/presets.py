"""The benchmark's sections and its two presets (``--quick`` and the full run)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_SECTIONS", "FULL", "QUICK", "SECTIONS", "Preset"]

SECTIONS = (
    "build",
    "staging",
    "apply",
    "overlap",
    "engines",
    "chains",
    "layout",
    "async",
    "percall",
    "forced",
    "targets",
    "thresholds",
)
#: sections run when --sections is not given (``targets`` re-runs parts of the others;
#: ``thresholds`` measures what the route table's numbers are set from)
DEFAULT_SECTIONS = SECTIONS[:-2]


@dataclass(frozen=True)
class Preset:
    """Default configuration of a run (each field can be overridden on the command line)."""

    batches: tuple[int, ...]
    nodes: tuple[int, ...]
    shapes: tuple[str, ...]
    grammars: tuple[str, ...]
    min_rounds: int
    max_rounds: int
    budget_s: float
    staging_batches: tuple[int, ...]
    apply_rows: int
    overlap_batch: int
    overlap_nodes: int
    chain_drafts: tuple[int, ...]
    chain_batches: tuple[int, ...]
    chain_reasoning: tuple[float, ...]
    #: the build, chains, percall and layout sections run on each (workloads.vocab_setup)
    vocabs: tuple[str, ...] = ("smollm2", "tekken", "qwen")
    layout_vocabs: tuple[str, ...] = ("smollm2", "tekken", "qwen")
    layout_batches: tuple[int, ...] = (8, 64, 256)
    layout_nodes: tuple[int, ...] = (16, 64)
    async_vocabs: tuple[str, ...] = ("smollm2", "131072")
    async_batch: int = 32
    async_nodes: int = 32
    forced_drafts: tuple[int, ...] = (4, 8)
    forced_batches: tuple[int, ...] = (1, 8, 16, 32, 64)


FULL = Preset(
    batches=(1, 8, 64, 256),
    nodes=(16, 64),
    shapes=("tree", "chain"),
    grammars=("json_schema", "ebnf", "regex"),
    min_rounds=5,
    max_rounds=41,
    budget_s=2.0,
    staging_batches=(8, 64),
    apply_rows=256,
    overlap_batch=64,
    overlap_nodes=64,
    chain_drafts=(1, 2, 4, 8),
    chain_batches=(1, 8, 64, 256),
    chain_reasoning=(0.0, 0.5),
)

QUICK = Preset(
    batches=(1, 8),
    nodes=(16,),
    shapes=("tree", "chain"),
    grammars=("json_schema", "regex"),
    min_rounds=3,
    max_rounds=9,
    budget_s=0.25,
    staging_batches=(8,),
    apply_rows=32,
    overlap_batch=8,
    overlap_nodes=16,
    chain_drafts=(1, 4),
    chain_batches=(1, 8),
    chain_reasoning=(0.5,),
    vocabs=("smollm2",),
    layout_vocabs=("smollm2",),
    layout_batches=(8,),
    layout_nodes=(16,),
    async_vocabs=("smollm2",),
    async_batch=8,
    async_nodes=16,
    forced_drafts=(4,),
    forced_batches=(1, 8),
)
