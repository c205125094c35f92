"""KV connectors: how a worker moves a prefilled request's KV blocks between engines (P/D).

``KVConnector`` is the contract, two sides in one object since a ``kv_both`` worker is both:

* send side (a producer's worker): ``register(send)`` makes a transfer's blocks available until
  ``release(transfer_id)``; ``serve(transfer_id, token)`` yields them chunk by chunk to a puller;
  ``take_sent()`` hands the engine the transfers fully pulled since it last asked (it frees them).
* receive side (a consumer's worker): ``pull(params, block_ids)`` writes the producer's blocks into
  this worker's ``block_ids`` (one list per KV cache group) and returns the bytes received, or
  raises ``KVTransferError``.

Both sides read and write the worker's KV cache through ``KVCacheView`` (the tensors the model
runner allocated, indexed by block along each tensor's block dimension). With several KV cache
groups (sliding-window layers beside full ones) a tensor is shared by a layer of each of several
groups, each writing its own group's blocks: the unit of a transfer is a *part*, a (tensor, group)
pair, which moves that group's blocks of that tensor (one group: a part per tensor). A group's
null entries (``NULL_BLOCK``: a window group's blocks out of the window) are not sent, and the
consumer leaves its blocks there as they are. ``GrpcKVConnector`` is the implementation over
``worker.v1.KVTransfer`` (``kv_transfer.py``: the server and the step hook); a shared-memory or
RDMA connector would implement the same four methods.
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
from typing import Optional, Union

import grpc
import torch

from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.shared.kv_transfer import NULL_BLOCK, KVSend, KVTransferParams
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
BlockIds = Union[Sequence[int], Sequence[Sequence[int]]]  # per KV cache group (flat: the one group)


class KVTransferError(RuntimeError):
    """A pull that failed: the consumer computes the prompt itself."""


class TransferNotFound(KeyError):
    """No such transfer (unknown, released or expired): NOT_FOUND."""


class TransferRefused(PermissionError):
    """A wrong token for the transfer: PERMISSION_DENIED."""


@dataclass(frozen=True)
class Chunk:
    """One part's KV for a run of a transfer's blocks, as raw little-endian bytes. ``layer_index``
    is the part's index (``KVCacheView.parts``), ``first_block`` an index into its group's list."""

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
    blocks on dim 1, a latent cache ``[blocks, ...]`` on dim 0. ``groups`` gives, parallel to the
    tensors, the KV cache groups whose layers use each one (without it: every tensor group 0's)."""

    def __init__(self, tensors: Callable[[], Sequence[torch.Tensor]],
                 groups: Optional[Callable[[], Sequence[Sequence[int]]]] = None) -> None:
        self._tensors = tensors
        self._groups = groups

    @property
    def tensors(self) -> Sequence[torch.Tensor]:
        return self._tensors()

    @property
    def parts(self) -> list[tuple[int, int]]:
        """The (tensor index, group) pairs a transfer moves, in tensor order then group order."""
        tensors = self.tensors
        groups = self._groups() if self._groups is not None else [(0,)] * len(tensors)
        if len(groups) != len(tensors):
            raise KVTransferError(f"{len(tensors)} KV tensors, KV cache groups for {len(groups)}")
        return [(t, g) for t, of_tensor in enumerate(groups) for g in sorted(of_tensor)]

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
    def pull(self, params: KVTransferParams, block_ids: BlockIds, rank: int = 0) -> int:
        """Write the producer's blocks into ``block_ids`` (one list per KV cache group, each in the
        order of the params' list of that group; a flat list: the one group's) from the producer's
        worker of ``rank`` (this worker's own rank: the same shard); the bytes received. Positions
        the producer marks ``NULL_BLOCK`` are left as they are."""


