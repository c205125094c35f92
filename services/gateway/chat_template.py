"""``ChatTemplateRenderer``: chat templates rendered in a Jinja sandbox bounded in time and size.

Jinja's sandbox stops attribute tricks, not resource use: ``{{ 'a' * 4000000000 }}`` allocates
4 GB, ``range(999999999)`` a huge loop, a ``namespace`` string doubled in a loop grows without end.
Here every value a template can make is bounded before it is made (the estimates are in
``template_bounds.py``): string and list repetition, ``+``, integer ``*`` and ``**`` by their bits,
``%`` formatting by its widths and precisions (``BoundedSandbox.call_binop``), ``str.format`` /
``format_map`` the same way (``wrap_str_format``), ``replace``, ``indent`` and ``expandtabs``
by what they would add, ``range`` and every call's and filter's arguments and result, every
``namespace`` assignment and every ``{{ }}`` value (``finalize``), sizes counted deep (the strings
inside a list count); the output is consumed as a stream and cut at ``max_chars``. A
``MemoryError`` that slips through anyway is a 400 like the rest. Time: a watchdog raises ``TemplateTimeout`` inside the rendering
thread at the deadline (a pure-Python loop without any call is interrupted too). Every refusal is
an ``InvalidArgumentError`` on ``chat_template`` (HTTP 400), the model's own template included.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import threading
import time
import types
from collections.abc import Callable
from typing import Any, Optional

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from gridserve.services.gateway import template_bounds as bounds
from gridserve.services.gateway.template_bounds import TemplateLimitError
from gridserve.shared.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

MAX_RANGE = 100_000
MAX_EXPONENT = 1024


class TemplateTimeout(Exception):  # noqa: N818 - raised asynchronously in the rendering thread
    """A template ran past its deadline."""


# Filters whose result grows with a count times a length: their size, known from their arguments.
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "replace": bounds.replace_size,
    "indent": bounds.indent_size,
}


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox in which no value grows past ``max_chars`` items."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, max_chars: int, **options: Any) -> None:
        super().__init__(finalize=self._finalize, **options)
        self.max_chars = max_chars
        self.filters = {name: self._bounded(name, f) for name, f in self.filters.items()}
        self.globals["namespace"] = _namespace_class(self)
        self.globals["range"] = self._range

    def _size(self, value: Any) -> int:
        return bounds.value_size(value, self.max_chars)

    def check(self, value: Any) -> Any:
        size = self._size(value)
        if size > self.max_chars:
            raise TemplateLimitError(f"a value of {size} items (at most {self.max_chars})")
        return value

    def _finalize(self, value: Any) -> Any:
        """Every ``{{ }}`` value, before it becomes text."""
        return self.check(value)

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "*":
            count = right if isinstance(right, int) else left if isinstance(left, int) else 1
            sizes = [self._size(x) for x in (left, right) if not isinstance(x, int)]  # a count is no text
            self.check_size(max(sizes, default=0) * max(count, 0))
            bounds.check_int_product(left, right)
            return operator.mul(left, right)
        if operator_name == "**":
            if isinstance(right, int) and abs(right) > MAX_EXPONENT:
                raise TemplateLimitError(f"an exponent of {right} (at most {MAX_EXPONENT})")
            bounds.check_int_power(left, right)
            return operator.pow(left, right)
        if operator_name == "%":
            if isinstance(left, str):
                self.check_size(bounds.percent_format_size(left, right, self.max_chars))
            return operator.mod(left, right)
        self.check_size(self._size(left) + self._size(right))
        return operator.add(left, right)

    def wrap_str_format(self, value: Any) -> Optional[Callable[..., str]]:
        """``str.format`` / ``format_map``, sandboxed by Jinja, and bounded by their widths first."""
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            mapping = args[0] if is_map and len(args) == 1 and isinstance(args[0], dict) else kwargs
            self.check_size(bounds.str_format_size(fmt, () if is_map else args, mapping, self.max_chars))
            return self.check(formatter(*args, **kwargs))

        return bounded

    def check_size(self, size: int) -> None:
        if size > self.max_chars:
            raise TemplateLimitError(f"a value of {size} items (at most {self.max_chars})")

    def check_arguments(self, args: tuple, kwargs: dict) -> None:
        """No argument a size (``center(4000000000)``) or a value past the bound."""
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > self.max_chars:
                raise TemplateLimitError(f"an argument of {arg} (at most {self.max_chars})")
            self.check(arg)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.check_arguments(args, kwargs)
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(__obj.__self__, str):
            if __obj.__name__ == "replace":
                __self.check_size(bounds.replace_size(__obj.__self__, *args, **kwargs))
            elif __obj.__name__ == "expandtabs":
                __self.check_size(bounds.expandtabs_size(__obj.__self__, *args, **kwargs))
        return __self.check(super().call(__context, __obj, *args, **kwargs))

    def _range(self, *args: int) -> range:
        values = range(*args)
        if len(values) > MAX_RANGE:
            raise TemplateLimitError(f"range of {len(values)} items (at most {MAX_RANGE})")
        return values

    def _bounded(self, name: str, fn: Callable) -> Callable:
        size = _FILTER_SIZES.get(name)
        skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # the context Jinja passes

        @functools.wraps(fn)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self.check_arguments(args[skip:], kwargs)
            if size is not None:
                self.check_size(size(*args[skip:], **kwargs))
            elif name == "format" and len(args) > skip and isinstance(args[skip], str):  # '%' formatting
                self.check_size(bounds.percent_format_size(args[skip], kwargs or tuple(args[skip + 1:]),
                                                           self.max_chars))
            return self.check(fn(*args, **kwargs))

        return bounded


def _namespace_class(env: BoundedSandbox) -> type:
    class BoundedNamespace(Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            super().__setitem__(name, env.check(value))

    return BoundedNamespace


class _Watchdog:
    """Raises ``TemplateTimeout`` in the rendering thread if it is still rendering at the deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.active = True
        self.timer = threading.Timer(timeout_s, self._fire)
        self.timer.daemon = True

    def __enter__(self) -> _Watchdog:
        self.timer.start()
        return self

    def _fire(self) -> None:
        with self.lock:
            if self.active:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id),
                                                           ctypes.py_object(TemplateTimeout))

    def __exit__(self, *exc: Any) -> None:
        self.timer.cancel()
        with self.lock:
            self.active = False
            # A timeout raised but not yet delivered is withdrawn.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)


