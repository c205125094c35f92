"""The Responses API (``POST /v1/responses``), declared: its request, input items, response object
and stream events as pydantic models, with the rules of ``protocol.py``.

The request is closed: an unknown top-level field is refused ("unrecognized request argument
supplied"), and a field of OpenAI's API this server cannot honour with the value sent is refused
naming it. Input items are what agent clients send back (earlier outputs, with keys of their own):
an unknown key inside one is ignored and named in the ``x-gridserve-ignored-fields`` header; an
item type this server does not serve (``web_search_call``, ``item_reference``, ...) is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, Field, model_validator

from gridserve.services.gateway.protocol import (
    INT32_MAX,
    UINT32_MAX,
    CacheSalt,
    ClosedModel,
    Priority,
    ResponseModel,
    TolerantModel,
    Unsupported,
    _chars,
    _metadata,
    _refuse_true,
    capped,
    unsupported,
)
from gridserve.shared.errors import InvalidArgumentError

InputText = Annotated[str, capped("max_content_chars", what="characters")]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text", "input_image", "refusal", "reasoning_text", "summary_text")


def _no_annotations(value: Optional[list[Any]]) -> Optional[list[Any]]:
    if value:
        raise ValueError("annotations (citations) are not used by this server; send an empty list")
    return value


class InputPart(TolerantModel):
    """One part of an input item's content: text (``input_text``, an echoed ``output_text``),
    an image (``input_image``, a vision-language model's), a refusal or reasoning text."""

    type: str
    text: Optional[InputText] = None
    image_url: Optional[str] = None
    detail: Optional[str] = None
    refusal: Optional[InputText] = None
    annotations: Annotated[Optional[list[Any]], AfterValidator(_no_annotations)] = None
    logprobs: Optional[list[Any]] = None  # an echoed output's: not used

    @model_validator(mode="after")
    def _served(self) -> InputPart:
        if self.type not in PART_TYPES:
            raise ValueError(f"{self.type!r} parts are not served (one of {', '.join(PART_TYPES)})")
        if self.type == "input_image" and not self.image_url:
            raise ValueError("an input_image part needs image_url (a URL or data: URL; file_id is not served)")
        if self.type != "input_image" and self.type != "refusal" and self.text is None:
            raise ValueError(f"a {self.type} part needs text")
        return self

    def plain(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


Content = Annotated[Union[str, list[InputPart], None],
                    capped("max_messages", lambda c: 0 if isinstance(c, (str, type(None))) else len(c), "parts")]


class InputItem(TolerantModel):
    """One item of ``input``: a message (``type`` may be left out), an earlier ``function_call``,
    its ``function_call_output``, or an earlier ``reasoning`` item."""

    type: str = "message"
    role: Optional[Literal["user", "assistant", "system", "developer"]] = None
    content: Content = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[InputText] = None
    output: Union[InputText, list[InputPart], None] = None
    summary: Optional[list[InputPart]] = None
    id: Optional[str] = None  # an echoed item's id and status: not used
    status: Optional[str] = None
    encrypted_content: Annotated[Unsupported, unsupported("encrypted reasoning is not served")] = None

    @model_validator(mode="after")
    def _complete(self) -> InputItem:
        needs = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                 "function_call_output": ("call_id", "output"), "reasoning": ()}
        if self.type not in needs:
            raise ValueError(f"{self.type!r} items are not served (one of {', '.join(ITEM_TYPES)})")
        missing = [name for name in needs[self.type] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {', '.join(missing)}")
        return self


class FunctionTool(ClosedModel):
    """A function tool, in the Responses API's flat shape."""

    type: str
    name: Annotated[str, Field(min_length=1)]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "function":
            raise ValueError(f"only function tools are served, not {kind!r} (no hosted tools)")
        return data

    def as_chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": function}


class NamedFunctionChoice(ClosedModel):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


class ReasoningConfig(ClosedModel):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None  # to the template
    summary: Annotated[Unsupported, unsupported("reasoning summaries are not made")] = None
    generate_summary: Annotated[Unsupported, unsupported("reasoning summaries are not made")] = None


class TextFormat(ClosedModel):
    """``text.format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Annotated[Optional[dict[str, Any]], Field(alias="schema"),
                           capped("max_structured_output_chars", _chars, "characters of schema")] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs schema")
        return self


class TextConfig(ClosedModel):
    format: Optional[TextFormat] = None
    verbosity: Annotated[Unsupported, unsupported("not offered by this server's models")] = None


class ResponsesStreamOptions(ClosedModel):
    include_obfuscation: Annotated[Optional[bool], AfterValidator(
        lambda v: _refuse_true(v, "stream obfuscation is not offered (send false or leave it out)"))] = None


def _nothing_to_include(value: Optional[list[str]]) -> Optional[list[str]]:
    if value:
        raise ValueError(f"{value[0]!r}: nothing extra is included by this server (send an empty list)")
    return value


def _token_id_keys(bias: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
    for key in bias or {}:
        if not key.isdigit() or int(key) > INT32_MAX:
            raise ValueError(f"keys must be token ids (integers in [0, {INT32_MAX}]), got {key!r}")
    return bias


def _no_logprobs(value: Optional[int]) -> Optional[int]:
    if value:
        raise ValueError("logprobs are not returned by /v1/responses here (use /v1/chat/completions)")
    return value


def _no_auto_truncation(value: Optional[str]) -> Optional[str]:
    if value == "auto":
        raise ValueError('"auto" (dropping earlier input to fit) is not served: send "disabled"')
    return value


class ResponsesRequest(ClosedModel):
    """``POST /v1/responses``."""

    model: Optional[str] = None
    input: Annotated[Union[InputText, list[InputItem]], capped("max_messages", lambda i: 0 if isinstance(i, str)
                                                               else len(i), "input items")]
    instructions: Optional[InputText] = None
    previous_response_id: Annotated[Optional[str], Field(max_length=256)] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1, le=UINT32_MAX)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=1e6)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    tools: Annotated[Optional[list[FunctionTool]], capped("max_messages", what="tools")] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedFunctionChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    store: Optional[bool] = None  # default: stored when the server keeps responses
    stream: bool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    metadata: Annotated[Optional[dict[str, str]], AfterValidator(_metadata)] = None  # echoed and stored
    user: Annotated[Optional[str], Field(max_length=256)] = None  # logged
    safety_identifier: Annotated[Optional[str], Field(max_length=256)] = None  # logged
    prompt_cache_key: Annotated[Optional[str], Field(max_length=1024)] = None  # prefix caching is automatic
    service_tier: Optional[Literal["auto", "default"]] = None
    truncation: Annotated[Optional[Literal["auto", "disabled"]], AfterValidator(_no_auto_truncation)] = None
    include: Annotated[Optional[list[str]], AfterValidator(_nothing_to_include)] = None
    top_logprobs: Annotated[Optional[Annotated[int, Field(ge=0, le=20)]], AfterValidator(_no_logprobs)] = None
    background: Annotated[Optional[bool], AfterValidator(
        lambda v: _refuse_true(v, "background responses are not served"))] = None
    max_tool_calls: Annotated[Unsupported, unsupported("not enforced by this server")] = None
    conversation: Annotated[Unsupported, unsupported("conversations are not stored: send previous_response_id "
                                                     "(with --enable-responses-store) or the whole input")] = None
    prompt: Annotated[Unsupported, unsupported("prompt templates are not served")] = None
    prompt_cache_retention: Annotated[Unsupported, unsupported("prefix caching is automatic, not configurable")] = None
    # vLLM's extensions
    top_k: Optional[Annotated[int, Field(ge=-1, le=INT32_MAX)]] = None
    logit_bias: Annotated[Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]],
                          AfterValidator(_token_id_keys), capped("max_logit_bias", what="entries")] = None
    skip_special_tokens: Optional[bool] = None
    priority: Priority = 0
    cache_salt: Optional[CacheSalt] = None

    @model_validator(mode="after")
    def _stream_only(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:  # across fields: the error names the one
            raise InvalidArgumentError("stream_options", "only with stream: true")
        return self

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [InputItem(role="user", content=self.input)]
        return self.input

    def ignored_fields(self) -> list[str]:
        """The unknown keys of the input items and their parts, as paths (``input[1].foo``)."""
        found = []
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            found += [f"input[{i}].{key}" for key in item.model_extra or {}]
            for name in ("content", "output", "summary"):
                parts = getattr(item, name)
                for j, part in enumerate(parts if isinstance(parts, list) else []):
                    found += [f"input[{i}].{name}[{j}].{key}" for key in part.model_extra or {}]
        return found


# ---- the response object ---------------------------------------------------------------------
class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningItem(ResponseModel):
    """The reasoning of the reply (with ``--reasoning-parser``), as text; no summaries."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallItem(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[ReasoningItem, OutputMessage, FunctionCallItem]


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(ResponseModel):
    code: str
    message: str


class ResponseObject(ResponseModel):
    """OpenAI's response object (``GET /v1/responses/{id}`` answers the same)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: Optional[ResponseErrorInfo] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool
    temperature: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_p: Optional[float] = None
    truncation: Literal["disabled"] = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseStreamEvent(ResponseModel):
    """One server-sent event of a streamed response (``event: <type>``); only the fields its type
    has are written (OpenAI's event shapes)."""

    model_config = {"extra": "allow"}

    type: str
    sequence_number: int
