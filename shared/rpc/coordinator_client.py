"""``LoadSubscription``: a client's open ``WatchLoad`` stream to the DP coordinator.

A ``ReconnectingStream`` keeps the stream open on the caller's event loop and hands every snapshot
to ``on_snapshot`` (on that loop: it must not block); ``on_lost`` runs each time the stream breaks,
so the subscriber can stop trusting what it last saw. Gateways subscribe to route by load
(``LoadWatcher``), MoE engines to join request waves (``WaveClient``); both also use ``stub`` for
their unary calls. Create it on the loop it runs on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.shared.rpc.client import aio_channel
from gridserve.shared.rpc.reconnect import ReconnectingStream

logger = logging.getLogger(__name__)


class LoadSubscription:
    def __init__(self, address: str, subscriber_id: str,
                 on_snapshot: Callable[[coordinator_pb2.WatchLoadResponse], None],
                 on_lost: Callable[[], None] = lambda: None, name: str = "coordinator-watch") -> None:
        self.address = address
        self.subscriber_id = subscriber_id
        self.on_snapshot = on_snapshot
        self.on_lost = on_lost
        self.channel = aio_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self._stream = ReconnectingStream(name, self._watch, self._lost)

    async def _watch(self) -> None:
        request = coordinator_pb2.WatchLoadRequest(subscriber_id=self.subscriber_id)
        async for snapshot in self.stub.WatchLoad(request, wait_for_ready=True):
            self.on_snapshot(snapshot)

    def _lost(self, reason: str) -> None:
        logger.warning("coordinator %s: %s", self.address, reason)
        self.on_lost()

    async def close(self) -> None:
        await self._stream.close()
        await self.channel.close()
