"""Chat templates rendered within bounds (services/gateway/chat_template.py): every hostile
template below is refused with an error naming ``chat_template``, quickly and before the value is
made (the rendering's peak Python memory stays small); ordinary ones render."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from gridserve.services.gateway.chat_template import ChatTemplateRenderer
from gridserve.shared.errors import InvalidArgumentError

HOSTILE = {
    "string repetition": "{{ 'a' * 4000000000 }}",
    "huge range": "{% for i in range(999999999) %}{% endfor %}",
    "namespace doubling": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s }}",
    "macro doubling": "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('a', 40) }}",
    "huge power": "{{ 10 ** 10000000 }}",
    "filter width": "{{ 'a'|center(4000000000) }}",
    "long output": "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    "endless loop without calls": "{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}",
    "syntax error": "{% if %}",
    # issue 38: formatting widths, big integers, amplifying string operations
    "percent width": "{{ '%999999999d' % 1 }}",
    "percent precision": "{{ '%.500000000f' % 1.5 }}",
    "percent star width": "{{ '%*d' % (999999999, 1) }}",
    "percent mapping": "{{ '%(a)999999999s' % {'a': 1} }}",
    "format filter width": "{{ '%999999999d'|format(1) }}",
    "str.format width": "{{ '{:999999999}'.format(1) }}",
    "str.format precision": "{{ '{:.500000000f}'.format(1.5) }}",
    "str.format nested width": "{{ '{:{}}'.format(1, 900000) }}",
    "format_map width": "{{ '{a:>999999999}'.format_map({'a': 1}) }}",
    "join of repeated references": "{% set s = 'a' * 900000 %}{{ ([s] * 1000)|join }}",
    "replace amplification": "{{ ('a' * 900000)|replace('a', 'b' * 900000) }}",
    "replace method": "{{ ('a' * 900000).replace('a', 'b' * 900000) }}",
    "indent amplification": "{{ ('\\n' * 900000)|indent(900000) }}",
    "expandtabs": "{{ ('\\t' * 900000).expandtabs(900000) }}",
}
PEAK_BYTES = 64 << 20  # the biggest value a bound allows here is ~1 M characters


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_refused_quickly(name):
    renderer = ChatTemplateRenderer(max_chars=1_000_000, timeout_s=0.5)
    start = time.monotonic()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError) as err:
            renderer.render(HOSTILE[name], messages=[])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.field == "chat_template"
    assert time.monotonic() - start < 5
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB made before the refusal"


@pytest.mark.parametrize("template", [
    "{{ (9 ** 1024) ** 1024 > 0 }}",  # Jinja's ** is left-associative: 9 ** 1024 ** 1024 is this
    "{% set ns = namespace(x=3) %}{% for i in range(20) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
])
def test_big_integer_arithmetic_is_refused_by_its_bits_before_it_is_computed(template):
    renderer = ChatTemplateRenderer(max_chars=1_000_000, timeout_s=2.0)
    with pytest.raises(InvalidArgumentError, match="bits") as err:
        renderer.render(template)
    assert err.value.field == "chat_template"


def test_a_memory_error_is_a_400_naming_the_template():
    renderer = ChatTemplateRenderer(max_chars=1_000_000, timeout_s=2.0)

    def exhausted():
        raise MemoryError

    renderer.env.globals["exhausted"] = exhausted
    with pytest.raises(InvalidArgumentError, match="out of memory") as err:
        renderer.render("{{ exhausted() }}")
    assert err.value.field == "chat_template"


def test_formatting_and_arithmetic_within_bounds_still_work():
    renderer = ChatTemplateRenderer(max_chars=1_000_000, timeout_s=2.0)
    template = ("{{ '%5d|%-3s|%.2f' % (3, 'a', 1.234) }} {{ '{:>4}{}'.format(1, 'x') }} {{ 2 ** 100 }} "
                "{{ 'ab'|replace('a', 'xy') }} {{ 'x\ny'|indent(2) }} {{ '%s-%s'|format(1, 2) }} {{ 7 % 3 }} "
                "{{ [1, 2]|join(',') }} {{ 'a' * 5 }}")
    assert renderer.render(template) == ("    3|a  |1.23    1x 1267650600228229401496703205376 xyb x\n  y 1-2 1 "
                                         "1,2 aaaaa")


def test_ordinary_template_renders_and_raise_exception_names_messages():
    renderer = ChatTemplateRenderer(max_chars=1_000_000, timeout_s=2.0)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    text = renderer.render(template, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|user|>hi\n<|assistant|>"

    def refuse(message):
        raise InvalidArgumentError("messages", message)

    renderer.env.globals["raise_exception"] = refuse
    with pytest.raises(InvalidArgumentError) as err:
        renderer.render("{{ raise_exception('roles must alternate') }}")
    assert err.value.field == "messages"
