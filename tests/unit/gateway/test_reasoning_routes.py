"""Reasoning through the chat route (``--reasoning-parser``) on a real tokenizer and template with a
scripted engine: ``reasoning_content`` split from ``content`` whole and as separate deltas,
``chat_template_kwargs`` reaching the template (Qwen3's ``enable_thinking``), structured output
and forced tool calls starting only after the reasoning, harmony's special tokens kept."""

from __future__ import annotations

import json

import pytest

from gridserve.services.gateway.chat_options import ChatOptions
from tests.unit.gateway.scripted_engine import (
    HARMONY_TOKENS,
    THINK_TOKENS,
    body,
    events,
    grammar_accepts,
    routes,
    run,
    tokenizer_folder,
)

QWEN3 = ChatOptions(reasoning_parser="qwen3")
ASK = {"messages": [{"role": "user", "content": "2 + 2?"}]}
THINKING = "<think>\nTwo and two make four.\n</think>\n\n"
ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def folder(llama_tiny, tmp_path_factory):
    return tokenizer_folder(llama_tiny, tmp_path_factory.mktemp("tok"), added=tuple(THINK_TOKENS))


def test_reasoning_content_is_split_from_the_content_whole_and_streamed(folder):
    async def go():
        chat, _ = routes(folder, THINKING + "It is 4.", QWEN3, per_step=1)
        unary = body(await chat.chat_completions(json.dumps(ASK).encode()))
        stream = await events(await chat.chat_completions(json.dumps({**ASK, "stream": True}).encode()))
        return unary, stream

    unary, stream = run(go())
    message = unary["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is 4.", "reasoning_content": "\nTwo and two make four.\n"}
    deltas = [c["delta"] for e in stream for c in e["choices"]]
    assert all(not ("content" in d and "reasoning_content" in d) for d in deltas)  # separate deltas
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_content(folder):
    async def go():
        chat, engine = routes(folder, "It is 4.", QWEN3)
        request = {**ASK, "chat_template_kwargs": {"enable_thinking": False}, "response_format": ANSWER}
        answer = body(await chat.chat_completions(json.dumps(request).encode()))
        return answer, engine

    answer, engine = run(go())
    assert engine.tokenizer.decode(engine.prompts[0]).endswith("<think>\n\n</think>\n\n")
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "It is 4.", "reasoning_content": None}
    # The prompt ended the reasoning: the schema applies from the first token.
    assert engine.params[0].structured_outputs.json is not None
    assert grammar_accepts(engine.tokenizer, engine.params[0], '{"answer": 4}')


def test_structured_output_starts_after_the_reasoning(folder):
    async def go():
        chat, engine = routes(folder, THINKING + '{"answer": 4}', QWEN3)
        answer = body(await chat.chat_completions(json.dumps({**ASK, "response_format": ANSWER}).encode()))
        return answer, engine

    answer, engine = run(go())
    assert answer["choices"][0]["message"]["content"] == '{"answer": 4}'
    params = engine.params[0]
    assert params.structured_outputs.grammar.startswith("start: reasoning_prefix body")
    assert grammar_accepts(engine.tokenizer, params, THINKING + '{"answer": 4}')
    assert grammar_accepts(engine.tokenizer, params, '{"answer": 4}')  # Qwen3 may answer without thinking
    assert not grammar_accepts(engine.tokenizer, params, THINKING + "four")


def test_forced_tool_calls_start_after_the_reasoning(folder):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    reply = THINKING + '[{"name": "add", "parameters": {"a": 2}}]'

    async def go():
        chat, engine = routes(folder, reply, QWEN3)
        answer = body(await chat.chat_completions(json.dumps({**ASK, "tools": tools, "tool_choice": "required"}).encode()))
        return answer, engine

    answer, engine = run(go())
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == "\nTwo and two make four.\n" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert grammar_accepts(engine.tokenizer, engine.params[0], reply)


def test_earlier_reasoning_and_reasoning_effort_reach_the_template(folder):
    turns = [*ASK["messages"], {"role": "assistant", "content": "4", "reasoning_content": "I added."},
             {"role": "user", "content": "And 3 + 3?"}]

    async def go():
        chat, engine = routes(folder, "6", QWEN3)
        await chat.chat_completions(json.dumps({"messages": turns, "reasoning_effort": "low"}).encode())
        return engine.tokenizer.decode(engine.prompts[0])

    prompt = run(go())
    assert "<think>\nI added.\n</think>\n4" in prompt and prompt.endswith("(effort low)")


def test_chat_template_kwargs_cannot_replace_the_servers_variables(folder):
    async def go():
        chat, _ = routes(folder, "x", QWEN3)
        return await chat.chat_completions(json.dumps({**ASK, "chat_template_kwargs": {"messages": []}}).encode())

    response = run(go())
    assert response.status == 400 and body(response)["error"]["param"] == "chat_template_kwargs"


def test_harmony_reasoning_keeps_the_special_tokens_it_reads(llama_tiny, tmp_path):
    folder = tokenizer_folder(llama_tiny, tmp_path, special=tuple(HARMONY_TOKENS))
    reply = ("<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>"
             "It is 4.<|return|>")

    async def go():
        chat, engine = routes(folder, reply, ChatOptions(reasoning_parser="openai_gptoss"))
        answer = body(await chat.chat_completions(json.dumps(ASK).encode()))
        return answer, engine

    answer, engine = run(go())
    assert engine.params[0].skip_special_tokens is False
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "It is 4.",
                                               "reasoning_content": "Simple sum."}


def test_a_requests_own_grammar_describes_the_whole_reply_reasoning_included(folder):
    grammar = 'start: "<think>" /[a-z ]{1,20}/ "</think>" "4"'

    async def go():
        chat, engine = routes(folder, "<think>add</think>4", QWEN3)
        answer = body(await chat.chat_completions(json.dumps({**ASK, "structured_outputs": {"grammar": grammar}}).encode()))
        return answer, engine

    answer, engine = run(go())
    assert engine.params[0].structured_outputs.grammar == grammar  # not behind the reasoning prefix
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "4", "reasoning_content": "add"}
