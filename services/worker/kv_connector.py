"""KV connectors: how a worker moves a prefilled request's KV blocks between engines (P/D).

``KVConnector`` is the contract, two sides in one object since a ``kv_both`` worker is both:

* send side (a producer's worker): ``register(send)`` makes a transfer's blocks available until
  ``release(transfer_id)``; ``serve(transfer_id, token)`` yields them chunk by chunk to a puller;
  ``take_sent()`` hands the engine the transfers fully pulled since it last asked (it frees them).
* receive side (a consumer's worker): ``pull(params, block_ids)`` writes the producer's blocks into
  this worker's ``block_ids`` and returns the bytes received, or raises ``KVTransferError``.

Both sides read and write the worker's KV cache through ``KVCacheView`` (the tensors the model
runner allocated, indexed by block along each tensor's block dimension). ``GrpcKVConnector`` is
the implementation over ``worker.v1.KVTransfer`` (``kv_transfer.py``: the server and the step
hook); a shared-memory or RDMA connector would implement the same four methods.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch

from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.shared.kv_transfer import KVSend, KVTransferParams
from gridserve.shared.rpc.client import make_channel
from gridserve.shared.rpc.tensors import pack_raw

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20  # well under the 64 MiB message limit
MAX_PULL_S = 60.0  # a pull's deadline when the transfer's own is further away
# A consumer may ask before the producer's workers heard of the transfer (it goes out with the
# producer's next step plan, right after the output that named it): NOT_FOUND is retried this long.
NOT_YET_S, RETRY_S = 1.0, 0.02

_TO_PB = {torch.float32: 3, torch.float16: 4, torch.bfloat16: 5}  # common.v1.Dtype values
_UINT8 = 6  # DTYPE_UINT8: fp8 caches travel as their bytes


class KVTransferError(RuntimeError):
    """A pull that failed: the consumer computes the prompt itself."""


class TransferNotFound(KeyError):
    """No such transfer (unknown, released or expired): NOT_FOUND."""


class TransferRefused(PermissionError):
    """A wrong token for the transfer: PERMISSION_DENIED."""


@dataclass(frozen=True)
class Chunk:
    """One layer's KV for a run of a transfer's blocks, as raw little-endian bytes."""

    layer_index: int
    num_layers: int
    first_block: int
    dtype: int
    shape: tuple[int, ...]
    data: bytes

    @property
    def crc32(self) -> int:
        return zlib.crc32(self.data)


class KVCacheView:
    """The worker's KV tensors by block: a tensor of 5 dims ``[2, blocks, ...]`` (K and V) has its
    blocks on dim 1, a latent cache ``[blocks, ...]`` on dim 0."""

    def __init__(self, tensors: Callable[[], Sequence[torch.Tensor]]) -> None:
        self._tensors = tensors

    @property
    def tensors(self) -> Sequence[torch.Tensor]:
        return self._tensors()

    @staticmethod
    def block_dim(tensor: torch.Tensor) -> int:
        return 1 if tensor.dim() == 5 else 0

    def read(self, layer: int, block_ids: Sequence[int]) -> tuple[int, tuple[int, ...], bytes]:
        tensor = self.tensors[layer]
        index = torch.tensor(list(block_ids), dtype=torch.long, device=tensor.device)
        part = tensor.index_select(self.block_dim(tensor), index).contiguous().cpu()
        dtype = _TO_PB.get(part.dtype, _UINT8)
        return dtype, tuple(part.shape), part.view(torch.uint8).numpy().tobytes()

    def write(self, layer: int, block_ids: Sequence[int], chunk: Chunk) -> None:
        tensor = self.tensors[layer]
        dim = self.block_dim(tensor)
        expected = list(tensor.shape)
        expected[dim] = len(block_ids)
        if list(chunk.shape) != expected or chunk.dtype != _TO_PB.get(tensor.dtype, _UINT8):
            raise KVTransferError(f"layer {layer}: the producer sent shape {list(chunk.shape)} dtype {chunk.dtype}, "
                                  f"this cache needs {expected} dtype {_TO_PB.get(tensor.dtype, _UINT8)}")
        raw = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
        values = raw.view(tensor.dtype).reshape(chunk.shape).to(tensor.device)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=tensor.device)
        tensor.index_copy_(dim, index, values)

    def blocks_per_chunk(self, layer: int, limit: int = CHUNK_BYTES) -> int:
        tensor = self.tensors[layer]
        per_block = tensor.element_size() * tensor.numel() // max(tensor.shape[self.block_dim(tensor)], 1)
        return max(1, limit // max(per_block, 1))


class KVConnector(ABC):
    """Moves KV blocks between a producer's and a consumer's workers (see the module docstring)."""

    @abstractmethod
    def register(self, send: KVSend) -> None:
        """Serve ``send``'s blocks from now on (until released or past its deadline)."""

    @abstractmethod
    def release(self, transfer_id: str) -> None:
        """Stop serving a transfer (its blocks are about to be reused); unknown ids are ignored."""

    @abstractmethod
    def serve(self, transfer_id: str, token: str, release: bool) -> Iterator[Chunk]:
        """The transfer's blocks, chunk by chunk; ``TransferRefused`` / ``TransferNotFound``."""

    @abstractmethod
    def take_sent(self) -> tuple[list[str], int]:
        """Transfers fully pulled since the last call, and the bytes served."""

    @abstractmethod
    def pull(self, params: KVTransferParams, block_ids: Sequence[int], rank: int = 0) -> int:
        """Write the producer's blocks into ``block_ids`` (same order) from the producer's worker of
        ``rank`` (this worker's own rank: the same shard); the bytes received."""


