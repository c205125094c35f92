"""``EngineClientProtocol``: what a gateway (or ``AsyncLLM``) needs of one engine, wherever it runs.

Two classes implement it: the gateway's ``EngineClient`` (``shared/rpc/engine_client.py``, an
engine service over gRPC) and ``LocalEngineClient`` (``gridserve/local_engine_client.py``, an
``EngineCore`` in this process). Code that routes requests to engines (``GatewayService``,
``AsyncLLM``) is written against this protocol only, so either serves it. Free of grpc and torch.

The contract:

- Outputs: ``register(request_id, sink)`` before ``add_request``; every ``EngineCoreOutput`` of
  that request then goes to ``sink.put_nowait`` on the client's event loop (``loop``), the last
  one ``finished``. When the engine is lost, each registered sink gets an ``EngineDeadError``
  instead (the remote client's ``EngineLostError`` names the request and the stream's
  ``sessions`` count). ``unregister`` when done; ``num_in_flight`` counts the registered ids.
  ``register`` / ``unregister`` / ``num_in_flight`` / ``ready`` are safe from any thread.
- Readiness: ``ready`` is set while the output stream is open (the engine is reachable);
  ``serving`` is True while the engine is READY (not sleeping, loading, draining, recovering);
  ``recovering`` is True while it rebuilds its workers and queues new requests meanwhile.
- ``add_request`` returns once the engine accepted the request; it raises ``EngineDeadError``
  when the engine is not reachable, ``ResourceExhaustedError`` when its waiting queue is full,
  and any other refusal as its transport reports it (remote: ``grpc.aio.AioRpcError``, e.g.
  INVALID_ARGUMENT naming the field; in process: the engine's typed ``GridserveError``). A
  ``continuation`` is a request failed over from a dead engine, with the ``output_token_ids`` it
  had generated; the engine admits it even when its queue is full.
- ``abort`` ends requests by engine id (each gets a last output, finish reason ``abort``); ids it
  does not know are ignored. ``close`` stops the client (and an in-process engine) for good.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Optional, Protocol, runtime_checkable

from gridserve.shared.kv_transfer import KVTransferParams
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.sampling_params import SamplingParams


class OutputSink(Protocol):
    """Where one engine request's outputs go (``EngineCoreOutput``, or an ``EngineDeadError``)."""

    def put_nowait(self, item: Any) -> None: ...


@runtime_checkable
class EngineClientProtocol(Protocol):
    """One engine as its callers see it (the contract is in the module docstring)."""

    address: str  # for logs and labels: host:port, or "in-process"
    loop: asyncio.AbstractEventLoop  # where outputs are delivered and the coroutines run
    ready: threading.Event  # the output stream is open
    serving: bool  # the engine is READY
    recovering: bool  # not READY because it rebuilds its workers (adds queue meanwhile)
    sessions: int  # output streams opened so far (a request added now rides on the latest)

    @property
    def num_in_flight(self) -> int:
        """Requests registered now (added and not yet unregistered)."""
        ...

    def register(self, request_id: str, outputs: OutputSink) -> None:
        """Deliver ``request_id``'s outputs (or an exception) to ``outputs``."""
        ...

    def unregister(self, request_id: str) -> None:
        """Stop delivering ``request_id``'s outputs (unknown ids are ignored)."""
        ...

    async def add_request(self, request_id: str, token_ids: list[int], params: Optional[SamplingParams],
                          parent_request_id: str = "", traceparent: str = "",
                          mm_features: Optional[list[ImageFeature]] = None,
                          output_token_ids: Optional[list[int]] = None, continuation: bool = False,
                          lora_name: Optional[str] = None, pooling_params: Optional[PoolingParams] = None,
                          token_type_ids: Optional[list[int]] = None, priority: int = 0,
                          kv_transfer_params: Optional[KVTransferParams] = None, prefill_only: bool = False,
                          cache_salt: Optional[str] = None) -> None:
        """Start ``request_id`` on the engine: ``parent_request_id`` is the id the client sees,
        ``traceparent`` the caller's span (W3C), ``mm_features`` the prompt's preprocessed images,
        ``lora_name`` the LoRA adapter it runs on (the engine's table resolves it; None: the base model),
        ``priority`` its rank under the engine's priority scheduling (lower first; an FCFS engine
        refuses any value but 0 with ``InvalidArgumentError`` / INVALID_ARGUMENT naming it).
        A pooling request (a pooling model's embedding or scores) gives ``pooling_params`` and no
        ``params`` (None), and ``token_type_ids`` for a BERT pair (None: all 0); it finishes in one
        output carrying ``pooler_output``. Disaggregated prefill / decode: ``prefill_only`` asks a
        kv_producer engine to run the prompt and hold its KV, ``kv_transfer_params`` (a producer's)
        has a kv_consumer engine pull that KV instead of computing the prompt; an engine that takes
        no part refuses either with ``InvalidArgumentError`` naming it. ``cache_salt``: only requests
        with the same salt share prefix-cache blocks (None: no salt)."""
        ...

    async def abort(self, request_ids: list[str]) -> None:
        """End these engine requests (best effort: an engine that is gone aborts nothing)."""
        ...

    async def close(self) -> None:
        """Disconnect (remote) or stop the engine (in process); the client is unusable after."""
        ...
