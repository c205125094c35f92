"""``LoadReporter``: streams this engine's load to the DP coordinator.

A thread keeps ``ReportLoad`` open (reconnecting after a failure): it sends a report as soon as the
load differs from the last one sent (checked every ``poll_s``, i.e. at most once per engine step,
since the numbers are read between steps) and at least every ``interval_s`` otherwise. The numbers
are ``EngineLoop.load()``: the same snapshot the metrics and ``GetLoad`` use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gridserve.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.shared.rpc.client import make_channel

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 1.0


class LoadReporter:
    def __init__(self, coordinator: str, dp_rank: int, address: str, load: Callable[[], Any],
                 poll_s: float = 0.02, interval_s: float = 1.0) -> None:
        self.coordinator = coordinator
        self.dp_rank = dp_rank
        self.address = address
        self._load = load
        self.poll_s = poll_s
        self.interval_s = interval_s
        self.reports = 0
        self._closed = threading.Event()
        self._channel = make_channel(coordinator)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="load-reporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._stub.ReportLoad(self._reports(), wait_for_ready=True)
            except grpc.RpcError as exc:
                if not self._closed.is_set():
                    logger.warning("coordinator %s: %s; reconnecting", self.coordinator, exc.code().name)
            self._closed.wait(RECONNECT_DELAY_S)

    def _reports(self) -> Iterator[coordinator_pb2.ReportLoadRequest]:
        last, sent_at = None, 0.0
        while not self._closed.is_set():
            try:
                load = self._load()
            except Exception as exc:  # noqa: BLE001 - a dead or sleeping engine stops reporting
                logger.info("load report stopped: %s", exc)
                return
            key = (load.num_waiting, load.num_running, round(load.kv_cache_usage, 3))
            now = time.monotonic()
            if key != last or now - sent_at >= self.interval_s:
                last, sent_at = key, now
                self.reports += 1
                yield coordinator_pb2.ReportLoadRequest(load=coordinator_pb2.EngineLoad(
                    dp_rank=self.dp_rank, address=self.address, num_waiting=load.num_waiting,
                    num_running=load.num_running, kv_cache_usage=load.kv_cache_usage))
            self._closed.wait(self.poll_s)

    def close(self) -> None:
        self._closed.set()
        self._channel.close()
