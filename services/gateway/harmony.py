"""OpenAI's harmony format (gpt-oss), as far as reading a reply goes: its messages and channels.

A gpt-oss reply is a sequence of messages, each ``<|start|>{header}<|message|>{body}`` ended by
``<|end|>`` (more follows), ``<|call|>`` (a tool call: generation stops) or ``<|return|>`` (the
final answer: generation stops). The header names the channel (``<|channel|>analysis`` — the
reasoning, ``commentary`` — tool calls and preambles, ``final`` — the answer) and, for a tool call,
the recipient (``to=functions.get_weather``) and maybe ``<|constrain|>json``. The prompt ends with
``<|start|>assistant``, so the reply begins inside its first message's header::

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>

Every marker is a special token: the route keeps special tokens in the text for the harmony
parsers. Published at https://cookbook.openai.com/articles/openai-harmony.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
ENDS = (END, CALL, RETURN)
MARKERS = (START, END, MESSAGE, CHANNEL, CALL, RETURN, CONSTRAIN)
SOURCE = "https://cookbook.openai.com/articles/openai-harmony"
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


@dataclass
class HarmonyMessage:
    """One message of a reply: its header, its body so far, and whether it has ended."""

    header: str
    body: str = ""
    has_body: bool = False  # its <|message|> has arrived
    ended: bool = False

    @property
    def channel(self) -> str:
        match = _CHANNEL.search(self.header)
        return match.group(1) if match else ""

    @property
    def recipient(self) -> Optional[str]:
        match = _RECIPIENT.search(self.header)
        return match.group(1) if match else None

    @property
    def function(self) -> Optional[str]:
        """The function a tool-call message is for (``to=functions.NAME``)."""
        recipient = self.recipient
        if recipient is None:
            return None
        return recipient.removeprefix("functions.") or None

    @property
    def is_reasoning(self) -> bool:
        return self.channel == "analysis" and self.recipient is None

    @property
    def is_content(self) -> bool:
        """The answer, or a preamble (commentary to nobody): what the user reads."""
        return self.recipient is None and self.channel in ("final", "commentary")


def messages_of(text: str, hold_back: bool = False) -> list[HarmonyMessage]:
    """The messages of reply text. ``hold_back``: leave out a trailing piece that may be the
    beginning of a marker (while streaming, so a body never shows half a marker)."""
    if hold_back:
        text = text[: len(text) - _partial_marker(text)]
    messages = []
    for i, chunk in enumerate(text.split(START)):
        if i > 0 or chunk:
            messages.append(_message(chunk))
    return messages


def _message(chunk: str) -> HarmonyMessage:
    header, found, rest = chunk.partition(MESSAGE)
    if not found:
        return HarmonyMessage(header)
    cut = min((at for end in ENDS if (at := rest.find(end)) >= 0), default=-1)
    if cut < 0:
        return HarmonyMessage(header, rest, True, False)
    return HarmonyMessage(header, rest[:cut], True, True)


def _partial_marker(text: str) -> int:
    """How many characters at the end of ``text`` may be a marker still arriving (``<``, ``<|cha``)."""
    tail = text[text.rfind("<"):] if "<" in text else ""
    if tail == "<" or (tail.startswith("<|") and "|>" not in tail):
        return len(tail)
    return 0


class BodyStream:
    """A streamed harmony reply, re-parsed on every delta: each message's body characters not yet
    handed out, as ``(message index, message, new text)`` (the ``openai`` tool parser and the
    ``openai_gptoss`` reasoning parser route them to tool calls, reasoning or content)."""

    def __init__(self) -> None:
        self.text = ""
        self._sent: dict[int, int] = {}  # message index -> characters of its body handed out

    def feed(self, delta: str) -> list[tuple[int, HarmonyMessage, str]]:
        self.text += delta
        return self._new(messages_of(self.text, hold_back=True))

    def finish(self) -> Optional[list[tuple[int, HarmonyMessage, str]]]:
        """The rest of every body; None when the reply holds no harmony message at all (plain text)."""
        return self._new(messages_of(self.text)) if MESSAGE in self.text else None

    def _new(self, messages: list[HarmonyMessage]) -> list[tuple[int, HarmonyMessage, str]]:
        out = []
        for i, message in enumerate(messages):
            out.append((i, message, message.body[self._sent.get(i, 0):]))
            self._sent[i] = len(message.body)
        return out
