"""The OpenAI-compatible REST protocol, declared: request and response bodies as pydantic models.

As in vLLM's ``protocol.py``, a body is checked by ``Model.model_validate_json`` and nothing else:
types (strict: ``"5"`` is not a number, ``true`` is not an integer), finite numbers only, every
integer within the protobuf field it travels in, and the server's caps (``RequestLimits``, given
as validation context under ``"limits"``) are declared on the fields, so an error names its field
by itself and ``/openapi.json`` is generated from the same models. ``to_sampling_params`` turns a
request into the domain's ``SamplingParams``; the typed gRPC API validates through ``SamplingFields``.

No field is dropped silently (``docs/serving/openai-fields.md`` lists every one): a field of
OpenAI's API, or a vLLM extension, is declared here and either honoured or refused with a 400
naming it (``unsupported``) when its value asks for what this server cannot do. A top-level field
that is neither is refused too ("unrecognized request argument supplied", what OpenAI answers).
Inside a message or a content part, where clients send back objects they received (with keys of
other servers' making), an unknown key is ignored and named in the ``x-gridserve-ignored-fields``
response header (``ignored_fields``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    MISSING,
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gridserve.services.gateway.beam_search import BeamSearchParams
from gridserve.services.gateway.limits import RequestLimits
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.lora import MAX_LORA_NAME
from gridserve.shared.request_checks import MAX_CACHE_SALT_CHARS
from gridserve.shared.sampling_params import SamplingParams, StructuredOutputsParams

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
DEFAULT_LIMITS = RequestLimits()


def limits_of(info: ValidationInfo) -> RequestLimits:
    """The caps of this validation (``context={"limits": ...}``), the defaults without one."""
    return (info.context or {}).get("limits") or DEFAULT_LIMITS


def capped(cap: str, measure: Callable[[Any], int] = len, what: str = "items") -> AfterValidator:
    """A field bounded by ``RequestLimits.<cap>`` (a flag of the same name)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return value
        limit = getattr(limits_of(info), cap)
        size = measure(value)
        if size > limit:
            flag = "--" + cap.replace("_", "-")
            raise ValueError(f"at most {limit} {what} allowed ({flag}), got {size}")
        return value

    return AfterValidator(check)


def _longest(strings: Union[str, list[str]]) -> int:
    return len(strings) if isinstance(strings, str) else max(map(len, strings), default=0)


def _count(strings: Union[str, list[str]]) -> int:
    return 1 if isinstance(strings, str) else len(strings)


def _chars(value: Any) -> int:
    return len(value if isinstance(value, str) else json.dumps(value))


