"""Proto <-> domain conversions of the engine <-> worker contract: the configuration, the
scheduler's step plan and the model runner's samples. Used by ``GrpcExecutor`` and the worker
servicer (both import only this module, never each other)."""

from __future__ import annotations

import dataclasses
import json

from gridserve.api.common.v1 import common_pb2
from gridserve.api.worker.v1 import worker_pb2
from gridserve.shared import config as cfg
from gridserve.shared.kv_cache_spec import FULL, KVCacheConfig, KVCacheGroup, LayerKVCacheSpec
from gridserve.shared.rpc.convert import (
    image_features_from_pb,
    image_features_to_pb,
    logprobs_from_pb,
    logprobs_to_pb,
    lora_request_from_pb,
    lora_request_to_pb,
    pooling_params_from_pb,
    pooling_params_to_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
)
from gridserve.shared.rpc.kv_convert import (
    kv_params_from_pb,
    kv_params_to_pb,
    kv_send_from_pb,
    kv_send_to_pb,
)
from gridserve.shared.rpc.tensors import pack, unpack
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

_SECTIONS = {
    "model": (cfg.ModelConfig, worker_pb2.ModelConfig),
    "cache": (cfg.CacheConfig, worker_pb2.CacheConfig),
    "scheduler": (cfg.SchedulerConfig, worker_pb2.SchedulerConfig),
    "parallel": (cfg.ParallelConfig, worker_pb2.ParallelConfig),
    "device": (cfg.DeviceConfig, worker_pb2.DeviceConfig),
    "lora": (cfg.LoRAConfig, worker_pb2.LoRAConfig),
}


# ---- configuration ----------------------------------------------------------------------------
def config_to_pb(config: cfg.GridserveConfig) -> worker_pb2.GridserveConfig:
    msg = worker_pb2.GridserveConfig()
    for name in _SECTIONS:
        section, section_msg = getattr(config, name), getattr(msg, name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, dict):  # free-form JSON objects travel as text
                setattr(section_msg, f"{f.name}_json", json.dumps(value))
            elif isinstance(value, list):
                getattr(section_msg, f.name).extend(value)
            elif value is not None:
                setattr(section_msg, f.name, value)
    return msg


def config_from_pb(msg: worker_pb2.GridserveConfig) -> cfg.GridserveConfig:
    sections = {}
    for name, (klass, _) in _SECTIONS.items():
        section_msg = getattr(msg, name)
        kwargs = {}
        for f in dataclasses.fields(klass):
            if f"{f.name}_json" in section_msg.DESCRIPTOR.fields_by_name:
                kwargs[f.name] = json.loads(getattr(section_msg, f"{f.name}_json") or "{}")
            elif _is_repeated(section_msg, f.name):
                kwargs[f.name] = list(getattr(section_msg, f.name))
            elif not _has_presence(section_msg, f.name) or section_msg.HasField(f.name):
                kwargs[f.name] = getattr(section_msg, f.name)
            else:
                kwargs[f.name] = None
        sections[name] = klass(**kwargs)
    return cfg.GridserveConfig(**sections)


def _is_repeated(msg, field_name: str) -> bool:
    return msg.DESCRIPTOR.fields_by_name[field_name].is_repeated


def _has_presence(msg, field_name: str) -> bool:
    return msg.DESCRIPTOR.fields_by_name[field_name].has_presence


# ---- KV cache spec and plan ---------------------------------------------------------------------
def kv_cache_spec_to_pb(specs: list[LayerKVCacheSpec]) -> worker_pb2.KVCacheSpec:
    return worker_pb2.KVCacheSpec(layers=[worker_pb2.LayerKVCacheSpec(**dataclasses.asdict(s)) for s in specs])


def kv_cache_spec_from_pb(msg: worker_pb2.KVCacheSpec) -> list[LayerKVCacheSpec]:
    names = [f.name for f in dataclasses.fields(LayerKVCacheSpec)]
    return [LayerKVCacheSpec(**{n: getattr(layer, n) for n in names}) for layer in msg.layers]


