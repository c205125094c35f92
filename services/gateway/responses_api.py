"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API over the chat path.

A request becomes a conversation — ``instructions`` as the system turn, then the conversation of
``previous_response_id`` (from the store), then the ``input`` items as chat messages: messages as
they are (``developer`` as ``system``), ``function_call`` items as an assistant turn's
``tool_calls``, ``function_call_output`` items as ``tool`` turns, a ``reasoning`` item as the next
assistant turn's ``reasoning_content`` — rendered by the chat template like a chat request. Tools
and ``tool_choice`` go through ``tool_choice.plan_tools`` and the reply through the same
``ChatPlan`` (reasoning parser, tool parser, forced calls by structured output) as on the chat
route; ``responses_events`` shapes the result as output items, whole or as events. With the store
on (``responses_store``), a response is kept with the conversation it ends, for its owner (API key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from gridserve.services.gateway.api_errors import ApiError, to_api_error
from gridserve.services.gateway.chat_output import ChatMessageParts, ChatPlan, plan_chat
from gridserve.services.gateway.protocol import AssistantToolCall, FunctionCall, SamplingFields
from gridserve.services.gateway.responses import finish_reason
from gridserve.services.gateway.responses_events import (
    ResponseEvents,
    ResponseShape,
    assistant_turn,
    item_id,
    output_items,
    status_of,
    usage_of,
)
from gridserve.services.gateway.responses_protocol import InputItem, InputPart, ResponsesRequest
from gridserve.services.gateway.responses_store import ID_PREFIX, ResponseStore
from gridserve.services.gateway.routes import (
    JSON,
    SSE,
    HttpResponse,
    OpenAIRoutes,
    answers_errors,
    engine_keywords,
    ignored_fields_header,
    log_user,
)
from gridserve.services.gateway.service import StreamChunk
from gridserve.services.gateway.tool_choice import plan_tools
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

NO_STORE = "this server keeps no responses: the gateways run without --enable-responses-store"


@dataclass
class Conversation:
    """Chat-template messages, as ``OpenAIRoutes.render_chat`` reads a chat request."""

    messages: list[dict[str, Any]]
    chat_template: Optional[str] = None
    add_generation_prompt: bool = True

    def template_messages(self) -> list[dict[str, Any]]:
        return self.messages


def input_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """The input items as chat-template messages (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    reasoning: Optional[str] = None  # a reasoning item's text, for the assistant turn after it
    for item in items:
        if item.type == "reasoning":
            reasoning = "".join(p.plain() for p in (item.content or item.summary or []) if isinstance(p, InputPart))
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif item.type == "function_call":
            call = AssistantToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call.for_template())
        else:
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _content(item.content)})
        if item.type in ("message", "function_call") and reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, None
    return messages


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p.plain() for p in content or [])


def _content(content: Any) -> Any:
    """Text (parts joined), or chat parts when there are images (the route loads them)."""
    if not isinstance(content, list) or not any(p.type == "input_image" for p in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": p.image_url}} if p.type == "input_image"
            else {"type": "text", "text": p.plain()} for p in content]


# The chat machinery's field names -> the Responses API's (its tools are flat; text.format is its
# structured output).
_RENAMED = (("sampling_params.", ""), (".function.", "."), ("structured_outputs.json", "text.format.schema"),
            ("structured_outputs", "text.format"), ("response_format", "text.format"))


@contextlib.contextmanager
def _responses_names() -> Iterator[None]:
    """Errors of the chat machinery named by the Responses API's fields (``tools[0].parameters``,
    ``tool_choice.name``, ``text.format.schema``)."""
    try:
        yield
    except InvalidArgumentError as exc:
        field = exc.field
        for old, new in _RENAMED:
            field = field.replace(old, new)
        raise InvalidArgumentError(field, exc.message) from None


class ResponsesAPI:
    """The Responses routes of one gateway, on its ``OpenAIRoutes`` (model, service, chat template);
    ``store``: None unless the gateway keeps responses."""

    def __init__(self, routes: OpenAIRoutes, store: Optional[ResponseStore] = None) -> None:
        self.routes = routes
        self.service = routes.service
        self.store = store

    @answers_errors
    async def create(self, data: bytes, owner: str = "", traceparent: str = "",
                     timeout: Optional[float] = None) -> HttpResponse:
        """``owner``: whose the response is (``responses_store.owner_of`` the call's metadata)."""
        with _responses_names():
            request = self.routes.parse_body(ResponsesRequest, data)
            lora = await self.routes.adapter_for(request.model)
            self.routes.check_generates()
            return await self._create(request, owner, traceparent, timeout, lora)

    async def _create(self, request: ResponsesRequest, owner: str, traceparent: str,
                      timeout: Optional[float], lora: Optional[str] = None) -> HttpResponse:
        keep = self._keeps(request)
        history = self._history(request.previous_response_id, owner)
        messages = history + input_messages(request.input_items())
        if not messages:
            raise InvalidArgumentError("input", "no items (give at least one message)")
        system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
        options = self.service.chat_options
        tools = plan_tools([t.as_chat_tool() for t in request.tools or []], _tool_choice(request),
                           request.parallel_tool_calls, options)
        effort = request.reasoning.effort if request.reasoning is not None else None
        variables = {"reasoning_effort": effort} if effort is not None else None
        prompt = await self.routes.render_chat(Conversation(system + messages), tools.template_tools, variables)
        plan, params = await plan_chat(self.service, options, tools, prompt["prompt_token_ids"], self._params(request))
        shape = ResponseShape(self.store.new_id() if self.store is not None else item_id("resp"),
                              lora or self.routes.model, keep, _echo(request, params))
        headers = ignored_fields_header(request.ignored_fields())
        run = (prompt, params, shape.id, traceparent, None, timeout)
        engine_kw = engine_keywords(lora, request.priority, request.cache_salt)
        if request.stream:
            stream = self.service.generate(*run, **engine_kw)
            first = await anext(stream)  # validation errors surface here, before the status is sent
            log_user(request.user or request.safety_identifier, shape.id)
            events = ResponseEvents(shape, plan.choice() if plan is not None else None)
            remember = (owner, messages) if keep else None
            return HttpResponse(200, SSE, self._events(events, stream, first, remember), headers)
        out = await self.service.complete(*run, **engine_kw)
        log_user(request.user or request.safety_identifier, shape.id)
        reply = out.outputs[0]
        parts = _split(plan, reply.text)
        status = status_of(finish_reason(reply.finish_reason))
        response = shape.response(status, output_items(parts, status), usage_of(out))
        body = response.dumps()
        if keep:
            self._keep(owner, shape.id, body, messages + [assistant_turn(parts)])
        return HttpResponse(200, JSON, [body], headers)

    @answers_errors
    async def retrieve(self, response_id: str, owner: str = "") -> HttpResponse:
        """``GET /v1/responses/{response_id}``: a response its owner stored."""
        if self.store is None:
            raise ApiError(404, f"response_id: {NO_STORE}", "response_id", "NotFoundError")
        entry = self.store.get(owner, response_id)
        if entry is None:
            raise ApiError(404, f"response_id: {self._not_found(response_id)}", "response_id", "NotFoundError")
        return HttpResponse(200, JSON, [entry.body])

    # ---- the request ------------------------------------------------------------------------
    def _keeps(self, request: ResponsesRequest) -> bool:
        """Whether this response is stored: ``store`` (default true, as OpenAI) when the store is on."""
        if request.store and self.store is None:
            raise InvalidArgumentError("store", f"{NO_STORE} (send store: false or leave it out)")
        return self.store is not None and request.store is not False

    def _history(self, response_id: Optional[str], owner: str) -> list[dict[str, Any]]:
        """The conversation ``previous_response_id`` ended (404 naming the field when not found)."""
        if response_id is None:
            return []
        if self.store is None:
            raise InvalidArgumentError("previous_response_id", NO_STORE)
        entry = self.store.get(owner, response_id)
        if entry is None:
            message = f"previous_response_id: {self._not_found(response_id)}"
            raise ApiError(404, message, "previous_response_id", "NotFoundError")
        return [dict(m) for m in entry.messages]

    def _not_found(self, response_id: str) -> str:
        where = ""
        if response_id.startswith(ID_PREFIX) and not self.store.made_here(response_id):
            where = ("; it was not made by this gateway replica (each replica keeps its own responses: "
                     "send the whole input instead)")
        return (f"no stored response {response_id!r} for this API key (unknown, expired or evicted, or "
                f"another key's){where}")

    def _params(self, request: ResponsesRequest) -> SamplingParams:
        fields = {name: getattr(request, name) for name in ("temperature", "top_p", "top_k", "logit_bias",
                                                            "skip_special_tokens")}
        sampling = SamplingFields.model_construct(**fields)
        params = sampling.to_sampling_params(request.max_output_tokens, None, self.routes.sampling_defaults)
        return dataclasses.replace(params, structured_outputs=_structured(request))

    def _keep(self, owner: str, response_id: str, body: bytes, messages: list[dict[str, Any]]) -> None:
        size = len(body) + len(json.dumps(messages))
        self.store.put(owner, response_id, body, messages, size)

    # ---- streaming --------------------------------------------------------------------------
    async def _events(self, events: ResponseEvents, stream: AsyncIterator[StreamChunk], first: StreamChunk,
                      remember: Optional[tuple[str, list[dict[str, Any]]]]) -> AsyncIterator[bytes]:
        """The events of the reply; the response is stored once it completed (``remember``: its
        owner and the conversation before it)."""
        try:
            for event in events.start():
                yield event
            reason, final, chunk = None, None, first
            while chunk is not None:
                for delta in chunk.deltas:
                    for event in events.feed(delta.text) if delta.text else []:
                        yield event
                    reason = delta.finish_reason or reason
                final = chunk.final or final
                chunk = await anext(stream, None)
            for event in events.finish(finish_reason(reason), final):
                yield event
            if remember is not None:
                owner, messages = remember
                self._keep(owner, events.shape.id, events.final.dumps(), messages + [assistant_turn(events.parts())])
        except Exception as exc:  # noqa: BLE001 - a failure after the start is reported in-band
            error = to_api_error(exc)
            for event in events.failed(str(error.status), error.message, error.param):
                yield event
        finally:
            await stream.aclose()


def _tool_choice(request: ResponsesRequest) -> Any:
    """``tool_choice`` in the chat shape ``plan_tools`` reads."""
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _structured(request: ResponsesRequest) -> Optional[StructuredOutputsParams]:
    """``text.format`` as structured output."""
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=fmt.json_schema)


def _split(plan: Optional[ChatPlan], text: str) -> ChatMessageParts:
    parser = plan.choice() if plan is not None else None
    return parser.parse(text) if parser is not None else ChatMessageParts(content=text)


def _echo(request: ResponsesRequest, params: SamplingParams) -> dict[str, Any]:
    """The request's settings every response object repeats."""
    echo: dict[str, Any] = {
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "previous_response_id": request.previous_response_id, "temperature": params.temperature,
        "top_p": params.top_p, "user": request.user, "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
        "tool_choice": _choice_echo(request),
    }
    if request.reasoning is not None:
        echo["reasoning"] = {"effort": request.reasoning.effort, "summary": None}
    if request.text is not None and request.text.format is not None:
        echo["text"] = {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)}
    return echo


def _choice_echo(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()
