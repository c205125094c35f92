"""Proto <-> domain conversions of the types every contract shares: sampling parameters,
packed logprobs, finish reasons and the engine's per-step outputs.

Servicers and clients call these; protobuf objects never travel further into the engine,
the scheduler or the model runner.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from gridserve.api.common.v1 import common_pb2
from gridserve.api.engine.v1 import engine_pb2
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.lora import LoRARequest
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.rpc.kv_convert import kv_params_from_pb, kv_params_to_pb
from gridserve.shared.rpc.tensors import pack, pack_raw, raw_bytes, unpack
from gridserve.shared.sampling_params import SamplingParams, StructuredOutputsParams
from gridserve.shared.scheduler_output import TokenLogprobs

# Fields converted by hand; every other SamplingParams field maps 1:1 onto an optional scalar.
_REPEATED_PARAMS = ("stop", "stop_token_ids", "bad_words")
_SPECIAL_PARAMS = {"logit_bias", "allowed_token_ids", "structured_outputs", "bad_words_token_ids"}

FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORTED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}
FINISH_NAME_TO_PB = {k.value: v for k, v in FINISH_TO_PB.items() if k is not None}


# ---- images ----------------------------------------------------------------------------------
def image_features_to_pb(images: list[ImageFeature]) -> list[common_pb2.ImageFeature]:
    return [common_pb2.ImageFeature(pixel_values=pack_raw(i.pixel_values, common_pb2.DTYPE_FLOAT32, i.shape),
                                    offset=i.offset, length=i.length, identifier=i.identifier)
            for i in images]


def image_features_from_pb(msgs, num_prompt_tokens: int, field: str = "mm_features") -> list[ImageFeature]:
    """The images of a request, checked: float32 pixels that fill their shape, token ranges inside
    the prompt, in order and not overlapping (``InvalidArgumentError`` naming ``field[i]``)."""
    images: list[ImageFeature] = []
    for i, msg in enumerate(msgs):
        try:
            data, shape = raw_bytes(msg.pixel_values, common_pb2.DTYPE_FLOAT32)
        except ValueError as exc:
            raise InvalidArgumentError(f"{field}[{i}].pixel_values", str(exc)) from None
        start = images[-1].end if images else 0
        if msg.length < 1 or msg.offset < start or msg.offset + msg.length > num_prompt_tokens:
            raise InvalidArgumentError(f"{field}[{i}]", f"tokens [{msg.offset}, {msg.offset + msg.length}) must be "
                                       f"non-empty, after the previous image's and inside the {num_prompt_tokens}-token prompt")
        images.append(ImageFeature(data, shape, msg.offset, msg.length, msg.identifier))
    return images


# ---- sampling parameters -------------------------------------------------------------------
def lora_request_to_pb(request: Optional[LoRARequest]) -> Optional[common_pb2.LoraRequest]:
    if request is None:
        return None
    return common_pb2.LoraRequest(lora_name=request.lora_name, lora_int_id=request.lora_int_id,
                                  lora_path=request.lora_path)


def lora_request_from_pb(msg: common_pb2.LoraRequest) -> LoRARequest:
    """A worker-bound request: every field set (the engine resolved the name)."""
    return LoRARequest(msg.lora_name, int(msg.lora_int_id), msg.lora_path)


def pooling_params_to_pb(params: PoolingParams) -> common_pb2.PoolingParams:
    msg = common_pb2.PoolingParams(task=params.task)
    for name in ("dimensions", "normalize", "activation"):
        if getattr(params, name) is not None:
            setattr(msg, name, getattr(params, name))
    return msg


def pooling_params_from_pb(msg: common_pb2.PoolingParams) -> PoolingParams:
    """Checked as it is built (``PoolingParams``: INVALID_ARGUMENT naming the field)."""
    return PoolingParams(task=msg.task or "embed",
                         **{name: getattr(msg, name) for name in ("dimensions", "normalize", "activation")
                            if msg.HasField(name)})


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name in _REPEATED_PARAMS:
            getattr(msg, f.name).extend(value)
        elif f.name not in _SPECIAL_PARAMS and value is not None:
            setattr(msg, f.name, value)
    if params.logit_bias:
        msg.logit_bias.update(params.logit_bias)
    if params.allowed_token_ids is not None:
        msg.allowed_token_ids.ids.extend(params.allowed_token_ids)
    for ids in params.bad_words_token_ids:
        msg.bad_words_token_ids.add(ids=ids)
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(_structured_to_pb(params.structured_outputs))
    return msg


def sampling_params_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take ``SamplingParams``' defaults; invalid values raise InvalidArgumentError."""
    kwargs: dict = {name: list(getattr(msg, name)) for name in _REPEATED_PARAMS}
    for f in dataclasses.fields(SamplingParams):
        if f.name not in _REPEATED_PARAMS and f.name not in _SPECIAL_PARAMS and msg.HasField(f.name):
            kwargs[f.name] = getattr(msg, f.name)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("allowed_token_ids"):
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids.ids)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = _structured_from_pb(msg.structured_outputs)
    params = SamplingParams(**kwargs)
    params.bad_words_token_ids = [list(ids.ids) for ids in msg.bad_words_token_ids]
    return params