def kv_cache_config_to_pb(config: KVCacheConfig) -> worker_pb2.InitializeCacheArgs:
    return worker_pb2.InitializeCacheArgs(
        num_blocks=config.num_blocks,
        groups=[worker_pb2.KVCacheGroup(kind=g.kind, sliding_window=g.sliding_window, layer_names=g.layer_names)
                for g in config.groups],
    )


def kv_cache_config_from_pb(msg: worker_pb2.InitializeCacheArgs, block_size: int) -> KVCacheConfig:
    """The plan; without groups (an older engine), every layer in one full-attention group."""
    groups = tuple(KVCacheGroup(g.kind, tuple(g.layer_names), g.sliding_window) for g in msg.groups)
    return KVCacheConfig(msg.num_blocks, block_size, groups or (KVCacheGroup(FULL, ()),))


# ---- scheduler output ---------------------------------------------------------------------------
def scheduler_output_to_pb(out: SchedulerOutput) -> worker_pb2.SchedulerOutput:
    return worker_pb2.SchedulerOutput(
        scheduled_new_reqs=[
            worker_pb2.NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=r.prompt_token_ids,
                # one of the two (a oneof): a pooling request samples nothing
                sampling_params=sampling_params_to_pb(r.sampling_params) if r.pooling_params is None else None,
                block_ids=r.block_ids[0],
                num_computed_tokens=r.num_computed_tokens,
                output_token_ids=r.output_token_ids,
                traceparent=r.traceparent,
                mm_features=image_features_to_pb(r.mm_features),
                more_group_block_ids=[worker_pb2.BlockIds(ids=ids) for ids in r.block_ids[1:]],
                lora_request=lora_request_to_pb(r.lora_request),
                pooling_params=pooling_params_to_pb(r.pooling_params) if r.pooling_params is not None else None,
                token_type_ids=r.token_type_ids or [],
                kv_load=kv_params_to_pb(r.kv_load),
            )
            for r in out.scheduled_new_reqs
        ],
        scheduled_cached_reqs=[
            worker_pb2.CachedRequestData(
                req_id=r.req_id, new_block_ids=r.new_block_ids[0], num_computed_tokens=r.num_computed_tokens,
                new_token_ids=r.new_token_ids,
                more_group_new_block_ids=[worker_pb2.BlockIds(ids=ids) for ids in r.new_block_ids[1:]],
            )
            for r in out.scheduled_cached_reqs
        ],
        num_scheduled_tokens=out.num_scheduled_tokens,
        total_num_scheduled_tokens=out.total_num_scheduled_tokens,
        finished_req_ids=sorted(out.finished_req_ids),
        scheduled_spec_tokens={r: worker_pb2.TokenIds(ids=ids) for r, ids in out.scheduled_spec_tokens.items()},
        kv_sends=[kv_send_to_pb(s) for s in out.kv_sends],
        kv_releases=out.kv_releases,
    )


def scheduler_output_from_pb(msg: worker_pb2.SchedulerOutput) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=(SamplingParams(max_tokens=1) if r.HasField("pooling_params")
                                 else sampling_params_from_pb(r.sampling_params)),
                block_ids=(list(r.block_ids), *(list(g.ids) for g in r.more_group_block_ids)),
                num_computed_tokens=r.num_computed_tokens,
                output_token_ids=list(r.output_token_ids),
                traceparent=r.traceparent,
                mm_features=image_features_from_pb(r.mm_features, len(r.prompt_token_ids)),
                lora_request=lora_request_from_pb(r.lora_request) if r.HasField("lora_request") else None,
                pooling_params=pooling_params_from_pb(r.pooling_params) if r.HasField("pooling_params") else None,
                token_type_ids=list(r.token_type_ids) or None,
                kv_load=kv_params_from_pb(r, "kv_load"),
            )
            for r in msg.scheduled_new_reqs
        ],
        scheduled_cached_reqs=[
            CachedRequestData(r.req_id, (list(r.new_block_ids), *(list(g.ids) for g in r.more_group_new_block_ids)),
                              r.num_computed_tokens, list(r.new_token_ids))
            for r in msg.scheduled_cached_reqs
        ],
        num_scheduled_tokens=_in_plan_order(msg),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids),
        scheduled_spec_tokens={r: list(t.ids) for r, t in msg.scheduled_spec_tokens.items()},
        kv_sends=[kv_send_from_pb(s) for s in msg.kv_sends],
        kv_releases=list(msg.kv_releases),
    )


