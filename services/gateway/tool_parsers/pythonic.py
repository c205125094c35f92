"""``pythonic``: Llama 3.2 / Llama 4 zero-shot function calling — a Python list of calls::

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

optionally inside ``<|python_start|>`` ... ``<|python_end|>`` (Llama 4). The reply must be only
the list; anything else is content. Arguments are Python literals (strings, numbers, True /
False / None, lists, dicts), read with ``ast.literal_eval`` — never evaluated — and sent as JSON.
Published in Meta's Llama 3.2 prompt format
(https://github.com/meta-llama/llama-models/blob/main/models/llama3_2/text_prompt_format.md).
"""

from __future__ import annotations

import ast
import json
from typing import Optional

from gridserve.services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    PartialCall,
    ToolCall,
    ToolParser,
)

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = (START, END)
    source = "https://github.com/meta-llama/llama-models/blob/main/models/llama3_2/text_prompt_format.md"

    def section_start(self, text: str) -> tuple[int, bool]:
        body = text.lstrip()
        lead = len(text) - len(body)
        if body.startswith(START) or body.startswith("["):
            return lead, True
        if START.startswith(body):
            return 0, False
        return len(text), False

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(START).removesuffix(END).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ExtractedToolCalls.text(text)
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return ExtractedToolCalls.text(text)
        if not isinstance(tree, ast.List) or not tree.elts:
            return ExtractedToolCalls.text(text)
        calls = [_call(node) for node in tree.elts]
        if not all(calls):
            return ExtractedToolCalls.text(text)
        return ExtractedToolCalls(None, [c for c in calls if c is not None])

    def partial_calls(self, section: str) -> list[PartialCall]:
        body = section.lstrip().removeprefix(START).lstrip()
        if not body.startswith("["):
            return []
        calls = []
        for piece, complete in _pieces(body[1:]):
            if complete:
                call = _parsed_call(piece)
                if call is None:
                    break
                calls.append(PartialCall(call.name, call.arguments))
            else:
                name = piece.strip().partition("(")[0]
                calls.append(PartialCall(name if "(" in piece and _is_name(name) else None))
                break
        return calls


def _pieces(text: str) -> list[tuple[str, bool]]:
    """The call texts of a list's body so far: each complete one (its parentheses closed), then
    the one still being written (possibly empty)."""
    pieces, depth, start, quote, i = [], 0, 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:  # the list's closing bracket
                break
            if depth == 0 and ch == ")":
                pieces.append((text[start:i + 1].lstrip(" ,\n"), True))
                start = i + 1
        i += 1
    pieces.append((text[start:].lstrip(" ,\n"), False))
    return pieces


def _parsed_call(piece: str) -> Optional[ToolCall]:
    try:
        node = ast.parse(piece.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    return _call(node)


def _call(node: ast.AST) -> Optional[ToolCall]:
    """``name(key=literal, ...)`` as a call; None for anything else (positional arguments too)."""
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    try:
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError):  # a set or bytes literal: not JSON
        return None


def _dotted(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _is_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split(".")) if text else False
