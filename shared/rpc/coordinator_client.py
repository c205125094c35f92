"""``LoadSubscription``: a client's open ``WatchLoad`` stream to the DP coordinator.

A thread keeps the stream open, reconnecting ``RECONNECT_DELAY_S`` after a failure, and hands every
snapshot to ``on_snapshot``; ``on_lost`` runs each time the stream breaks, so the subscriber can
stop trusting what it last saw. Gateways subscribe to route by load (``LoadWatcher``), MoE engines
to join request waves (``WaveClient``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Optional

import grpc

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.shared.rpc.client import make_channel

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 1.0


class LoadSubscription:
    def __init__(self, address: str, subscriber_id: str,
                 on_snapshot: Callable[[coordinator_pb2.WatchLoadResponse], None],
                 on_lost: Callable[[], None] = lambda: None, name: str = "coordinator-watch") -> None:
        self.address = address
        self.subscriber_id = subscriber_id
        self.on_snapshot = on_snapshot
        self.on_lost = on_lost
        self.channel = make_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self._closed = threading.Event()
        self._call: Optional[grpc.Future] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._call = self.stub.WatchLoad(
                    coordinator_pb2.WatchLoadRequest(gateway_id=self.subscriber_id), wait_for_ready=True)
                for snapshot in self._call:
                    self.on_snapshot(snapshot)
            except grpc.RpcError as exc:
                if not self._closed.is_set():
                    logger.warning("coordinator %s: %s", self.address, exc.code().name)
            if self._closed.is_set():
                return
            self.on_lost()
            self._closed.wait(RECONNECT_DELAY_S)

    def close(self) -> None:
        self._closed.set()
        if self._call is not None:
            self._call.cancel()
        self.channel.close()