class OpenAIBaseModel(BaseModel):
    """Strict types, finite numbers, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)


class ClosedModel(OpenAIBaseModel):
    """A body (or part) whose unknown fields are refused with a 400 naming them."""

    model_config = ConfigDict(extra="forbid")


class TolerantModel(OpenAIBaseModel):
    """A part clients echo back (a message): unknown keys are kept aside (``model_extra``) so the
    route names them in the ``x-gridserve-ignored-fields`` header."""

    model_config = ConfigDict(extra="allow")


def unsupported(why: str) -> AfterValidator:
    """A declared field this server cannot honour: any value but null is refused, naming it."""

    def refuse(value: Any) -> Any:
        if value is None:
            return value
        raise ValueError(why)

    return AfterValidator(refuse)


Unsupported = Optional[Any]


def _client_priority(value: int, info: ValidationInfo) -> int:
    """A nonzero priority only where the gateway lets clients set one (``--allow-client-priority``)."""
    if value and not limits_of(info).allow_client_priority:
        raise ValueError("setting a priority needs the gateway's --allow-client-priority (send 0 or leave it out)")
    return value


# vLLM's ``priority``: lower runs first on an engine with --scheduling-policy priority (an int32 there).
Priority = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX), AfterValidator(_client_priority)]
# vLLM's ``cache_salt``: mixed into the first prefix-cache block's hash, so only requests with the
# same salt share cached prefixes (one tenant cannot time another's cache hits).
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count32 = Annotated[int, Field(ge=0, le=UINT32_MAX)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


# ---- requests --------------------------------------------------------------------------------
class StreamOptions(ClosedModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)
    include_obfuscation: Annotated[Optional[bool], AfterValidator(
        lambda v: _refuse_true(v, "stream obfuscation is not offered (send false or leave it out)"))] = None


def _refuse_true(value: Optional[bool], why: str) -> Optional[bool]:
    if value:
        raise ValueError(why)
    return value


class JsonSchemaFormat(ClosedModel):
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(ClosedModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(ClosedModel):
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None


class SamplingFields(OpenAIBaseModel):
    """The sampling and stopping fields every generation request shares (vLLM's names)."""

    model: Optional[str] = None
    n: Annotated[int, Field(ge=1, le=UINT32_MAX), capped("max_n", int, "samples")] = 1
    best_of: Annotated[Optional[int], Field(ge=1, le=UINT32_MAX), capped("max_best_of", int, "samples")] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=1e6)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=-1, le=INT32_MAX)]] = None
    min_p: Optional[Probability] = None
    seed: Optional[Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0.0, le=1e6)]] = None
    min_tokens: Optional[Count32] = None
    ignore_eos: Optional[bool] = None
    stop: Annotated[Optional[Union[str, list[str]]], capped("max_stop_strings", _count, "stop strings"),
                    capped("max_stop_string_chars", _longest, "characters in a stop string")] = None
    stop_token_ids: Annotated[Optional[list[TokenId]], capped("max_stop_token_ids", what="token ids")] = None
    bad_words: Annotated[Optional[list[str]], capped("max_stop_strings", what="bad words"),
                         capped("max_stop_string_chars", _longest, "characters in a bad word")] = None
    allowed_token_ids: Annotated[Optional[list[TokenId]], capped("max_stop_token_ids", what="token ids")] = None
    logit_bias: Annotated[Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]],
                          capped("max_logit_bias", what="entries")] = None
    prompt_logprobs: Annotated[Optional[Count32], capped("max_logprobs", int, "logprobs")] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    truncate_prompt_tokens: Optional[Annotated[int, Field(ge=1, le=UINT32_MAX)]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Annotated[Optional[StructuredOutputs],
                                  capped("max_structured_output_chars",
                                         lambda s: _chars(s.model_dump(exclude_none=True)),
                                         "characters of constraint")] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Annotated[Optional[str], Field(max_length=256)] = None  # who asks: logged with the request id
    data_parallel_rank: Optional[Annotated[int, Field(ge=0, le=INT32_MAX)]] = None
    priority: Priority = 0
    cache_salt: Optional[CacheSalt] = None
    # vLLM's beam search (width n, the gateway's loop: beam_search.py); early_stopping is transformers'
    use_beam_search: bool = False
    length_penalty: Optional[Annotated[float, Field(ge=-10.0, le=10.0)]] = None
    early_stopping: Optional[Union[bool, Literal["never"]]] = None

    @model_validator(mode="after")
    def _stream_only_fields(self) -> SamplingFields:
        # A check across fields has no location of its own: InvalidArgumentError names the field.
        if self.stream_options is not None and not self.stream:
            raise InvalidArgumentError("stream_options", "only with stream: true")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidArgumentError("prompt_logprobs", "not available with stream: true (as in vLLM)")
        return self

    @model_validator(mode="after")
    def _beam_search_fields(self, info: ValidationInfo) -> SamplingFields:
        """Beam search ranks by the model's own logprobs: a field that would change them (or asks for
        what it does not return) is refused with it, naming the field; its own fields need it."""
        if not self.use_beam_search:
            for name in ("length_penalty", "early_stopping"):
                if getattr(self, name) is not None:
                    raise InvalidArgumentError(name, "only with use_beam_search: true")
            return self
        for name, neutral in BEAM_SEARCH_NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and not any(_same(value, v) for v in neutral):
                raise InvalidArgumentError(name, "not available with use_beam_search: true")
        max_logprobs = limits_of(info).max_logprobs
        if 2 * self.n > max_logprobs:
            raise InvalidArgumentError("n", f"beam search asks the engine for 2 x n logprobs a step; at most "
                                            f"{max_logprobs // 2} (--max-logprobs {max_logprobs}), got {self.n}")
        return self

    def to_beam_search_params(self, max_tokens: Optional[int], max_model_len: int) -> BeamSearchParams:
        """vLLM's ``BeamSearchParams``: width ``n``; no ``max_tokens``: up to the context's end."""
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidArgumentError("best_of", "only best_of == n is supported (the beam width)")
        return BeamSearchParams(
            beam_width=self.n, max_tokens=max_tokens or max_model_len, ignore_eos=bool(self.ignore_eos),
            length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
            early_stopping=False if self.early_stopping is None else self.early_stopping,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key in bias or {}:
            if not key.lstrip("-").isdigit() or not 0 <= int(key) <= INT32_MAX:
                raise ValueError(f"keys must be token ids (integers in [0, {INT32_MAX}]), got {key!r}")
        return bias

    @field_validator("response_format")
    @classmethod
    def _schema_size(cls, fmt: Optional[ResponseFormat], info: ValidationInfo) -> Optional[ResponseFormat]:
        if fmt is not None and fmt.json_schema is not None and fmt.json_schema.json_schema is not None:
            limit = limits_of(info).max_structured_output_chars
            size = _chars(fmt.json_schema.json_schema)
            if size > limit:
                raise ValueError(f"the JSON schema has {size} characters; at most {limit} allowed "
                                 "(--max-structured-output-chars)")
        return fmt

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (``include_usage`` and ``continuous_usage_stats``, as vLLM)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats

    def to_sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                           defaults: Optional[Mapping[str, Any]] = None) -> SamplingParams:
        """The domain's ``SamplingParams``: a field the request leaves out takes the model's default
        (``defaults``: its generation config, ``--generation-config``), else ``SamplingParams``'."""
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidArgumentError("best_of", "only best_of == n is supported (no ranking of samples)")
        names = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                 "bad_words", "allowed_token_ids", "prompt_logprobs", "include_stop_str_in_output",
                 "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens")
        kwargs: dict[str, Any] = {**(defaults or {})}
        kwargs.update((k, v) for k in names if (v := getattr(self, k)) is not None)
        kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs["max_tokens"] = max_tokens if max_tokens is not None else kwargs.get("max_tokens")
        kwargs["logprobs"] = logprobs
        if self.logit_bias:
            kwargs["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        kwargs["structured_outputs"] = self._structured()
        return SamplingParams(**kwargs)

    def _structured(self) -> Optional[StructuredOutputsParams]:
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputsParams(json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                                           choice=so.choice, grammar=so.grammar)
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidArgumentError("response_format", "json_schema.schema: expected a JSON schema object")
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)


