"""A reasoning parser for SmolLM2, loaded by vLLM as a reasoning-parser plugin: the model
reasons freely until it writes a period (``.``), then its answer follows the grammar. SmolLM2
has no thinking tokens; a period is one it writes on its own, so the reasoning ends where the
model decides. ``<|im_start|>`` stands for the start token (never in a prompt here): a prompt
holding a period has finished its reasoning, one without starts by reasoning."""

from __future__ import annotations

from vllm.reasoning import ReasoningParserManager
from vllm.reasoning.basic_parsers import BaseThinkingReasoningParser

NAME = "period_think"


@ReasoningParserManager.register_module(NAME)
class PeriodReasoningParser(BaseThinkingReasoningParser):
    @property
    def start_token(self) -> str:
        return "<|im_start|>"

    @property
    def end_token(self) -> str:
        return "."
