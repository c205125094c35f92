"""Gateway proto <-> domain conversions: prompts in, streamed deltas and completions out."""

from __future__ import annotations

import json
from typing import Any, Optional

from gridserve.api.common.v1 import common_pb2
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.services.gateway.chat_output import ChatPlan
from gridserve.services.gateway.processor import PromptType
from gridserve.services.gateway.service import SampleDelta, StreamChunk
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.outputs import Logprob, RequestOutput
from gridserve.shared.rpc.convert import FINISH_NAME_TO_PB


def prompt_from_pb(msg: Any) -> PromptType:
    """The prompt of a ``GenerateRequest`` / ``CompleteRequest``."""
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        return msg.text
    if kind == "token_ids":
        return {"prompt_token_ids": list(msg.token_ids.ids)}
    raise InvalidArgumentError("prompt", "set either text or token_ids")


def finish_to_pb(reason: Optional[str]) -> int:
    return FINISH_NAME_TO_PB.get(reason, 0) if reason else 0


def _stop_reason(value: Any) -> str:
    return "" if value is None else str(value)


def logprobs_to_pb(positions: Optional[list[dict[int, Logprob]]]) -> list[gateway_pb2.PositionLogprobs]:
    return [
        gateway_pb2.PositionLogprobs(
            candidates=[
                gateway_pb2.TokenLogprob(
                    token_id=token_id, logprob=lp.logprob, rank=lp.rank or 0, decoded_token=lp.decoded_token or ""
                )
                for token_id, lp in position.items()
            ]
        )
        for position in positions or []
    ]


def usage_to_pb(out: RequestOutput) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=sum(len(c.token_ids) for c in out.outputs),
        cached_tokens=out.num_cached_tokens,
    )


def chunk_to_pb(chunk: StreamChunk) -> list[gateway_pb2.GenerateResponse]:
    """One message per sample that changed; usage rides on the request's last message."""
    messages = [_delta_to_pb(chunk.request_id, d) for d in chunk.deltas]
    if chunk.final is not None:
        if not messages:
            messages.append(gateway_pb2.GenerateResponse(request_id=chunk.request_id))
        messages[-1].usage.CopyFrom(usage_to_pb(chunk.final))
    return messages


def _delta_to_pb(request_id: str, delta: SampleDelta) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        request_id=request_id,
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=logprobs_to_pb(delta.logprobs),
        finish_reason=finish_to_pb(delta.finish_reason),
        stop_reason=_stop_reason(delta.stop_reason),
    )


def completion_to_pb(request_id: str, out: RequestOutput) -> gateway_pb2.CompleteResponse:
    completions = []
    for c in out.outputs:
        msg = gateway_pb2.Completion(
            index=c.index,
            text=c.text,
            token_ids=c.token_ids,
            finish_reason=finish_to_pb(c.finish_reason),
            stop_reason=_stop_reason(c.stop_reason),
            logprobs=logprobs_to_pb(c.logprobs),
        )
        if c.cumulative_logprob is not None:
            msg.cumulative_logprob = c.cumulative_logprob
        completions.append(msg)
    return gateway_pb2.CompleteResponse(
        request_id=request_id,
        prompt_token_ids=out.prompt_token_ids,
        completions=completions,
        usage=usage_to_pb(out),
    )


def chat_fields_from_pb(request: gateway_pb2.ChatRequest) -> dict[str, Any]:
    """A ``ChatRequest``'s conversation as ``ChatTemplateFields``' fields (validated by the caller)."""
    fields: dict[str, Any] = {
        "messages": [_message_from_pb(m) for m in request.messages],
        "chat_template": request.chat_template if request.HasField("chat_template") else None,
        "add_generation_prompt": request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
    }
    if request.tools:
        fields["tools"] = [_tool_from_pb(i, t) for i, t in enumerate(request.tools)]
    if request.HasField("chat_template_kwargs_json"):
        fields["chat_template_kwargs"] = _json_object(request.chat_template_kwargs_json, "chat_template_kwargs_json")
    return fields


def tool_choice_from_pb(request: gateway_pb2.ChatRequest) -> Any:
    """``tool_choice`` in the REST form: a mode, or a named function."""
    if not request.HasField("tool_choice"):
        return None
    if request.tool_choice in ("none", "auto", "required"):
        return request.tool_choice
    return {"type": "function", "function": {"name": request.tool_choice}}


def _message_from_pb(message: gateway_pb2.ChatMessage) -> dict[str, Any]:
    fields: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        fields["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                for c in message.tool_calls]
    if message.tool_call_id:
        fields["tool_call_id"] = message.tool_call_id
    if message.HasField("reasoning_content"):
        fields["reasoning_content"] = message.reasoning_content
    return fields


def _tool_from_pb(index: int, tool: gateway_pb2.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        function["parameters"] = _json_object(tool.parameters_json, f"tools[{index}].parameters_json")
    return {"type": "function", "function": function}


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(field, f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(field, "must be a JSON object")
    return value


def chat_to_pb(request_id: str, out: RequestOutput, plan: Optional[ChatPlan] = None) -> gateway_pb2.ChatResponse:
    """The first choice's reply; with a ``plan``, split into content, reasoning and tool calls."""
    first = out.outputs[0]
    message = gateway_pb2.ChatMessage(role="assistant", content=first.text)
    reason = finish_to_pb(first.finish_reason)
    parser = plan.choice() if plan is not None else None
    if parser is not None:
        parts = parser.parse(first.text)
        message.content = parts.content or ""
        message.tool_calls.extend(gateway_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                  for c in parts.tool_calls)
        if parts.reasoning is not None:
            message.reasoning_content = parts.reasoning
        if plan.finish_reason(first.finish_reason, bool(parts.tool_calls)) == "tool_calls":
            reason = common_pb2.FINISH_REASON_TOOL_CALLS
    return gateway_pb2.ChatResponse(request_id=request_id, message=message, finish_reason=reason,
                                    usage=usage_to_pb(out))