class GrpcKVConnector(KVConnector):
    """Blocks over ``worker.v1.KVTransfer.PullBlocks``: one stream per transfer (mutual TLS with the
    worker's certificate when configured), a CRC-32 per chunk, every (part, block) checked in."""

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
        groups, parts = send.group_block_ids, self.view.parts
        if any(group >= len(groups) for _, group in parts):
            raise KVTransferError(f"transfer {transfer_id!r} names {len(groups)} KV cache groups, "
                                  f"this worker's cache has {1 + max(g for _, g in parts)}")
        for index, (tensor, group) in enumerate(parts):
            ids = groups[group]
            for first, count in _runs(ids, self.view.blocks_per_chunk(tensor, self.chunk_bytes)):
                with self._lock:  # a released transfer's blocks may already hold another request's KV
                    self._live(transfer_id)
                    dtype, shape, data = self.view.read(tensor, ids[first:first + count])
                    self._bytes_sent += len(data)
                yield Chunk(index, len(parts), first, dtype, shape, data)
        with self._lock:
            if release and self._sends.pop(transfer_id, None) is not None:
                self._sent.append(transfer_id)

    def take_sent(self) -> tuple[list[str], int]:
        with self._lock:
            sent, self._sent = self._sent, []
            sent_bytes, self._bytes_sent = self._bytes_sent, 0
        return sent, sent_bytes

    # ---- receive side ------------------------------------------------------------------------------
    def pull(self, params: KVTransferParams, block_ids: BlockIds, rank: int = 0) -> int:
        mine, theirs = _per_group(block_ids), params.group_block_ids
        if len(mine) != len(theirs):
            raise KVTransferError(f"the producer's blocks of {len(theirs)} KV cache group(s) for "
                                  f"local ones of {len(mine)}")
        for group, (local, remote) in enumerate(zip(mine, theirs)):
            if len(local) != len(remote):
                raise KVTransferError(f"KV cache group {group}: {len(remote)} producer blocks for "
                                      f"{len(local)} local ones")
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
                return self._pull_once(address, params, mine, remaining)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < give_up:
                    time.sleep(RETRY_S)
                    continue
                raise KVTransferError(f"pull from {address}: {exc.code().name}: {exc.details()}") from None

    def _pull_once(self, address: str, params: KVTransferParams, mine: tuple[Sequence[int], ...],
                   timeout: float) -> int:
        stub = worker_pb2_grpc.KVTransferStub(self._channel(address))
        request = worker_pb2.PullBlocksRequest(transfer_id=params.transfer_id, token=params.token, release=True)
        receipt = Receipt(self.view, params.group_block_ids, mine)
        total = 0
        for msg in stub.PullBlocks(request, timeout=timeout):
            total += receipt.write(msg.chunk)
        if len(receipt.received) != receipt.expected:
            got, wanted = len(receipt.received), receipt.expected
            raise KVTransferError(f"transfer {params.transfer_id!r} ended after {got} of {wanted} "
                                  "(part, block) pairs")
        return total

    def _channel(self, address: str) -> grpc.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address)
        return channel

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


class Receipt:
    """One pull on the consumer: where each chunk goes (``mine``: this worker's blocks per group,
    ``theirs``: the producer's) and which (part, block index) pieces arrived, out of ``expected``
    (the non-null blocks of each part's group)."""

    def __init__(self, view: KVCacheView, theirs: Sequence[Sequence[int]],
                 mine: Sequence[Sequence[int]]) -> None:
        self.view, self.theirs, self.mine = view, theirs, mine
        self.parts = view.parts
        if any(group >= len(theirs) for _, group in self.parts):
            raise KVTransferError(f"the transfer holds {len(theirs)} KV cache group(s), this "
                                  f"worker's cache has {1 + max(g for _, g in self.parts)}")
        self.expected = sum(_num_sent(theirs[group]) for _, group in self.parts)
        self.received: set[tuple[int, int]] = set()

    def write(self, msg: worker_pb2.KVBlockChunk) -> int:
        """Check one chunk and write it into this worker's blocks; its bytes."""
        chunk = Chunk(msg.layer_index, msg.num_layers, msg.first_block, msg.data.dtype,
                      tuple(msg.data.shape), msg.data.data)
        if chunk.crc32 != msg.crc32:
            raise KVTransferError(f"part {chunk.layer_index} blocks from {chunk.first_block}: "
                                  "checksum mismatch")
        if chunk.num_layers != len(self.parts) or chunk.layer_index >= len(self.parts):
            raise KVTransferError(f"the producer holds {chunk.num_layers} KV parts (tensor x "
                                  f"group), this worker {len(self.parts)}")
        tensor, group = self.parts[chunk.layer_index]
        first = chunk.first_block
        count = chunk.shape[self.view.block_dim(self.view.tensors[tensor])] if chunk.shape else 0
        if count < 1 or first + count > len(self.mine[group]):
            raise KVTransferError(f"part {chunk.layer_index}: blocks {first}+{count} out of range")
        if NULL_BLOCK in self.theirs[group][first:first + count]:
            raise KVTransferError(f"part {chunk.layer_index}: blocks {first}+{count} include ones "
                                  "the transfer does not send (out of the window)")
        self.view.write(tensor, self.mine[group][first:first + count], chunk)
        self.received.update((chunk.layer_index, first + i) for i in range(count))
        return len(chunk.data)


def _per_group(block_ids: BlockIds) -> tuple[Sequence[int], ...]:
    """Block ids as one list per KV cache group (a flat list is the one group's)."""
    if len(block_ids) and not isinstance(block_ids[0], int):
        return tuple(block_ids)
    return (block_ids,)


def _num_sent(block_ids: Sequence[int]) -> int:
    return sum(1 for block in block_ids if block != NULL_BLOCK)


def _runs(block_ids: Sequence[int], limit: int) -> Iterator[tuple[int, int]]:
    """(first index, count) of the runs of non-null entries of ``block_ids``, each at most ``limit``
    long: the chunks of one part."""
    first = 0
    while first < len(block_ids):
        if block_ids[first] == NULL_BLOCK:
            first += 1
            continue
        end = first + 1
        while end < len(block_ids) and end - first < limit and block_ids[end] != NULL_BLOCK:
            end += 1
        yield first, end - first
        first = end


def chunk_to_pb(chunk: Chunk) -> worker_pb2.PullBlocksResponse:
    return worker_pb2.PullBlocksResponse(chunk=worker_pb2.KVBlockChunk(
        layer_index=chunk.layer_index, first_block=chunk.first_block,
        data=pack_raw(chunk.data, chunk.dtype, chunk.shape), crc32=chunk.crc32, num_layers=chunk.num_layers))