def _in_plan_order(msg: worker_pb2.SchedulerOutput) -> dict[str, int]:
    """``num_scheduled_tokens`` in the scheduler's order (running, then new requests).

    A protobuf map has no order (it differs between processes), but every tensor-parallel rank
    must pack the batch, and pair the driver's samples with requests, in the same order.
    """
    counts = dict(msg.num_scheduled_tokens)
    ordered = [r.req_id for r in msg.scheduled_cached_reqs] + [r.req_id for r in msg.scheduled_new_reqs]
    plan = {req_id: counts.pop(req_id) for req_id in ordered if req_id in counts}
    plan.update(sorted(counts.items()))
    return plan


# ---- model runner output ------------------------------------------------------------------------
def runner_output_to_pb(out: ModelRunnerOutput) -> worker_pb2.ModelRunnerOutput:
    msg = worker_pb2.ModelRunnerOutput(
        req_ids=out.req_ids, sampled_token_ids=pack(out.sampled_token_ids, common_pb2.DTYPE_INT32)
    )
    if any(lp is not None for lp in out.logprobs):
        msg.logprobs.CopyFrom(logprobs_to_pb(out.logprobs))
    for req_id, rows in out.prompt_logprobs.items():
        msg.prompt_logprobs[req_id].CopyFrom(logprobs_to_pb(rows))
    msg.failed.update(out.failed)
    for req_id, ids in out.extra_token_ids.items():
        msg.extra_token_ids[req_id].ids.extend(ids)
    for req_id, rows in out.extra_logprobs.items():
        msg.extra_logprobs[req_id].CopyFrom(logprobs_to_pb(rows))
    for req_id, ids in out.draft_token_ids.items():
        msg.draft_token_ids[req_id].ids.extend(ids)
    for req_id, values in out.pooler_output.items():
        msg.pooler_output[req_id].CopyFrom(pack(values, common_pb2.DTYPE_FLOAT32))
    msg.kv_sent.extend(out.kv_sent)
    msg.kv_load_failed.update(out.kv_load_failed)
    msg.kv_bytes_received, msg.kv_bytes_sent = out.kv_bytes_received, out.kv_bytes_sent
    return msg


def runner_output_from_pb(msg: worker_pb2.ModelRunnerOutput) -> ModelRunnerOutput:
    req_ids = list(msg.req_ids)
    logprobs = logprobs_from_pb(msg.logprobs) if msg.HasField("logprobs") else [None] * len(req_ids)
    prompt_logprobs = {req_id: logprobs_from_pb(rows) for req_id, rows in msg.prompt_logprobs.items()}
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=unpack(msg.sampled_token_ids),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        failed=dict(msg.failed),
        extra_token_ids={r: list(t.ids) for r, t in msg.extra_token_ids.items()},
        extra_logprobs={r: logprobs_from_pb(rows) for r, rows in msg.extra_logprobs.items()},
        draft_token_ids={r: list(t.ids) for r, t in msg.draft_token_ids.items()},
        pooler_output={r: unpack(t) for r, t in msg.pooler_output.items()},
        kv_sent=list(msg.kv_sent),
        kv_load_failed=dict(msg.kv_load_failed),
        kv_bytes_received=msg.kv_bytes_received,
        kv_bytes_sent=msg.kv_bytes_sent,
    )
