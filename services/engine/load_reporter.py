"""``LoadReporter``: streams this engine's load to the DP coordinator.

The engine loop ``offer``s its load after every step and every add / abort / sleep (on the loop
thread, from the same ``SchedulerStats`` snapshot the metrics and ``GetLoad`` use); nothing polls
the engine. A thread keeps ``ReportLoad`` open (reconnecting after a failure) and sends a report as
soon as the offered load differs from the last one sent, and the latest one again every
``interval_s`` (the coordinator's sign of life for an idle engine). A dead engine offers ``None``:
the stream ends for good, and the coordinator drops the engine from its table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import grpc

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.shared.rpc.client import make_channel

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 1.0


def _key(load: Any) -> tuple:
    return (load.num_waiting, load.num_running, round(load.kv_cache_usage, 3))


class LoadReporter:
    def __init__(self, coordinator: str, dp_rank: int, address: str, interval_s: float = 1.0) -> None:
        self.coordinator = coordinator
        self.dp_rank = dp_rank
        self.address = address
        self.interval_s = interval_s
        self.reports = 0
        self._latest: Optional[Any] = None  # the last offered load (num_waiting, num_running, kv_cache_usage)
        self._changed = threading.Condition()
        self._dead = False
        self._closed = threading.Event()
        self._channel = make_channel(coordinator)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="load-reporter", daemon=True)
        self._thread.start()

    def offer(self, load: Optional[Any]) -> None:
        """The engine's load now (None: the engine is dead); cheap enough to call after every step."""
        with self._changed:
            if load is None:
                self._dead = True
                self._changed.notify()
                return
            changed = self._latest is None or _key(load) != _key(self._latest)
            self._latest = load
            if changed:
                self._changed.notify()

    def _run(self) -> None:
        while not self._closed.is_set() and not self._dead:
            try:
                self._stub.ReportLoad(self._reports(), wait_for_ready=True)
            except grpc.RpcError as exc:
                if not self._closed.is_set():
                    logger.warning("coordinator %s: %s; reconnecting", self.coordinator, exc.code().name)
            self._closed.wait(RECONNECT_DELAY_S)

    def _reports(self) -> Iterator[coordinator_pb2.ReportLoadRequest]:
        sent, sent_at = None, 0.0  # a new stream starts with a report
        while not self._closed.is_set():
            with self._changed:
                self._changed.wait_for(lambda last=sent: self._news(last),
                                       timeout=max(0.0, sent_at + self.interval_s - time.monotonic()))
                load = self._latest
            if self._closed.is_set() or self._dead:
                return
            if load is None or (_key(load) == sent and time.monotonic() - sent_at < self.interval_s):
                continue
            sent, sent_at = _key(load), time.monotonic()
            self.reports += 1
            yield coordinator_pb2.ReportLoadRequest(load=coordinator_pb2.EngineLoad(
                dp_rank=self.dp_rank, address=self.address, num_waiting=load.num_waiting,
                num_running=load.num_running, kv_cache_usage=load.kv_cache_usage))

    def _news(self, sent: Optional[tuple]) -> bool:
        """Whether the reporter has something to do besides the periodic resend (lock held)."""
        return self._closed.is_set() or self._dead or (self._latest is not None and _key(self._latest) != sent)

    def close(self) -> None:
        self._closed.set()
        with self._changed:
            self._changed.notify_all()
        self._channel.close()
