"""Disaggregated prefill / decode: the data that says where a prefilled request's KV waits.

A *producer* (prefill) engine runs a request's prompt, keeps its KV blocks referenced and hands out
``KVTransferParams`` on the request's final output: its workers' addresses, the block ids, a
transfer id, a random per-transfer token and a deadline. A *consumer* (decode) engine given them
allocates blocks for the prompt, its worker pulls the producer's blocks into them
(``worker.v1.KVTransfer.PullBlocks``) and decoding goes on from the producer's first token. The
producer's worker serves a transfer only while its engine keeps it registered (``KVSend``): until
pulled, or until the deadline passes.

A model whose KV cache plan has several groups (sliding-window layers beside full ones) moves every
group: ``block_ids`` is group 0's list, ``more_group_block_ids`` the others' (``group_block_ids``:
all of them, in group order), each the prompt's blocks in token order. A window group's list starts
with the null block (``NULL_BLOCK``, the pool's block 0) for the blocks the consumer's first step no
longer sees: those are not sent, and the consumer leaves its own blocks there untouched.

``check_pairing`` is the one compatibility check of a pairing (block size, KV dtype, model,
quantization, parallel shape): a mismatch is a ``ConfigError`` naming the field. Plain data, no
torch, no protobuf.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from gridserve.shared.errors import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
NULL_BLOCK = 0  # a block id that is not sent: out of a window group's window (the pool's null block)


@dataclass(frozen=True)
class KVTransferParams:
    """Where one request's prompt KV waits on a producer, and what the producer's cache looks like."""

    transfer_id: str
    token: str
    worker_addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    num_tokens: int
    deadline_unix_s: float
    block_size: int
    kv_cache_dtype: str
    model: str
    quantization: str = ""
    world_size: int = 1  # tensor x pipeline parallel ranks; worker_addresses has one per rank
    tensor_parallel_size: int = 1
    more_group_block_ids: tuple[tuple[int, ...], ...] = ()  # KV cache groups 1.. (block_ids: group 0)

    @property
    def expired(self) -> bool:
        return time.time() >= self.deadline_unix_s

    @property
    def group_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Every KV cache group's blocks, in group order."""
        return (tuple(self.block_ids), *self.more_group_block_ids)


@dataclass(frozen=True)
class KVSend:
    """A transfer the producer's worker serves (the engine registers it, then releases it)."""

    transfer_id: str
    token: str
    block_ids: tuple[int, ...]
    deadline_unix_s: float
    more_group_block_ids: tuple[tuple[int, ...], ...] = ()  # KV cache groups 1.. (block_ids: group 0)

    @property
    def group_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Every KV cache group's blocks, in group order."""
        return (tuple(self.block_ids), *self.more_group_block_ids)


def count_blocks(group_block_ids: Sequence[Sequence[int]]) -> int:
    """The non-null block ids over every group (a transfer's blocks sent, or a request's held)."""
    return sum(1 for ids in group_block_ids for block in ids if block != NULL_BLOCK)


@dataclass(frozen=True)
class KVLayout:
    """What a prefill and a decode engine must share for one to pull the other's KV: the cache's
    block size and dtype, the model and its quantization, the parallel shape and the number of KV
    cache groups (engine.v1 ``GetInfo``; a gateway pairs engines by it)."""

    block_size: int
    kv_cache_dtype: str
    model: str
    quantization: str = ""
    world_size: int = 1
    tensor_parallel_size: int = 1
    num_kv_cache_groups: int = 1

    def mismatch(self, consumer: KVLayout) -> Optional[str]:
        """The first field where ``consumer`` differs from this (the producer's) layout, as
        "field: prefill X, decode Y"; None when the two pair."""
        for name, mine in vars(self).items():
            theirs = getattr(consumer, name)
            if mine != theirs:
                return f"{name}: prefill {mine!r}, decode {theirs!r}"
        return None


@dataclass
class KVTransferStats:
    """A side's transfer counters since start (engine metrics and ``/v1/status``)."""

    kv_role: str = ""
    transfers_sent: int = 0  # producer: transfers fully pulled by a consumer
    transfers_expired: int = 0  # producer: transfers freed at their deadline, never pulled
    transfers_released: int = 0  # producer: transfers freed unpulled because the gateway aborted them
    transfers_received: int = 0  # consumer: pulls that succeeded
    transfers_failed: int = 0  # consumer: pulls that failed (the prompt was computed locally)
    bytes_sent: int = 0
    bytes_received: int = 0
    held_blocks: int = 0  # producer: blocks held for transfers now (every group's prompt blocks)
    transfers_held: int = 0  # producer: transfers waiting to be pulled now


def new_transfer(request_id: str) -> tuple[str, str]:
    """A fresh transfer id (readable in logs) and its secret token."""
    return f"{request_id}-{secrets.token_hex(4)}", secrets.token_urlsafe(24)


def check_pairing(params: KVTransferParams, *, block_size: int, kv_cache_dtype: str, model: str,
                  quantization: Optional[str], world_size: int, tensor_parallel_size: int = 1) -> None:
    """Refuse a producer whose cache, model or parallel shape differs from this consumer's, naming the
    field. Equal shapes pair rank by rank: a consumer's worker of rank r pulls from the producer's
    worker of rank r, which holds the same KV heads of the same layers."""
    mine = {"block_size": block_size, "kv_cache_dtype": kv_cache_dtype, "model": model,
            "quantization": quantization or "", "world_size": world_size,
            "tensor_parallel_size": tensor_parallel_size}
    theirs = {"block_size": params.block_size, "kv_cache_dtype": params.kv_cache_dtype, "model": params.model,
              "quantization": params.quantization, "world_size": params.world_size,
              "tensor_parallel_size": params.tensor_parallel_size}
    for name, value in mine.items():
        if theirs[name] != value:
            raise ConfigError(f"kv_transfer_params.{name}",
                              f"the prefill engine has {name} {theirs[name]!r}, this decode engine "
                              f"{value!r}: P/D engines must match (no re-sharding or conversion)")
    if len(params.worker_addresses) != world_size:
        raise ConfigError("kv_transfer_params.worker_addresses",
                          f"{len(params.worker_addresses)} producer workers for a parallel shape of "
                          f"{world_size} ranks")
