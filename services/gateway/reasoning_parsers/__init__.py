"""Reasoning parsers by ``--reasoning-parser`` name (vLLM's names), each in a module of its own.

``deepseek_r1``, ``qwen3`` (``<think>`` tags), ``openai_gptoss`` (harmony channels). The
contract: ``base.ReasoningParser``.
"""

from __future__ import annotations

from gridserve.services.gateway.reasoning_parsers.base import PromptState, ReasoningParser
from gridserve.services.gateway.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from gridserve.services.gateway.reasoning_parsers.openai_gptoss import GptOssReasoningParser
from gridserve.services.gateway.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)
}

__all__ = ["REASONING_PARSERS", "PromptState", "ReasoningParser"]
