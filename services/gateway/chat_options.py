"""``ChatOptions``: how a gateway reads chat replies — tool calls and reasoning (vLLM's flags).

``--enable-auto-tool-choice`` with ``--tool-call-parser NAME`` lets ``tool_choice: "auto"`` (the
default when a request has ``tools``) find the calls a model writes in its own format;
``--reasoning-parser NAME`` splits ``reasoning_content`` from ``content``;
``--exclude-tools-when-tool-choice-none`` keeps the tools out of the prompt for
``tool_choice: "none"`` (by default the template still sees them, as in vLLM). Forced calls
(``"required"``, a named function) need no flag: structured output makes any model write them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Optional

from gridserve.shared.envs import add_option
from gridserve.shared.errors import ConfigError

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "openai")
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")


@dataclass(frozen=True)
class ChatOptions:
    """The gateway's tool-call and reasoning settings (a flag ``--<name-with-dashes>`` each)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError("tool-call-parser", f"unknown parser {self.tool_call_parser!r}; one of "
                              + ", ".join(TOOL_CALL_PARSERS))
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError("reasoning-parser", f"unknown parser {self.reasoning_parser!r}; one of "
                              + ", ".join(REASONING_PARSERS))
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable-auto-tool-choice", "needs --tool-call-parser (the format the model writes "
                              "its tool calls in)")

    @property
    def auto_tools(self) -> bool:
        """Whether ``tool_choice: "auto"`` is served."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def to_argv(self) -> list[str]:
        """These options as ``gridserve gateway`` flags (only the ones that differ from the default)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            argv += [flag] if value is True else [flag, str(value)]
        return argv


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ChatOptions`` flags (``gridserve gateway`` and ``gridserve serve``)."""
    group = parser.add_argument_group("tool calls and reasoning (chat completions)")
    add_option(group, "--enable-auto-tool-choice", action="store_true",
               help='serve tool_choice "auto" (the default with tools): the calls the model writes are '
                    "parsed with --tool-call-parser")
    add_option(group, "--tool-call-parser", choices=TOOL_CALL_PARSERS,
               help="the format the model writes tool calls in: " + ", ".join(TOOL_CALL_PARSERS))
    add_option(group, "--reasoning-parser", choices=REASONING_PARSERS,
               help="split reasoning_content from content: " + ", ".join(REASONING_PARSERS))
    add_option(group, "--exclude-tools-when-tool-choice-none", action="store_true",
               help='leave the tools out of the chat template for tool_choice "none"')
