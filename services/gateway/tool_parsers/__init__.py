"""Tool-call parsers by ``--tool-call-parser`` name (vLLM's names), each in a module of its own.

``hermes`` (Hermes, Qwen2.5 / Qwen3), ``llama3_json`` (Llama 3.x JSON), ``mistral``,
``pythonic`` (Llama 3.2 / 4), ``openai`` (gpt-oss harmony). The contract: ``base.ToolParser``.
"""

from __future__ import annotations

from gridserve.services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from gridserve.services.gateway.tool_parsers.hermes import HermesToolParser
from gridserve.services.gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from gridserve.services.gateway.tool_parsers.mistral import MistralToolParser
from gridserve.services.gateway.tool_parsers.openai import OpenAIToolParser
from gridserve.services.gateway.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser, OpenAIToolParser)
}

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedDelta", "ToolCall", "ToolCallDelta", "ToolParser"]