# What use_beam_search refuses unless left out or given its neutral value (vLLM ignores these).
BEAM_SEARCH_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "temperature": (0.0,), "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,),
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "min_tokens": (0,),
    "bad_words": ([],), "allowed_token_ids": (), "logit_bias": ({},), "prompt_logprobs": (), "logprobs": (False,),
    "top_logprobs": (), "echo": (False,), "response_format": (), "structured_outputs": (),
    "tool_choice": ("none", "auto"), "truncate_prompt_tokens": (), "spaces_between_special_tokens": (True,),
}



def _same(value: Any, neutral: Any) -> bool:
    """Equal, and a bool only to a bool (``logprobs: 0`` asks for logprobs; ``false`` does not)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


PromptType = Union[str, list[str], list[TokenId], list[list[TokenId]]]


def _check_prompt(prompt: PromptType, info: ValidationInfo) -> PromptType:
    """Not empty, no empty token list, within the prompt count and length caps."""
    prompts = _as_prompts(prompt)
    if not prompts or any(not p for p in prompts):
        raise ValueError("expected a string, a list of strings, token ids or a list of non-empty "
                         "token-id lists")
    limits = limits_of(info)
    if len(prompts) > limits.max_prompts_per_request:
        raise ValueError(f"at most {limits.max_prompts_per_request} prompts allowed "
                         f"(--max-prompts-per-request), got {len(prompts)}")
    longest = max(len(p) for p in prompts)
    if longest > limits.max_content_chars:
        raise ValueError(f"a prompt of {longest} characters or tokens; at most {limits.max_content_chars} "
                         "allowed (--max-content-chars)")
    return prompt


def _as_prompts(prompt: PromptType) -> list[Union[str, list[int]]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[PromptType, AfterValidator(_check_prompt)]
    max_tokens: Optional[Annotated[int, Field(ge=1, le=UINT32_MAX)]] = 16
    logprobs: Annotated[Optional[Count32], capped("max_logprobs", int, "logprobs")] = None
    echo: bool = False  # with logprobs: the prompt's tokens' logprobs too
    # Fill in the middle, where the tokenizer has FIM tokens (else a 400 naming it).
    suffix: Annotated[Optional[str], capped("max_content_chars", what="characters")] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """One prompt (a string or token ids) per completion the request asks for."""
        return _as_prompts(self.prompt)


class ImageUrl(TolerantModel):
    url: Annotated[str, Field(min_length=1)]
    detail: Optional[str] = None


class ContentPart(TolerantModel):
    """One part of a message: ``text``, or ``image_url`` (a vision-language model's image)."""

    type: Literal["text", "image_url"]
    text: Optional[str] = None
    image_url: Optional[ImageUrl] = None

    @model_validator(mode="after")
    def _image_part_has_url(self) -> ContentPart:
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url part needs image_url.url")
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs text (a string)")
        return self

    def for_template(self) -> dict[str, Any]:
        if self.type == "text":
            return {"type": "text", "text": self.text or ""}
        return {"type": "image_url", "image_url": {"url": self.image_url.url}}


def _content_chars(content: Union[str, list[ContentPart], None]) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(p.text or "") for p in content)


