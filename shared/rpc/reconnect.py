"""``ReconnectingStream``: one long-lived gRPC stream, reopened after every failure.

Every client that keeps a stream open to another role uses it: the gateway's ``EngineClient``
(``StreamOutputs``), ``LoadSubscription`` (``WatchLoad``, gateways and MoE engines) and the engine's
``LoadReporter`` (``ReportLoad``). ``session`` is a coroutine function that opens the stream and
consumes it until it ends; when it ends or fails, ``on_lost(reason)`` runs (the client stops
trusting what the stream told it) and, ``RECONNECT_DELAY_S`` later, the next session opens.
``session`` returning ``False`` ends the loop for good (e.g. a dead engine stops reporting).
Runs as one task on the caller's event loop; ``close`` cancels it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Optional

import grpc

from gridserve.shared import envs

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = envs.GRIDSERVE_RECONNECT_DELAY_S  # read once, at import


class ReconnectingStream:
    """Runs ``session()`` again and again on the running loop until closed (or it returns False)."""

    def __init__(self, name: str, session: Callable[[], Awaitable[Optional[bool]]],
                 on_lost: Callable[[str], None] = lambda reason: None,
                 delay_s: float = RECONNECT_DELAY_S) -> None:
        self.name = name
        self.session = session
        self.on_lost = on_lost
        self.delay_s = delay_s
        self.closed = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=name)

    async def _run(self) -> None:
        while not self.closed:
            try:
                again = await self.session()
                reason = "the server ended the stream"
            except grpc.RpcError as exc:
                again, reason = True, f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # noqa: BLE001 - a bug in one message must not end the client
                logger.exception("%s: the stream's handler failed", self.name)
                again, reason = True, f"{type(exc).__name__}: {exc}"
            if self.closed:
                return
            self.on_lost(reason)
            if again is False:
                return
            await asyncio.sleep(self.delay_s)

    async def close(self) -> None:
        """Stop for good: the open stream is cancelled, no session follows."""
        self.closed = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
