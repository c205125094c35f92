"""Reasoning parsers on hand-written replies in each model's published format: the reasoning split
from the content whole and streamed (pieces of several sizes, equal results), the prompt's own
opening or closing of the reasoning, and the Lark prefix that lets structured output start only
after the reasoning (checked token by token with llguidance on the tiny tokenizer)."""

from __future__ import annotations

import llguidance
import pytest
from tokenizers import AddedToken, Tokenizer

from gridserve.services.gateway.chat_output import ChoiceParser
from gridserve.services.gateway.reasoning_parsers import REASONING_PARSERS, PromptState
from gridserve.services.gateway.tool_parsers import TOOL_PARSERS
from gridserve.shared.sampling_params import StructuredOutputsParams
from gridserve.shared.structured_output import after_prefix, compile_grammar, ll_tokenizer

HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]

# parser -> [(fixture, prompt state, reply, reasoning, content)]
FIXTURES = {
    # DeepSeek-R1 model card (https://huggingface.co/deepseek-ai/DeepSeek-R1#usage-recommendations): the
    # template opens <think>, so the reply may start inside the reasoning.
    "deepseek_r1": [
        ("tagged", PromptState.NONE, "<think>\n9.11 < 9.8\n</think>\n\n9.8 is larger.", "\n9.11 < 9.8\n",
         "9.8 is larger."),
        ("opened by the prompt", PromptState.STARTED, "compare decimals</think>9.8", "compare decimals", "9.8"),
        ("no end tag yet", PromptState.NONE, "still thinking about", "still thinking about", None),
        ("closed by the prompt", PromptState.ENDED, "\n9.8 is larger.", None, "9.8 is larger."),
    ],
    # Qwen3 model card (https://huggingface.co/Qwen/Qwen3-8B#switching-between-thinking-and-non-thinking-mode).
    "qwen3": [
        ("thinking", PromptState.NONE, "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n",
         "Hello!"),
        ("no thinking", PromptState.NONE, "Hello!", None, "Hello!"),
        ("enable_thinking false", PromptState.ENDED, "Hello!", None, "Hello!"),
        ("cut short", PromptState.NONE, "<think>\nhmm", "\nhmm", None),
        ("opened by the prompt (Qwen3-Thinking-2507)", PromptState.STARTED, "hmm\n</think>\n\nHi", "hmm\n", "Hi"),
    ],
    # OpenAI harmony (https://cookbook.openai.com/articles/openai-harmony): analysis is reasoning.
    "openai_gptoss": [
        ("analysis then final", PromptState.NONE, "<|channel|>analysis<|message|>Simple greeting.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>", "Simple greeting.", "Hello!"),
        ("final only", PromptState.NONE, "<|channel|>final<|message|>Hello!", None, "Hello!"),
    ],
}
CASES = [(name, *f) for name, fixtures in FIXTURES.items() for f in fixtures]


def _stream(parser, text: str, size: int) -> tuple[str, str]:
    deltas = [parser.stream(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("name, fixture, state, text, reasoning, content", CASES)
def test_reasoning_is_split_from_the_content(name, fixture, state, text, reasoning, content):
    assert REASONING_PARSERS[name](state).extract(text) == (reasoning, content)


@pytest.mark.parametrize("size", [1, 2, 5])
@pytest.mark.parametrize("name, fixture, state, text, reasoning, content", CASES)
def test_streamed_reasoning_and_content_equal_the_unary_split(name, fixture, state, text, reasoning, content, size):
    assert _stream(REASONING_PARSERS[name](state), text, size) == (reasoning or "", content or "")


@pytest.mark.parametrize("tail, state", [
    ("<|im_start|>assistant\n", PromptState.NONE),
    ("<|im_start|>assistant\n<think>\n", PromptState.STARTED),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", PromptState.ENDED),
])
def test_the_prompt_tail_tells_whether_the_template_opened_or_closed_the_reasoning(tail, state):
    assert REASONING_PARSERS["qwen3"].prompt_state(tail) is state


def test_tool_calls_are_parsed_from_the_content_after_the_reasoning():
    parser = ChoiceParser(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"](), parallel=True)
    text = ('<think>\nI need the weather; <tool_call> is how.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    parts = parser.parse(text)
    assert parts.reasoning == "\nI need the weather; <tool_call> is how.\n" and parts.content is None
    assert [(c.name, c.arguments) for c in parts.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    streaming = ChoiceParser(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"](), parallel=True)
    deltas = [streaming.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [streaming.finish()]
    assert "".join(d.reasoning for d in deltas) == parts.reasoning
    assert "".join(c.arguments for d in deltas for c in d.tool_calls) == '{"city": "Paris"}'
    assert streaming.called


@pytest.fixture(scope="module")
def tokenizer(llama_tiny):
    tok = Tokenizer.from_file(str(llama_tiny / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in HARMONY])
    return tok


def _accepts(tok: Tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer(tok, eos_token_id=tok.token_to_id("</s>")), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids) \
        and matcher.is_accepting()


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.parametrize("name, state, accepted, refused", [
    ("deepseek_r1", PromptState.NONE, ['<think>\nsum it\n</think>\n\n{"answer": 4}', 'sum</think>{"answer": 4}'],
     ['{"answer": 4}', '<think>x</think>{"answer": "4"}']),
    ("qwen3", PromptState.NONE, ['<think>\nsum it\n</think>\n\n{"answer": 4}', '{"answer": 4}'],
     ['sum</think>{"answer": 4}', '<think>x</think>4']),
    ("qwen3", PromptState.ENDED, ['{"answer": 4}'], ['<think>x</think>{"answer": 4}']),
    ("openai_gptoss", PromptState.NONE,
     ['<|channel|>analysis<|message|>2+2<|end|><|start|>assistant<|channel|>final<|message|>{"answer": 4}',
      '<|channel|>final<|message|>{"answer": 4}'], ['{"answer": 4}']),
])
def test_structured_output_applies_after_the_reasoning(tokenizer, name, state, accepted, refused):
    parser = REASONING_PARSERS[name](state)
    constraint = StructuredOutputsParams(json=SCHEMA)
    added = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items()}
    prefix = parser.grammar_prefix(added.get)
    grammar = compile_grammar(after_prefix(constraint, prefix) if prefix is not None else constraint)
    for text in accepted:
        assert _accepts(tokenizer, grammar, text), text
    for text in refused:
        assert not _accepts(tokenizer, grammar, text), text


def test_every_reasoning_parser_cites_its_format():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "openai_gptoss"} == set(FIXTURES)
    assert all(parser.source.startswith("https://") for parser in REASONING_PARSERS.values())