class FunctionCall(ClosedModel):
    """The function an assistant's tool call named; ``arguments`` is JSON text (OpenAI's), or an object."""

    name: Annotated[str, Field(min_length=1)]
    arguments: Union[str, dict[str, Any]] = "{}"


class AssistantToolCall(ClosedModel):
    """A tool call of an earlier assistant turn (sent back with the tool's result)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As vLLM hands it to templates: arguments that are a JSON object's text become the object
        (templates iterate them or apply ``tojson``); any other text stays as it is."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            arguments = decoded if isinstance(decoded, dict) else arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def _no_annotations(value: Optional[list[Any]]) -> Optional[list[Any]]:
    if value:
        raise ValueError("annotations (web-search citations) are not used by this server; send an empty list")
    return value


class ChatMessage(TolerantModel):
    """One message; ``content`` is a string or parts (text, and images for a vision-language model).

    An assistant turn may carry ``tool_calls`` and its ``reasoning_content``; a ``tool`` turn the
    ``tool_call_id`` its result answers. All of it reaches the chat template."""

    role: str
    content: Annotated[Union[str, list[ContentPart], None],
                       capped("max_content_chars", _content_chars, "characters of content")] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Annotated[Optional[list[AssistantToolCall]], capped("max_messages", what="tool calls")] = None
    reasoning_content: Annotated[Optional[str], capped("max_content_chars", what="characters")] = None
    reasoning: Annotated[Optional[str], capped("max_content_chars", what="characters")] = None  # vLLM's newer name
    refusal: Annotated[Optional[str], capped("max_content_chars", what="characters")] = None  # the text if no content
    annotations: Annotated[Optional[list[Any]], AfterValidator(_no_annotations)] = None
    audio: Annotated[Unsupported, unsupported("audio turns are not served; send the transcript as content")] = None
    function_call: Annotated[Unsupported, unsupported("the deprecated function_call: send tool_calls")] = None

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")

    def for_template(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined into a string, unless it has images
        (then every part, in order: the route loads the images, the template places them)."""
        parts = self.content if isinstance(self.content, list) else []
        has_images = any(p.type == "image_url" for p in parts)
        content: Any = [p.for_template() for p in parts] if has_images else self.text()
        message: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class FunctionDefinition(ClosedModel):
    name: Annotated[str, Field(min_length=1)]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # "required" and named calls are always schema-exact; "auto" is not constrained


