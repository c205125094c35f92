"""``LocalEngineClient``: an in-process ``EngineCore`` behind ``EngineClientProtocol``
(``shared/engine_client_protocol.py``), the interface of the gateway's remote ``EngineClient``.

``AsyncLLM`` drives engines through ``register`` / ``add_request`` / ``abort``; remotely that is the
gateway's own ``EngineClient`` (gRPC), in process it is this: the engine's busy loop
(``EngineLoop``) in its own thread, its per-step outputs handed to the caller's event loop exactly
as the engine servicer hands them to a gateway's stream. It assembles the engine and worker roles
(the in-process executor), so it lives outside ``services/``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Optional

from gridserve.llm_engine import in_process_executor
from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.loop import END, EngineLoop
from gridserve.services.engine.lora_adapters import adapter_for
from gridserve.services.engine.request import Request
from gridserve.shared.config import GridserveConfig
from gridserve.shared.engine_client_protocol import OutputSink
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError
from gridserve.shared.kv_transfer import KVTransferParams
from gridserve.shared.load import EngineLoad
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.readiness import Readiness, State
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GATEWAY_ID = "in-process"


class LocalEngineClient:
    """One in-process engine whose outputs go to ``aio_loop`` (built in any thread: it loads the
    model); an ``EngineClientProtocol``. It is READY from the start and ``ready`` until the engine
    stops; ``shutdown`` is ``close`` for a caller off the event loop."""

    def __init__(self, config: GridserveConfig, aio_loop: asyncio.AbstractEventLoop) -> None:
        self.address = "in-process"
        self.config = config
        self.readiness = Readiness("engine")
        self.core = EngineCore(config, in_process_executor(config))
        self.engine_loop = EngineLoop(self.core, self.readiness)
        self.readiness.set(State.READY, "model loaded")
        self.loop = aio_loop
        self.serving = True
        self.recovering = False
        self.sessions = 1  # the one output stream, opened here
        self.ready = threading.Event()
        self._sinks: dict[str, OutputSink] = {}
        self.engine_loop.open_stream(GATEWAY_ID, self).result()
        self.ready.set()

    # ---- EngineClientProtocol -----------------------------------------------------------------------
    def register(self, request_id: str, outputs: OutputSink) -> None:
        self._sinks[request_id] = outputs

    def unregister(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    async def add_request(self, request_id: str, token_ids: list[int], params: Optional[SamplingParams],
                          parent_request_id: str = "", traceparent: str = "",
                          mm_features: Optional[list[ImageFeature]] = None,
                          output_token_ids: Optional[list[int]] = None, continuation: bool = False,
                          lora_name: Optional[str] = None, pooling_params: Optional[PoolingParams] = None,
                          token_type_ids: Optional[list[int]] = None, priority: int = 0,
                          kv_transfer_params: Optional[KVTransferParams] = None, prefill_only: bool = False,
                          cache_salt: Optional[str] = None) -> None:
        """``traceparent`` is not used: an in-process engine records no spans of its own. It takes no
        part in disaggregated serving: ``kv_transfer_params`` / ``prefill_only`` are refused."""
        if kv_transfer_params is not None or prefill_only:
            raise InvalidArgumentError("kv_transfer_params" if kv_transfer_params is not None else "prefill_only",
                                       "an in-process engine takes no part in disaggregated prefill / decode")
        lora = adapter_for(self.engine_loop.core.lora, lora_name) if lora_name else None
        if params is None and pooling_params is not None:  # a pooling request: one step, no tokens (as the servicer)
            params = SamplingParams(max_tokens=1)
        request = Request(request_id, token_ids, params, eos_token_id=self.config.model.eos_token_id,
                          parent_request_id=parent_request_id or None, mm_features=mm_features or [],
                          admit_always=continuation, output_token_ids=output_token_ids, lora_request=lora,
                          priority=priority, cache_salt=cache_salt, **_pooling_kw(pooling_params, token_type_ids))
        await asyncio.wrap_future(self.engine_loop.add_request(request, GATEWAY_ID))

    async def abort(self, request_ids: list[str]) -> None:
        await asyncio.wrap_future(self.engine_loop.abort(request_ids))

    async def load(self) -> EngineLoad:
        return await asyncio.wrap_future(self.engine_loop.load())

    async def close(self) -> None:
        """Stop the engine thread and its workers (in a thread: that waits for the engine's step)."""
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """``close``, blocking, from any thread but the event loop's."""
        self.ready.clear()
        self.engine_loop.stop()
        self.core.shutdown()

    # ---- the engine loop's output sink (called on the engine thread) ---------------------------------
    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self._route, item)

    def _route(self, item: Any) -> None:
        if item is END:
            self.ready.clear()
            item = EngineDeadError("the engine stopped")
        if isinstance(item, Exception):
            for outputs in list(self._sinks.values()):
                outputs.put_nowait(item)
            return
        for out in item:
            outputs = self._sinks.get(out.request_id)
            if outputs is not None:
                outputs.put_nowait(out)


def _pooling_kw(pooling_params: Optional[PoolingParams], token_type_ids: Optional[list[int]]) -> dict[str, Any]:
    """A pooling request's keywords of ``Request`` (none for a generation request: a ``Request``
    without them is one, whatever this checkout's engine knows of pooling)."""
    if pooling_params is None and not token_type_ids:
        return {}
    return {"pooling_params": pooling_params, "token_type_ids": list(token_type_ids or []) or None}
