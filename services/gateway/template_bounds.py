"""How big a value a chat template's operation would make, known before it is made.

``chat_template.BoundedSandbox`` asks these before it lets an operation run, so that no value past
its bound is ever allocated (checking the result afterwards would be too late: ``'%999999999d' % 1``
has already taken a GB). Each estimate is an upper bound, cheap to compute:

- ``value_size``: a value's size counted deep (characters of the strings inside lists, tuples and
  dicts, 4 more per item for the separators), so ``[s] * 1000`` of a long ``s`` is as big as the
  text ``|join`` or ``{{ }}`` would make of it; stops counting past the limit.
- ``percent_format_size`` / ``str_format_size``: ``%`` formatting and ``str.format`` /
  ``format_map``: the format's length, every width and precision, and the arguments' sizes
  (``*`` widths count every integer argument); a nested replacement field in a format spec
  (``{:{}}``) is refused, its width is only known once made.
- ``replace_size``, ``indent_size``, ``expandtabs_size``: the three string operations whose result
  grows with a count times a length.
- Integers: ``MAX_INT_BITS`` bounds ``*`` (bits add) and ``**`` (bits multiply), so neither
  ``9 ** 1024 ** 2`` nor squaring in a loop builds a huge number.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any, Optional

MAX_INT_BITS = 1 << 16  # about 20,000 decimal digits
_ITEM_OVERHEAD = 4  # quotes, comma and space of each item when a container becomes text
# %[(key)][flags][width][.precision][length]type
_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.?)", re.DOTALL)
# [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?[a-zA-Z%]?", re.DOTALL)


class TemplateLimitError(Exception):
    """A template went past a size bound."""


def value_size(value: Any, limit: Optional[int] = None) -> int:
    """Characters ``value`` holds, deep; stops once past ``limit``."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value.bit_length() // 3 + 1  # its decimal digits, about
    if isinstance(value, Mapping):
        items: Any = (x for pair in value.items() for x in pair)
        count = len(value) * 2
    elif isinstance(value, (list, tuple, set, frozenset)):
        items, count = iter(value), len(value)
    else:
        return 0
    total = count * _ITEM_OVERHEAD
    for item in items:
        if limit is not None and total > limit:
            break
        total += value_size(item, None if limit is None else limit - total)
    return total


def int_bits(value: Any) -> int:
    return value.bit_length() if isinstance(value, int) and not isinstance(value, bool) else 0


def check_int_product(left: Any, right: Any) -> None:
    bits = int_bits(left) + int_bits(right)
    if isinstance(left, int) and isinstance(right, int) and bits > MAX_INT_BITS:
        raise TemplateLimitError(f"an integer product of about {bits} bits (at most {MAX_INT_BITS})")


def check_int_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        bits = max(int_bits(base) - 1, 0) * exponent + 1
        if bits > MAX_INT_BITS:
            raise TemplateLimitError(f"an integer power of about {bits} bits (at most {MAX_INT_BITS})")


def _arguments(args: Any) -> list[Any]:
    if isinstance(args, tuple):
        return list(args)
    if isinstance(args, Mapping):
        return list(args.values())
    return [args]


def _star_widths(values: list[Any]) -> int:
    return sum(abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool))


def percent_format_size(fmt: str, args: Any, limit: int) -> int:
    """Upper bound of the length of ``fmt % args``."""
    values = _arguments(args)
    total = len(fmt) + sum(value_size(v, limit) for v in values)
    stars = False
    for match in _PERCENT.finditer(fmt):
        width, precision, _ = match.groups()
        for number in (width, precision):
            if number == "*":
                stars = True
            elif number:
                total += int(number)
    if stars:
        total += _star_widths(values)
    return total


def str_format_size(fmt: str, args: tuple, kwargs: Mapping[str, Any], limit: int) -> int:
    """Upper bound of the length of ``fmt.format(*args, **kwargs)`` (or ``format_map``)."""
    values = [*args, *kwargs.values()]
    total = len(fmt) + sum(value_size(v, limit) for v in values)
    for _literal, field, spec, _conversion in string.Formatter().parse(fmt):
        if field is None or not spec:
            continue
        if "{" in spec:
            raise TemplateLimitError("a format spec with a nested replacement field ({:{}})")
        match = _FORMAT_SPEC.fullmatch(spec)
        if match is None:
            continue  # not a standard spec: str.format refuses it
        total += sum(int(n) for n in match.groups() if n)
    return total


def replace_size(text: Any, old: Any, new: Any, count: Any = None) -> int:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return value_size(text)
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def indent_size(text: Any, width: Any = 4) -> int:
    if not isinstance(text, str):
        return value_size(text)
    pad = width if isinstance(width, int) and not isinstance(width, bool) else len(str(width))
    return len(text) + (text.count("\n") + 1) * max(pad, 0)


def expandtabs_size(text: str, tabsize: Any = 8) -> int:
    size = tabsize if isinstance(tabsize, int) and not isinstance(tabsize, bool) else 8
    return len(text) + text.count("\t") * max(size, 0)
