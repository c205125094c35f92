"""Gateway proto <-> domain conversions: prompts in, streamed deltas and completions out."""

from __future__ import annotations

from typing import Any, Optional

from gridserve.api.gateway.v1 import gateway_pb2
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


def chat_to_pb(request_id: str, out: RequestOutput) -> gateway_pb2.ChatResponse:
    first = out.outputs[0]
    return gateway_pb2.ChatResponse(
        request_id=request_id,
        message=gateway_pb2.ChatMessage(role="assistant", content=first.text),
        finish_reason=finish_to_pb(first.finish_reason),
        usage=usage_to_pb(out),
    )
