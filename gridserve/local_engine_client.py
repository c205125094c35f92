"""``LocalEngineClient``: an in-process ``EngineCore`` behind the remote ``EngineClient``'s interface.

``AsyncLLM`` drives engines through ``register`` / ``add_request`` / ``abort``; remotely that is the
gateway's own ``EngineClient`` (gRPC), in process it is this: the engine's busy loop
(``EngineLoop``) in its own thread, its per-step outputs handed to the caller's event loop exactly
as the engine servicer hands them to a gateway's stream. It assembles the engine and worker roles
(the in-process executor), so it lives outside ``services/``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from gridserve.llm_engine import in_process_executor
from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.loop import END, EngineLoop
from gridserve.services.engine.request import Request
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.load import EngineLoad
from gridserve.shared.readiness import Readiness, State
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GATEWAY_ID = "in-process"


class LocalEngineClient:
    """One in-process engine whose outputs go to ``aio_loop`` (built in any thread: it loads the model)."""

    def __init__(self, config: GridserveConfig, aio_loop: asyncio.AbstractEventLoop) -> None:
        self.address = "in-process"
        self.config = config
        self.readiness = Readiness("engine")
        self.core = EngineCore(config, in_process_executor(config))
        self.engine_loop = EngineLoop(self.core, self.readiness)
        self.readiness.set(State.READY, "model loaded")
        self._aio_loop = aio_loop
        self._sinks: dict[str, Any] = {}
        self.engine_loop.open_stream(GATEWAY_ID, self).result()

    # ---- the engine client interface (as ``shared/rpc/engine_client.EngineClient``) ------------------
    def register(self, request_id: str, outputs: Any) -> None:
        self._sinks[request_id] = outputs

    def unregister(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    async def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                          parent_request_id: str = "", traceparent: str = "",
                          mm_features: Optional[list] = None) -> None:
        request = Request(request_id, token_ids, params, eos_token_id=self.config.model.eos_token_id,
                          parent_request_id=parent_request_id or None, mm_features=mm_features or [])
        await asyncio.wrap_future(self.engine_loop.add_request(request, GATEWAY_ID))

    async def abort(self, request_ids: list[str]) -> None:
        await asyncio.wrap_future(self.engine_loop.abort(request_ids))

    async def load(self) -> EngineLoad:
        return await asyncio.wrap_future(self.engine_loop.load())

    def close(self) -> None:
        self.engine_loop.stop()
        self.core.shutdown()

    # ---- the engine loop's output sink (called on the engine thread) ---------------------------------
    def put(self, item: Any) -> None:
        self._aio_loop.call_soon_threadsafe(self._route, item)

    def _route(self, item: Any) -> None:
        if item is END:
            item = EngineDeadError("the engine stopped")
        if isinstance(item, Exception):
            for outputs in list(self._sinks.values()):
                outputs.put_nowait(item)
            return
        for out in item:
            outputs = self._sinks.get(out.request_id)
            if outputs is not None:
                outputs.put_nowait(out)