class ChatTool(ClosedModel):
    """A tool the chat template is told about (``tools`` in the template's variables)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


Messages = Annotated[list[ChatMessage], Field(min_length=1), capped("max_messages", what="messages")]


# What the server gives every template (its variables and the sandbox's bounded functions).
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                         "raise_exception", "namespace", "range"})


def _template_kwargs(value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    taken = sorted(set(value or {}) & RESERVED_TEMPLATE_VARIABLES)
    if taken:
        raise ValueError(f"{taken[0]!r} is set by the server (use the request's own field)")
    return value


class ChatTemplateFields(OpenAIBaseModel):
    """What renders a conversation into a prompt."""

    messages: Messages
    chat_template: Annotated[Optional[str], capped("max_chat_template_chars", what="characters")] = None
    add_generation_prompt: bool = True
    tools: Annotated[Optional[list[ChatTool]], capped("max_messages", what="tools")] = None
    # vLLM's: extra variables for the template (e.g. {"enable_thinking": false} for Qwen3)
    chat_template_kwargs: Annotated[Optional[dict[str, Any]], AfterValidator(_template_kwargs),
                                    capped("max_chat_template_chars", _chars, "characters")] = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def ignored_fields(self) -> list[str]:
        """The unknown keys of the messages and their parts, as paths (``messages[1].foo``)."""
        found = []
        for i, message in enumerate(self.messages):
            found += [f"messages[{i}].{key}" for key in message.model_extra or {}]
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                found += [f"messages[{i}].content[{j}].{key}" for key in part.model_extra or {}]
                if part.image_url is not None:
                    found += [f"messages[{i}].content[{j}].image_url.{key}" for key in part.image_url.model_extra or {}]
        return found

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]


class NamedFunction(ClosedModel):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(ClosedModel):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    function: NamedFunction


def _metadata(value: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
    """OpenAI's bounds: at most 16 pairs, keys of at most 64 characters, values of at most 512."""
    if value is not None:
        if len(value) > 16:
            raise ValueError(f"at most 16 pairs, got {len(value)}")
        for key, item in value.items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError(f"{key[:64]!r}: keys have at most 64 characters, values at most 512")
    return value


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Optional[Annotated[int, Field(ge=1, le=UINT32_MAX)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1, le=UINT32_MAX)]] = None
    logprobs: bool = False
    top_logprobs: Annotated[Optional[Count32], capped("max_logprobs", int, "logprobs")] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None  # default true; false: at most one call
    # To the chat template as ``reasoning_effort`` (gpt-oss's template reads it).
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    store: Annotated[Optional[bool], AfterValidator(
        lambda v: _refuse_true(v, "this server does not store completions (send false or leave it out)"))] = None
    metadata: Annotated[Optional[dict[str, str]], AfterValidator(_metadata)] = None  # checked; nothing is stored
    service_tier: Optional[Literal["auto", "default"]] = None  # one tier here
    modalities: Optional[list[Literal["text"]]] = None
    prompt_cache_key: Annotated[Optional[str], Field(max_length=1024)] = None  # prefix caching is automatic
    safety_identifier: Annotated[Optional[str], Field(max_length=256)] = None  # as user: logged
    verbosity: Annotated[Unsupported, unsupported("not offered by this server's models")] = None
    audio: Annotated[Unsupported, unsupported("audio output is not served")] = None
    prediction: Annotated[Unsupported, unsupported("predicted outputs are not served")] = None
    web_search_options: Annotated[Unsupported, unsupported("web search is not offered")] = None
    functions: Annotated[Unsupported, unsupported("deprecated by OpenAI: send tools")] = None
    function_call: Annotated[Unsupported, unsupported("deprecated by OpenAI: send tool_choice")] = None

    def template_variables(self) -> dict[str, Any]:
        """The extra variables of the chat template: ``chat_template_kwargs``, and
        ``reasoning_effort`` when set (a kwarg of the same name wins)."""
        variables: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        return {**variables, **(self.chat_template_kwargs or {})}

    def to_params(self, defaults: Optional[Mapping[str, Any]] = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.to_sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt`` or chat ``messages``."""

    chat_template_kwargs: Annotated[Optional[dict[str, Any]], AfterValidator(_template_kwargs),
                                    capped("max_chat_template_chars", _chars, "characters")] = None

    model: Optional[str] = None
    prompt: Annotated[Optional[str], capped("max_content_chars", what="characters")] = None
    messages: Annotated[Optional[list[ChatMessage]], capped("max_messages", what="messages")] = None
    chat_template: Annotated[Optional[str], capped("max_chat_template_chars", what="characters")] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    tools: Optional[list[ChatTool]] = None


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``: token ids back to text."""

    model: Optional[str] = None
    tokens: Annotated[list[Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]],
                      capped("max_content_chars", what="tokens")]


