"""Scanning JSON that is still being generated: where a value ends, and the fields of an object so far.

A streamed tool call arrives a few characters at a time; to send its name as soon as it is known
and its arguments as they grow, the parsers need the raw text of each field of a call object
before the object is complete. ``scan_object`` gives it without parsing anything twice: each
field's raw value text (as the model wrote it) and whether that value is complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

WHITESPACE = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}
_QUOTE_OR_ESCAPE = re.compile(r'["\\]')
_STRUCTURAL = re.compile(r'["{}\[\]]')
_PRIMITIVE_END = re.compile(r"[,}\]\s]")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> Optional[int]:
    """The index after the JSON string that opens at ``text[i]`` (a quote); None if unterminated."""
    while True:
        match = _QUOTE_OR_ESCAPE.search(text, i + 1)
        if match is None:
            return None
        if match.group() == '"':
            return match.end()
        i = match.end()  # an escape: skip the escaped character


def value_end(text: str, i: int) -> Optional[int]:
    """The index after the JSON value that starts at ``text[i]``; None while it may still grow (an
    unclosed string, object or array, or a number or literal that reaches the end of ``text``).
    Runs of ordinary characters are skipped by regex, so long values cost little to rescan."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in _CLOSE:
        stack = [_CLOSE[text[i]]]
        j = i + 1
        while True:
            match = _STRUCTURAL.search(text, j)
            if match is None:
                return None
            ch, j = match.group(), match.start()
            if ch == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in _CLOSE:
                stack.append(_CLOSE[ch])
            elif ch != stack.pop():
                return j + 1  # mismatched: the caller's json.loads says why
            elif not stack:
                return j + 1
            j += 1
    match = _PRIMITIVE_END.search(text, i)
    return match.start() if match else None


@dataclass
class RawField:
    """One field of a partial object: its value's raw text so far, and whether it is complete."""

    raw: str
    complete: bool

    def value(self) -> Any:
        """The decoded value (only for a complete field); ``ValueError`` if it is not JSON."""
        return json.loads(self.raw)


@dataclass
class PartialObject:
    """The fields of a JSON object seen so far; ``end`` is the index after its ``}`` once closed."""

    fields: dict[str, RawField] = field(default_factory=dict)
    end: Optional[int] = None
    broken: bool = False  # the text cannot be the start of a JSON object


def scan_object(text: str, start: int = 0) -> PartialObject:
    """The fields of the JSON object opening at ``text[start]`` (which must be ``{``), as far as
    ``text`` goes. Keys are decoded; values stay raw (``RawField``)."""
    result = PartialObject()
    if start >= len(text) or text[start] != "{":
        result.broken = start < len(text)
        return result
    i = skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            result.end = i + 1
            return result
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            result.broken = True
            return result
        key_end = string_end(text, i)
        if key_end is None:
            return result
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            result.broken = True
            return result
        i = skip_ws(text, key_end)
        if i >= len(text):
            return result
        if text[i] != ":":
            result.broken = True
            return result
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return result
        end = value_end(text, i)
        if end is None:
            result.fields[key] = RawField(text[i:], False)
            return result
        result.fields[str(key)] = RawField(text[i:end], True)
        i = skip_ws(text, end)
    return result


