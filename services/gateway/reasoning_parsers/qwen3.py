"""``qwen3``: Qwen3 — ``<think>`` reasoning ``</think>`` answer when thinking is on; with
``chat_template_kwargs: {"enable_thinking": false}`` the template renders an empty
``<think>\\n\\n</think>\\n\\n`` into the prompt and the whole reply is the answer. A reply that
does not begin with ``<think>`` is content. Published in the Qwen3 model card
(https://huggingface.co/Qwen/Qwen3-8B#switching-between-thinking-and-non-thinking-mode)."""

from __future__ import annotations

from gridserve.services.gateway.reasoning_parsers.think import ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    reasons_without_tag = False
    source = "https://huggingface.co/Qwen/Qwen3-8B#switching-between-thinking-and-non-thinking-mode"
