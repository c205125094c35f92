"""Chat templates rendered within bounds (services/gateway/chat_template.py): every hostile
template below is refused with an error naming ``chat_template``, quickly; ordinary ones render."""

from __future__ import annotations

import time

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
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_refused_quickly(name):
    renderer = ChatTemplateRenderer(max_chars=1_000_000, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError) as err:
        renderer.render(HOSTILE[name], messages=[])
    assert err.value.field == "chat_template"
    assert time.monotonic() - start < 5


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
