"""``tool_choice`` for a chat request: which tools the template sees and how the calls come back.

vLLM's semantics, mode by mode:

- ``"none"``: no calls; the template still sees the tools unless the gateway runs with
  ``--exclude-tools-when-tool-choice-none``.
- ``"auto"`` (the default when ``tools`` are given): the model decides; its calls are found in
  its own format by ``--tool-call-parser`` (which needs ``--enable-auto-tool-choice``; without
  both the request is refused, 400 naming ``tool_choice``).
- ``"required"``: structured output forces one JSON schema — an array (``minItems`` 1,
  ``maxItems`` 1 unless ``parallel_tool_calls``) whose items are ``anyOf`` one object per tool,
  ``{"name": {"const": NAME}, "parameters": <that tool's schema>}`` — parsed straight into
  ``tool_calls``, no format parser involved.
- a named function (``{"type": "function", "function": {"name": ...}}``): its ``parameters``
  schema is forced, and the reply is that call's ``arguments``.

A tool's ``$defs`` move to the forced schema's root, so its ``$ref``s still resolve.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.tool_parsers import TOOL_PARSERS, ToolParser
from gridserve.services.gateway.tool_parsers.forced import NamedToolParser, RequiredToolParser
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import StructuredOutputsParams

AUTO_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    """How one request uses its tools."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request gave them
    template_tools: Optional[list[dict[str, Any]]] = None  # what the chat template sees
    function: Optional[str] = None  # the named function
    parallel: bool = True
    parser_name: Optional[str] = None  # auto: --tool-call-parser

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The structured output that forces the calls (``required`` / named), else None."""
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.function)
            return StructuredOutputsParams(json=_parameters(tool))
        return None

    def parser(self) -> Optional[ToolParser]:
        """A fresh parser for one choice's reply (None: the reply is plain content)."""
        if self.mode == "required":
            return RequiredToolParser(self.tools)
        if self.mode == "named":
            return NamedToolParser(self.tools, self.function or "")
        if self.mode == "auto" and self.parser_name is not None:
            return TOOL_PARSERS[self.parser_name](self.tools)
        return None

    @property
    def parser_class(self) -> Optional[type[ToolParser]]:
        if self.mode == "auto" and self.parser_name is not None:
            return TOOL_PARSERS[self.parser_name]
        return None


def plan_tools(tools: Optional[list[dict[str, Any]]], tool_choice: Any, parallel_tool_calls: Optional[bool],
               options: ChatOptions) -> ToolPlan:
    """The plan for a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; a refusal is
    ``InvalidArgumentError`` naming the field."""
    tools = tools or []
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice != "none":
            raise InvalidArgumentError("tool_choice", "needs tools (the request has none)")
        return ToolPlan("none", parallel=parallel)
    if tool_choice == "none":
        shown = None if options.exclude_tools_when_tool_choice_none else tools
        return ToolPlan("none", tools, shown, parallel=parallel)
    if tool_choice == "auto":
        if not options.auto_tools:
            raise InvalidArgumentError("tool_choice", AUTO_REFUSED)
        return ToolPlan("auto", tools, tools, parallel=parallel, parser_name=options.tool_call_parser)
    if tool_choice == "required":
        return ToolPlan("required", tools, tools, parallel=parallel)
    name = tool_choice["function"]["name"]
    if not any(t["function"]["name"] == name for t in tools):
        raise InvalidArgumentError("tool_choice.function.name", f"no tool named {name!r} in tools")
    return ToolPlan("named", tools, tools, function=name, parallel=parallel)


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``"required"``: an array of calls, each one of the tools."""
    defs: dict[str, Any] = {}
    choices = []
    for i, tool in enumerate(tools):
        parameters = _hoisted(_parameters(tool), defs, f"tools[{i}].function.parameters")
        choices.append({"type": "object",
                        "properties": {"name": {"const": tool["function"]["name"]}, "parameters": parameters},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def _hoisted(parameters: dict[str, Any], defs: dict[str, Any], field_name: str) -> dict[str, Any]:
    """``parameters`` without its ``$defs`` (moved into ``defs``, the root's); a name two tools
    define differently is refused."""
    if "$defs" not in parameters:
        return parameters
    parameters = copy.copy(parameters)
    for name, definition in parameters.pop("$defs").items():
        if name in defs and json.dumps(defs[name], sort_keys=True) != json.dumps(definition, sort_keys=True):
            raise InvalidArgumentError(f"{field_name}.$defs.{name}", "another tool defines it differently")
        defs[name] = definition
    return parameters