def _structured_to_pb(so: StructuredOutputsParams) -> common_pb2.StructuredOutputsParams:
    msg = common_pb2.StructuredOutputsParams()
    if so.json is not None:
        msg.json = so.json if isinstance(so.json, str) else json.dumps(so.json)
    elif so.json_object:
        msg.json_object = True
    elif so.regex is not None:
        msg.regex = so.regex
    elif so.choice is not None:
        msg.choice.values.extend(so.choice)
    elif so.grammar is not None:
        msg.grammar = so.grammar
    return msg


def _structured_from_pb(msg: common_pb2.StructuredOutputsParams) -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return StructuredOutputsParams()  # raises: exactly one constraint must be set
    if kind == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.values))
    return StructuredOutputsParams(**{kind: getattr(msg, kind)})


# ---- logprobs --------------------------------------------------------------------------------
def logprobs_to_pb(rows: list[Optional[TokenLogprobs]]) -> common_pb2.LogprobsTensors:
    lengths, ids, values, ranks = [], [], [], []
    for row in rows:
        lengths.append(len(row.token_ids) if row is not None else 0)
        ranks.append(row.sampled_rank if row is not None else 0)
        if row is not None:
            ids.extend(row.token_ids)
            values.extend(row.logprobs)
    return common_pb2.LogprobsTensors(
        row_lengths=pack(lengths, common_pb2.DTYPE_INT32),
        token_ids=pack(ids, common_pb2.DTYPE_INT32),
        logprobs=pack(values, common_pb2.DTYPE_FLOAT32),
        sampled_ranks=pack(ranks, common_pb2.DTYPE_INT32),
    )


def logprobs_from_pb(msg: common_pb2.LogprobsTensors) -> list[Optional[TokenLogprobs]]:
    ids, values, ranks = unpack(msg.token_ids), unpack(msg.logprobs), unpack(msg.sampled_ranks)
    rows: list[Optional[TokenLogprobs]] = []
    start = 0
    for i, length in enumerate(unpack(msg.row_lengths)):
        if length == 0:
            rows.append(None)
            continue
        rows.append(TokenLogprobs(ids[start:start + length], values[start:start + length], ranks[i]))
        start += length
    return rows


# ---- engine outputs ---------------------------------------------------------------------------
def engine_output_to_pb(out: EngineCoreOutput) -> engine_pb2.EngineCoreOutput:
    msg = engine_pb2.EngineCoreOutput(
        request_id=out.request_id,
        new_token_ids=out.new_token_ids,
        finish_reason=FINISH_TO_PB[out.finish_reason],
        num_cached_tokens=out.num_cached_tokens,
        error=out.error or "",
    )
    if out.new_logprobs:
        msg.new_logprobs.CopyFrom(logprobs_to_pb(out.new_logprobs))
    if out.new_prompt_logprobs:
        msg.new_prompt_logprobs.CopyFrom(logprobs_to_pb(out.new_prompt_logprobs))
    if isinstance(out.stop_reason, int):
        msg.stop_token_id = out.stop_reason
    if out.pooler_output is not None:
        msg.pooler_output.CopyFrom(pack(out.pooler_output, common_pb2.DTYPE_FLOAT32))
    if out.kv_transfer_params is not None:
        msg.kv_transfer_params.CopyFrom(kv_params_to_pb(out.kv_transfer_params))
    return msg


def engine_output_from_pb(msg: engine_pb2.EngineCoreOutput) -> EngineCoreOutput:
    logprobs = logprobs_from_pb(msg.new_logprobs) if msg.HasField("new_logprobs") else []
    prompt_lps = logprobs_from_pb(msg.new_prompt_logprobs) if msg.HasField("new_prompt_logprobs") else []
    return EngineCoreOutput(
        request_id=msg.request_id,
        new_token_ids=list(msg.new_token_ids),
        new_logprobs=[lp for lp in logprobs if lp is not None],
        new_prompt_logprobs=[lp for lp in prompt_lps if lp is not None],
        finish_reason=FINISH_FROM_PB[msg.finish_reason],
        stop_reason=msg.stop_token_id if msg.HasField("stop_token_id") else None,
        num_cached_tokens=msg.num_cached_tokens,
        error=msg.error or None,
        pooler_output=unpack(msg.pooler_output) if msg.HasField("pooler_output") else None,
        kv_transfer_params=kv_params_from_pb(msg),
    )
