"""protobuf <-> the disaggregated-serving data (``shared.kv_transfer``): ``KVTransferParams`` (engine
and worker protos), ``KVSend`` (the step plan) and ``KVTransferStats`` (``KVTransferCounters``: the
engine's load report and the gateway's status). KV cache groups 1.. travel in
``more_group_block_ids`` (``block_ids`` is group 0's)."""

from __future__ import annotations

from typing import Optional

from gridserve.api.common.v1 import common_pb2
from gridserve.api.worker.v1 import worker_pb2
from gridserve.shared.kv_transfer import KVLayout, KVSend, KVTransferParams, KVTransferStats


def kv_params_to_pb(params: Optional[KVTransferParams]) -> Optional[common_pb2.KVTransferParams]:
    if params is None:
        return None
    return common_pb2.KVTransferParams(
        transfer_id=params.transfer_id, token=params.token, worker_addresses=list(params.worker_addresses),
        block_ids=list(params.block_ids), num_tokens=params.num_tokens, deadline_unix_s=params.deadline_unix_s,
        block_size=params.block_size, kv_cache_dtype=params.kv_cache_dtype, model=params.model,
        quantization=params.quantization, world_size=params.world_size,
        tensor_parallel_size=params.tensor_parallel_size,
        more_group_block_ids=[common_pb2.BlockIdList(ids=g) for g in params.more_group_block_ids])


def kv_params_from_pb(msg, field: str = "kv_transfer_params") -> Optional[KVTransferParams]:
    """The params in ``msg.<field>``; None when the field is unset."""
    if not msg.HasField(field):
        return None
    m = getattr(msg, field)
    return KVTransferParams(
        transfer_id=m.transfer_id, token=m.token, worker_addresses=tuple(m.worker_addresses),
        block_ids=tuple(m.block_ids), num_tokens=m.num_tokens, deadline_unix_s=m.deadline_unix_s,
        block_size=m.block_size, kv_cache_dtype=m.kv_cache_dtype, model=m.model, quantization=m.quantization,
        world_size=m.world_size or 1, tensor_parallel_size=m.tensor_parallel_size or 1,
        more_group_block_ids=tuple(tuple(g.ids) for g in m.more_group_block_ids))


def kv_send_to_pb(send: KVSend) -> worker_pb2.KVSend:
    more = [worker_pb2.BlockIds(ids=ids) for ids in send.more_group_block_ids]
    return worker_pb2.KVSend(transfer_id=send.transfer_id, token=send.token, block_ids=list(send.block_ids),
                             deadline_unix_s=send.deadline_unix_s, more_group_block_ids=more)


def kv_send_from_pb(msg: worker_pb2.KVSend) -> KVSend:
    return KVSend(msg.transfer_id, msg.token, tuple(msg.block_ids), msg.deadline_unix_s,
                  tuple(tuple(g.ids) for g in msg.more_group_block_ids))


def kv_stats_to_pb(stats: Optional[KVTransferStats]) -> Optional[common_pb2.KVTransferCounters]:
    if stats is None:
        return None
    return common_pb2.KVTransferCounters(**vars(stats))


def kv_stats_from_pb(msg, field: str = "kv_transfers") -> Optional[KVTransferStats]:
    """The counters in ``msg.<field>``; None when the field is unset."""
    if not msg.HasField(field):
        return None
    m = getattr(msg, field)
    return KVTransferStats(**{name: getattr(m, name) for name in vars(KVTransferStats())})


def kv_layout_to_pb(layout: Optional[KVLayout]) -> Optional[common_pb2.KVLayout]:
    return None if layout is None else common_pb2.KVLayout(**vars(layout))


def kv_layout_from_pb(msg, field: str = "kv_layout") -> Optional[KVLayout]:
    """The layout in ``msg.<field>``; None when the field is unset."""
    if not msg.HasField(field):
        return None
    m = getattr(msg, field)
    return KVLayout(**{name: getattr(m, name) for name in KVLayout.__dataclass_fields__})