class GrpcKVConnector(KVConnector):
    """Blocks over ``worker.v1.KVTransfer.PullBlocks``: one stream per transfer (mutual TLS with the
    worker's certificate when configured), a CRC-32 per chunk, every (layer, block) checked in."""

    def __init__(self, view: KVCacheView, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.view = view
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()  # the registry vs the worker thread's releases
        self._sends: dict[str, KVSend] = {}
        self._sent: list[str] = []
        self._bytes_sent = 0
        self._channels: dict[str, grpc.Channel] = {}

    # ---- send side --------------------------------------------------------------------------------
    def register(self, send: KVSend) -> None:
        with self._lock:
            self._sends[send.transfer_id] = send

    def release(self, transfer_id: str) -> None:
        with self._lock:
            self._sends.pop(transfer_id, None)

    @property
    def num_registered(self) -> int:
        with self._lock:
            return len(self._sends)

    def _live(self, transfer_id: str) -> KVSend:
        send = self._sends.get(transfer_id)
        if send is None or time.time() >= send.deadline_unix_s:
            raise TransferNotFound(f"transfer {transfer_id!r} is unknown, released or expired")
        return send

    def serve(self, transfer_id: str, token: str, release: bool) -> Iterator[Chunk]:
        with self._lock:
            send = self._live(transfer_id)
            if not hmac.compare_digest(send.token.encode(), token.encode()):
                raise TransferRefused(f"wrong token for transfer {transfer_id!r}")
        num_layers = len(self.view.tensors)
        for layer in range(num_layers):
            step = self.view.blocks_per_chunk(layer, self.chunk_bytes)
            for first in range(0, len(send.block_ids), step):
                with self._lock:  # a released transfer's blocks may already hold another request's KV
                    self._live(transfer_id)
                    dtype, shape, data = self.view.read(layer, send.block_ids[first:first + step])
                    self._bytes_sent += len(data)
                yield Chunk(layer, num_layers, first, dtype, shape, data)
        with self._lock:
            if release and self._sends.pop(transfer_id, None) is not None:
                self._sent.append(transfer_id)

    def take_sent(self) -> tuple[list[str], int]:
        with self._lock:
            sent, self._sent = self._sent, []
            sent_bytes, self._bytes_sent = self._bytes_sent, 0
        return sent, sent_bytes

    # ---- receive side ------------------------------------------------------------------------------
    def pull(self, params: KVTransferParams, block_ids: Sequence[int], rank: int = 0) -> int:
        if len(block_ids) != len(params.block_ids):
            raise KVTransferError(f"{len(params.block_ids)} producer blocks for {len(block_ids)} local ones")
        if not 0 <= rank < len(params.worker_addresses):
            raise KVTransferError(f"kv_transfer_params names {len(params.worker_addresses)} producer workers, "
                                  f"none of rank {rank}")
        address = params.worker_addresses[rank]
        remaining = min(params.deadline_unix_s - time.time(), MAX_PULL_S)
        if remaining <= 0:
            raise KVTransferError(f"transfer {params.transfer_id!r} expired")
        give_up = time.monotonic() + min(NOT_YET_S, remaining)
        while True:
            try:
                return self._pull_once(address, params, block_ids, remaining)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < give_up:
                    time.sleep(RETRY_S)
                    continue
                raise KVTransferError(f"pull from {address}: {exc.code().name}: {exc.details()}") from None

    def _pull_once(self, address: str, params: KVTransferParams, block_ids: Sequence[int], timeout: float) -> int:
        stub = worker_pb2_grpc.KVTransferStub(self._channel(address))
        request = worker_pb2.PullBlocksRequest(transfer_id=params.transfer_id, token=params.token, release=True)
        num_layers = len(self.view.tensors)
        received: set[tuple[int, int]] = set()
        total = 0
        for msg in stub.PullBlocks(request, timeout=timeout):
            total += self._write(msg.chunk, block_ids, num_layers, received)
        if len(received) != num_layers * len(block_ids):
            raise KVTransferError(f"transfer {params.transfer_id!r} ended after {len(received)} of "
                                  f"{num_layers * len(block_ids)} (layer, block) parts")
        return total

    def _write(self, msg: worker_pb2.KVBlockChunk, block_ids: Sequence[int], num_layers: int,
               received: set[tuple[int, int]]) -> int:
        chunk = Chunk(msg.layer_index, msg.num_layers, msg.first_block, msg.data.dtype, tuple(msg.data.shape),
                      msg.data.data)
        if chunk.crc32 != msg.crc32:
            raise KVTransferError(f"layer {chunk.layer_index} blocks from {chunk.first_block}: checksum mismatch")
        if chunk.num_layers != num_layers or chunk.layer_index >= num_layers:
            raise KVTransferError(f"the producer holds {chunk.num_layers} KV tensors, this worker {num_layers}")
        count = chunk.shape[self.view.block_dim(self.view.tensors[chunk.layer_index])] if chunk.shape else 0
        if count < 1 or chunk.first_block + count > len(block_ids):
            raise KVTransferError(f"layer {chunk.layer_index}: blocks {chunk.first_block}+{count} out of range")
        self.view.write(chunk.layer_index, block_ids[chunk.first_block:chunk.first_block + count], chunk)
        received.update((chunk.layer_index, chunk.first_block + i) for i in range(count))
        return len(chunk.data)

    def _channel(self, address: str) -> grpc.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address)
        return channel

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def chunk_to_pb(chunk: Chunk) -> worker_pb2.PullBlocksResponse:
    return worker_pb2.PullBlocksResponse(chunk=worker_pb2.KVBlockChunk(
        layer_index=chunk.layer_index, first_block=chunk.first_block,
        data=pack_raw(chunk.data, chunk.dtype, chunk.shape), crc32=chunk.crc32, num_layers=chunk.num_layers))
