"""``LoadWatcher``: the gateway's subscription to the coordinator's load snapshots.

A thread keeps ``WatchLoad`` open (reconnecting after a failure) and hands each engine's entry to
the ``Router`` by DP rank (the gateway's ``--engines`` list is in rank order, so the engines'
own bind addresses never need to match the names gateways reach them by); an engine missing from a snapshot (it stopped reporting) is forgotten, so the
router falls back to this gateway's own in-flight counts for it. ``wave`` is the coordinator's
current request wave (MoE lockstep).
"""

from __future__ import annotations

import logging
import threading

import grpc

from gridserve.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.services.gateway.router import ReportedLoad, Router
from gridserve.shared.rpc.client import make_channel

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 1.0


class LoadWatcher:
    def __init__(self, address: str, gateway_id: str, router: Router) -> None:
        self.address = address
        self.gateway_id = gateway_id
        self.router = router
        self.wave = 0
        self.snapshots = 0
        self._closed = threading.Event()
        self._channel = make_channel(address)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._call = None
        self._thread = threading.Thread(target=self._run, name="load-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._call = self._stub.WatchLoad(coordinator_pb2.WatchLoadRequest(gateway_id=self.gateway_id),
                                                  wait_for_ready=True)
                for snapshot in self._call:
                    self._apply(snapshot)
            except grpc.RpcError as exc:
                if not self._closed.is_set():
                    logger.warning("coordinator %s: %s; engine choice uses local counts meanwhile",
                                   self.address, exc.code().name)
            for rank in range(self.router.num_engines):
                self.router.on_report(rank, None)
            self._closed.wait(RECONNECT_DELAY_S)

    def _apply(self, snapshot: coordinator_pb2.WatchLoadResponse) -> None:
        seen = set()
        for load in snapshot.engines:
            rank = load.dp_rank  # the gateway's --engines are in DP rank order
            if rank >= self.router.num_engines:
                continue
            seen.add(rank)
            self.router.on_report(rank, ReportedLoad(load.num_waiting, load.num_running, load.kv_cache_usage))
        for rank in set(range(self.router.num_engines)) - seen:
            self.router.on_report(rank, None)
        self.wave = snapshot.wave
        self.snapshots += 1

    def close(self) -> None:
        self._closed.set()
        if self._call is not None:
            self._call.cancel()
        self._channel.close()