class ChatTemplateRenderer:
    """Renders chat templates (compiled once each) within ``max_chars`` and ``timeout_s``."""

    def __init__(self, max_chars: int, timeout_s: float, globals_: Optional[dict[str, Any]] = None) -> None:
        self.env = BoundedSandbox(max_chars, trim_blocks=True, lstrip_blocks=True)
        self.env.globals.update(globals_ or {})
        self.timeout_s = timeout_s
        self._compiled = functools.lru_cache(maxsize=16)(self.env.from_string)

    def render(self, template: str, /, **variables: Any) -> str:
        """The rendered text; ``InvalidArgumentError`` on ``chat_template`` past a bound."""
        start = time.monotonic()
        try:
            with _Watchdog(self.timeout_s):
                return self._render(template, variables)
        except InvalidArgumentError:
            raise  # the template's own raise_exception(): names its field
        except TemplateTimeout:
            raise InvalidArgumentError("chat_template", f"rendering took longer than {self.timeout_s}s "
                                       "(--template-render-timeout-s)") from None
        except TemplateLimitError as exc:
            raise InvalidArgumentError("chat_template", f"the template went past a bound: {exc}") from None
        except MemoryError:
            raise InvalidArgumentError("chat_template", "the template ran out of memory") from None
        except (TemplateError, ArithmeticError, TypeError, ValueError, LookupError, RecursionError) as exc:
            raise InvalidArgumentError("chat_template", f"cannot render: {type(exc).__name__}: {exc}") from None
        finally:
            logger.debug("chat template rendered in %.3fs", time.monotonic() - start)

    def _render(self, template: str, variables: dict[str, Any]) -> str:
        pieces, total = [], 0
        for piece in self._compiled(template).generate(**variables):
            total += len(piece)
            if total > self.env.max_chars:
                raise TemplateLimitError(f"the output passed {self.env.max_chars} characters "
                                         "(--max-rendered-template-chars)")
            pieces.append(piece)
        return "".join(pieces)