MAX_LORA_PATH = 4096  # characters of an adapter's folder (PATH_MAX)


def _printable(value: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("must not contain control characters")
    if value != value.strip():
        raise ValueError("must not start or end with whitespace")
    return value


LoraName = Annotated[str, Field(min_length=1, max_length=MAX_LORA_NAME), AfterValidator(_printable)]


class LoadLoraAdapterRequest(ClosedModel):
    """vLLM's ``POST /v1/load_lora_adapter``: serve the PEFT adapter in ``lora_path`` (a folder on
    the workers' hosts, inside the engines' ``--lora-dir`` when they have one) as the model
    ``lora_name``."""

    lora_name: LoraName
    lora_path: Annotated[str, Field(min_length=1, max_length=MAX_LORA_PATH), AfterValidator(_printable)]


class UnloadLoraAdapterRequest(ClosedModel):
    """vLLM's ``POST /v1/unload_lora_adapter``: stop serving ``lora_name``. vLLM's ``lora_int_id``
    is accepted and not used (each engine numbers its adapters itself)."""

    lora_name: LoraName
    lora_int_id: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = None


# ---- responses -------------------------------------------------------------------------------
class ResponseModel(BaseModel):
    """A response body; fields left ``MISSING`` are not written."""

    def dumps(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(ResponseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(ResponseModel):
    """The completions API's logprobs; an echoed prompt's first token has none (null)."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class PromptLogprob(ResponseModel):
    """vLLM's shape of one candidate token at a prompt position."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per prompt position (the first has none): token id (as a JSON key) -> its logprob.
PromptLogprobs = list[Optional[dict[str, PromptLogprob]]]


FinishReasonField = Optional[str]
StopReason = Union[int, str, None]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: FinishReasonField = None
    stop_reason: Union[StopReason, MISSING] = MISSING
    prompt_logprobs: Union[PromptLogprobs, MISSING] = MISSING  # with the request's prompt_logprobs


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Union[Optional[UsageInfo], MISSING] = MISSING


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobToken]


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(ResponseModel):
    """A tool call of the reply (OpenAI's shape)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(ResponseModel):
    """The reply; ``reasoning_content`` with ``--reasoning-parser``, ``tool_calls`` when it calls tools
    (``content`` is then null unless the model also wrote text)."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Union[Optional[str], MISSING] = MISSING
    tool_calls: Union[list[ToolCallOut], MISSING] = MISSING


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: FinishReasonField = None
    stop_reason: StopReason = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Union[PromptLogprobs, MISSING] = MISSING  # with the request's prompt_logprobs


class DeltaFunctionCall(ResponseModel):
    name: Union[str, MISSING] = MISSING
    arguments: Union[str, MISSING] = MISSING


class DeltaToolCall(ResponseModel):
    """A streamed tool call: ``index``, then ``id``, ``type`` and the name once, then argument
    fragments whose concatenation is the call's ``arguments``."""

    index: int
    id: Union[str, MISSING] = MISSING
    type: Union[Literal["function"], MISSING] = MISSING
    function: DeltaFunctionCall


class DeltaMessage(ResponseModel):
    role: Union[str, MISSING] = MISSING
    content: Union[str, MISSING] = MISSING
    reasoning_content: Union[str, MISSING] = MISSING
    tool_calls: Union[list[DeltaToolCall], MISSING] = MISSING


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: FinishReasonField = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Union[Optional[UsageInfo], MISSING] = MISSING


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gridserve"
    root: str
    parent: Optional[str] = None
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str


# ---- the typed gRPC API: the same fields, the same checks ------------------------------------
class GrpcSamplingFields(SamplingFields):
    """``SamplingFields`` plus what the typed API sets directly (``max_tokens``, ``logprobs``)."""

    max_tokens: Optional[Annotated[int, Field(ge=1, le=UINT32_MAX)]] = None
    logprobs: Annotated[Optional[Count32], capped("max_logprobs", int, "logprobs")] = None
    prompt: Annotated[Optional[str], capped("max_content_chars", what="characters")] = None


class PriorityField(OpenAIBaseModel):
    """The typed gRPC API's ``priority``, checked as the REST bodies' (``--allow-client-priority``)."""

    priority: Priority = 0


def check_priority(priority: int, limits: RequestLimits) -> int:
    """``priority`` if this gateway accepts it, else ``InvalidArgumentError`` naming it."""
    return validate_as(PriorityField, {"priority": priority}, limits).priority


def check_sampling_params(params: SamplingParams, limits: RequestLimits, prompt: Optional[str] = None) -> None:
    """Validate the typed gRPC API's ``SamplingParams`` (and text prompt) with the REST models;
    a refusal is ``InvalidArgumentError`` naming the field (INVALID_ARGUMENT)."""
    fields: dict[str, Any] = {name: getattr(params, name) for name in GrpcSamplingFields.model_fields
                              if hasattr(params, name) and name != "structured_outputs"}
    fields["logit_bias"] = {str(k): v for k, v in (params.logit_bias or {}).items()}
    fields["prompt"] = prompt
    so = params.structured_outputs
    if so is not None:
        fields["structured_outputs"] = StructuredOutputs(json=so.json, json_object=so.json_object or None,
                                                         regex=so.regex, choice=so.choice, grammar=so.grammar)
    validate_as(GrpcSamplingFields, fields, limits, "sampling_params.")


def validate_as(model: type[BaseModel], fields: dict[str, Any], limits: RequestLimits, prefix: str = "") -> Any:
    """``model`` validated from Python values; a refusal is ``InvalidArgumentError`` naming the field
    (``prefix`` + its path; a top-level ``prompt`` or ``messages`` without the prefix)."""
    try:
        return model.model_validate(fields, context={"limits": limits})
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        path = ".".join(str(part) for part in error["loc"])
        name = path if path.split(".")[0] in ("prompt", "messages", "chat_template", "priority") else prefix + path
        raise InvalidArgumentError(name, str(error["msg"]).removeprefix("Value error, ")) from None
