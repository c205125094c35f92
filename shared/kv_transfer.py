"""Disaggregated prefill / decode: the data that says where a prefilled request's KV waits.

A *producer* (prefill) engine runs a request's prompt, keeps its KV blocks referenced and hands out
``KVTransferParams`` on the request's final output: its workers' addresses, the block ids, a
transfer id, a random per-transfer token and a deadline. A *consumer* (decode) engine given them
allocates blocks for the prompt, its worker pulls the producer's blocks into them
(``worker.v1.KVTransfer.PullBlocks``) and decoding goes on from the producer's first token. The
producer's worker serves a transfer only while its engine keeps it registered (``KVSend``): until
pulled, or until the deadline passes.

``check_pairing`` is the one compatibility check of a pairing (block size, KV dtype, model,
quantization, parallel shape): a mismatch is a ``ConfigError`` naming the field. Plain data, no
torch, no protobuf.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Optional

from gridserve.shared.errors import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


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

    @property
    def expired(self) -> bool:
        return time.time() >= self.deadline_unix_s


@dataclass(frozen=True)
class KVSend:
    """A transfer the producer's worker serves (the engine registers it, then releases it)."""

    transfer_id: str
    token: str
    block_ids: tuple[int, ...]
    deadline_unix_s: float


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
    held_blocks: int = 0  # producer: blocks waiting to be pulled now
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
