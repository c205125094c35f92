"""A gateway on a real tokenizer with an engine that plays back a scripted reply: the REST routes'
whole chat path (template, tool and reasoning plans, grammars, parsers, SSE) without a model.

``tokenizer_folder`` writes the tiny Llama's tokenizer with chosen added tokens and a chat template;
``ScriptedEngine`` answers every request with the token ids of ``reply`` (and, when asked, logprobs
and prompt logprobs), recording the ``SamplingParams`` it was sent; ``routes`` builds the
``OpenAIRoutes`` of a ``GatewayService`` over them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any, Optional

from tokenizers import AddedToken, Tokenizer

from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.media_loader import MediaLoader
from gridserve.services.gateway.routes import OpenAIRoutes
from gridserve.services.gateway.service import GatewayService
from gridserve.services.gateway.tokenizer import GatewayTokenizer
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.scheduler_output import TokenLogprobs
from tests.unit.gateway.fake_engine_client import FakeEngineClient

# A Qwen2.5-style template (https://qwen.readthedocs.io/en/latest/framework/function_call.html):
# tools in the system turn, calls as <tool_call> JSON, results as <tool_response>, Qwen3's
# enable_thinking switch and reasoning_content of earlier turns.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n{% endif %}"
    "{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{%- if reasoning_effort is defined %}(effort {{ reasoning_effort }}){% endif %}"
    "{%- endif %}"
)
THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # ordinary added tokens, as Qwen's
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]
MISTRAL_TOKENS = ["[TOOL_CALLS]", "[ARGS]"]
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


def tokenizer_folder(base: Path, out: Path, template: str = QWEN_STYLE_TEMPLATE, added: tuple[str, ...] = (),
                     special: tuple[str, ...] = ()) -> Path:
    """A tokenizer folder: ``base``'s tokenizer plus ``added`` (ordinary) and ``special`` tokens."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def copy_checkpoint(base: Path, out: Path, template: str = QWEN_STYLE_TEMPLATE) -> Path:
    """``base`` (a model folder) with another chat template."""
    shutil.copytree(base, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").write_text(template)
    return out


class ScriptedEngine(FakeEngineClient):
    """Answers every request with ``reply``'s tokens, a few per step, then EOS (finish "stop")."""

    def __init__(self, tokenizer: GatewayTokenizer, reply: str = "", per_step: int = 2) -> None:
        super().__init__("scripted:1")
        self.tokenizer = tokenizer
        self.reply = reply
        self.per_step = per_step
        self.params: list = []  # the SamplingParams of each request
        self.prompts: list[list[int]] = []  # ... and its prompt

    def reply_ids(self) -> list[int]:
        return self.tokenizer.encode(self.reply, add_special_tokens=False)

    async def add_request(self, request_id, token_ids, params, **_):
        self.params.append(params)
        self.prompts.append(list(token_ids))
        ids = self.reply_ids() + [self.tokenizer.eos_token_id]
        steps = [ids[i:i + self.per_step] for i in range(0, len(ids), self.per_step)]
        queue = self.queues[request_id]
        for k, step in enumerate(steps):
            last = k == len(steps) - 1
            prompt_lps = [_lp(t) for t in token_ids[1:]] if k == 0 and params.prompt_logprobs is not None else []
            queue.put_nowait(EngineCoreOutput(
                request_id, step, [_lp(t) for t in step] if params.logprobs is not None else [],
                prompt_lps, FinishReason.STOP if last else None))


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token_ids=[token], logprobs=[-0.5], sampled_rank=1)


_TOKENIZERS: dict[Path, GatewayTokenizer] = {}
_MEDIA: list[MediaLoader] = []  # one loader (building its TLS context costs ~0.1 s)


def routes(tokenizer_dir: Path, reply: str = "", options: Optional[ChatOptions] = None,
           per_step: int = 2) -> tuple[OpenAIRoutes, ScriptedEngine]:
    """The routes of a gateway whose engine answers ``reply`` (call inside a running loop); the
    tokenizer of a folder is loaded once."""
    if tokenizer_dir not in _TOKENIZERS:
        _TOKENIZERS[tokenizer_dir] = GatewayTokenizer(str(tokenizer_dir))
    tokenizer = _TOKENIZERS[tokenizer_dir]
    engine = ScriptedEngine(tokenizer, reply, per_step)
    vocab = tokenizer.backend_tokenizer.get_vocab_size()
    if not _MEDIA:
        _MEDIA.append(MediaLoader())
    service = GatewayService(tokenizer, [engine], "m", 4096, vocab, 20, media=_MEDIA[0], chat_options=options)
    return OpenAIRoutes(service, "m"), engine


def recording_routes(tokenizer_dir: Path, keyword: str, default: Any = None) -> tuple[OpenAIRoutes, list]:
    """``routes`` whose engine also records, per engine request, the ``keyword`` argument the gateway
    passed to ``add_request`` (``default`` when it passed none)."""
    chat, engine = routes(tokenizer_dir, "fine")
    seen: list = []
    add = engine.add_request

    async def recording_add(request_id, token_ids, params, **kw):
        seen.append(kw.get(keyword, default))
        await add(request_id, token_ids, params, **kw)

    engine.add_request = recording_add
    return chat, seen


async def call_route(chat: OpenAIRoutes, route: str, **fields):
    """One short request on ``route`` (``completions``, ``chat`` or ``responses``) with ``fields``."""
    from gridserve.services.gateway.responses_api import ResponsesAPI

    if route == "completions":
        return await chat.completions(json.dumps({"prompt": "Hi", "max_tokens": 2, **fields}).encode())
    if route == "chat":
        return await chat.chat_completions(json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 2, **fields}).encode())
    return await ResponsesAPI(chat).create(json.dumps({"input": "Hi", "max_output_tokens": 2, **fields}).encode())


async def events(response) -> list[dict]:
    """The JSON events of an SSE response (``[DONE]`` left out)."""
    chunks = [c async for c in response.chunks]
    data = [c.decode().removeprefix("data: ").strip() for c in chunks]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def grammar_accepts(tokenizer: GatewayTokenizer, params, text: str) -> bool:
    """Whether the structured output of ``params`` lets the model write ``text`` and then stop."""
    import llguidance

    from gridserve.shared.structured_output import compile_grammar, ll_tokenizer

    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), compile_grammar(params.structured_outputs), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def body(response) -> dict:
    return json.loads(b"".join(response.chunks))


def run(coro):
    return asyncio.run(coro)
