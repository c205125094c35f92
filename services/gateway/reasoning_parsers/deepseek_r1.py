"""``deepseek_r1``: DeepSeek-R1 (and QwQ) — ``<think>`` reasoning ``</think>`` answer, where the
reply may begin inside the reasoning without the opening tag (R1's template ends the prompt with
``<think>\\n``). Published in the model card (https://huggingface.co/deepseek-ai/DeepSeek-R1#usage-recommendations)."""

from __future__ import annotations

from gridserve.services.gateway.reasoning_parsers.think import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    reasons_without_tag = True
    source = "https://huggingface.co/deepseek-ai/DeepSeek-R1#usage-recommendations"