def split_top_level(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` characters outside strings and brackets."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            end = string_end(text, i)
            if end is None:
                break
            i = end
            continue
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


def array_items(body: str) -> list[str]:
    """The raw items of a JSON array's text (the last one possibly incomplete)."""
    items, i = [], skip_ws(body, 1)
    while i < len(body) and body[i] != "]":
        end = value_end(body, i)
        if end is None:
            items.append(body[i:])
            break
        items.append(body[i:end])
        i = skip_ws(body, end)
        if i < len(body) and body[i] == ",":
            i = skip_ws(body, i + 1)
    return items


class ObjectScanner:
    """``scan_object`` for a text that grows at its end, as a stream delivers it: each ``scan``
    resumes where the last one stopped, so a call streamed over many deltas is read once, not once
    per delta. A text that does not extend the last one starts the scan over."""

    def __init__(self) -> None:
        self._reset("")

    def _reset(self, text: str) -> None:
        self.text = text
        self.result = PartialObject()
        self.i = 0
        self.phase = "open"  # open, key, colon, value, after, done
        self.key = ""
        self.value_start = 0
        self.stack: list[str] = []  # the closers the current value still needs
        self.in_string = False

    def scan(self, text: str) -> PartialObject:
        if not text.startswith(self.text) or self.result.broken:
            self._reset(text)
        self.text = text
        while self.i < len(text) and self.phase != "done" and not self.result.broken and self._step(text):
            pass
        if self.phase == "value" and not self.result.broken and self.value_start < len(text):
            self.result.fields[self.key] = RawField(text[self.value_start:], False)
        return self.result

    def _step(self, text: str) -> bool:
        """Advance by one piece of the object; False when the text ends inside that piece."""
        i = self.i
        if self.phase == "value":
            return self._value(text)
        if text[i] in WHITESPACE:
            self.i = skip_ws(text, i)
            return True
        if self.phase == "open":
            return self._next(text[i] == "{", "key", i + 1)
        if self.phase == "colon":
            self.value_start = skip_ws(text, i + 1)
            return self._next(text[i] == ":", "value", self.value_start)
        if text[i] == "}":  # phase key or after: the object ends
            self.result.end = i + 1
            return self._next(True, "done", i + 1)
        if self.phase == "after":
            return self._next(text[i] == ",", "key", i + 1)
        if text[i] != '"':
            return self._next(False, "", i)
        end = string_end(text, i)
        if end is None:
            return False
        try:
            self.key = str(json.loads(text[i:end]))
        except ValueError:
            return self._next(False, "", i)
        return self._next(True, "colon", end)

    def _value(self, text: str) -> bool:
        i = self.i
        if self.in_string:
            end, self.i = _string_from(text, i)
            if end is None:
                return False
            self.in_string = False
            return self._done(text, end) if not self.stack else True
        if not self.stack:
            if i == self.value_start and text[i] in WHITESPACE:
                self.i = self.value_start = skip_ws(text, i)
                return True
            if text[i] == '"':
                self.in_string, self.i = True, i + 1
                return True
            if text[i] not in _CLOSE:  # a number or a literal
                match = _PRIMITIVE_END.search(text, i)
                self.i = len(text) if match is None else match.start()
                return match is not None and self._done(text, match.start())
        match = _STRUCTURAL.search(text, i)
        if match is None:
            self.i = len(text)
            return False
        ch, j = match.group(), match.start()
        self.i = j + 1
        if ch == '"':
            self.in_string = True
        elif ch in _CLOSE:
            self.stack.append(_CLOSE[ch])
        elif not self.stack or ch != self.stack.pop():
            return self._next(False, "", j)
        elif not self.stack:
            return self._done(text, j + 1)
        return True

    def _done(self, text: str, end: int) -> bool:
        self.result.fields[self.key] = RawField(text[self.value_start:end], True)
        return self._next(True, "after", end)

    def _next(self, ok: bool, phase: str, at: int) -> bool:
        if not ok:
            self.result.broken = True
            return False
        self.phase, self.i = phase, at
        return True


def _string_from(text: str, i: int) -> tuple[Optional[int], int]:
    """A JSON string's body scanned from ``text[i]`` (after its opening quote, or where the last scan
    stopped): the index after its closing quote (None if not there yet) and where to resume."""
    while True:
        match = _QUOTE_OR_ESCAPE.search(text, i)
        if match is None:
            return None, len(text)
        if match.group() == '"':
            return match.end(), match.end()
        if match.end() >= len(text):  # an escape at the very end: resume at it
            return None, match.start()
        i = match.end() + 1


class ArrayScanner:
    """``array_items`` for a growing text of an array of objects: a finished item is found once,
    the one being written is followed by an ``ObjectScanner``."""

    def __init__(self) -> None:
        self.text = ""
        self.items: list[str] = []
        self.next = -1  # where the item being written starts (-1: not scanned yet)
        self.current = ObjectScanner()

    def scan(self, body: str) -> list[str]:
        """The raw items of ``body`` (``[`` first), the last one possibly incomplete."""
        if not body.startswith(self.text) or self.next < 0:
            self.items, self.next, self.current = [], skip_ws(body, 1), ObjectScanner()
        self.text = body
        while self.next < len(body) and body[self.next] != "]":
            if body[self.next] != "{":  # not an array of objects: the plain scan says what it is
                return array_items(body)
            obj = self.current.scan(body[self.next:])
            if obj.end is None:
                return [*self.items, body[self.next:]]
            self.items.append(body[self.next:self.next + obj.end])
            i = skip_ws(body, self.next + obj.end)
            self.next = skip_ws(body, i + 1) if i < len(body) and body[i] == "," else i
            self.current = ObjectScanner()
        return list(self.items)
