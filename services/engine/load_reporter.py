"""``LoadReporter``: streams this engine's load to the DP coordinator.

The engine loop ``offer``s its ``EngineLoad`` after every step and every add / abort / sleep (on the
loop thread, from the same scheduler snapshot the metrics and ``GetLoad`` use); nothing polls the
engine. On the server's event loop a ``ReconnectingStream`` keeps ``ReportLoad`` open and sends a
report as soon as the offered load's ``routing_key`` differs from the last one sent, and the latest
one again every ``interval_s`` (the coordinator's sign of life for an idle engine). A dead engine
offers ``None``: the stream ends for good, and the coordinator drops the engine from its table.

With a ``PrefixDigest`` (the KV-cache manager's prefix-cache listener), each ``offer`` also commits
the blocks cached and evicted since the last one, and a report goes out whenever there are any,
carrying the changes since the previous report (``PrefixDigest.since``); a new stream starts with
the whole digest, so the coordinator's copy never misses a change.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Optional

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.shared.load import EngineLoad
from gridserve.shared.prefix_digest import Cursor, PrefixDigest
from gridserve.shared.rpc.client import aio_channel
from gridserve.shared.rpc.digest_convert import digest_to_pb
from gridserve.shared.rpc.reconnect import ReconnectingStream

logger = logging.getLogger(__name__)


class LoadReporter:
    """Create it on the event loop it runs on; ``offer`` is safe from any thread."""

    def __init__(self, coordinator: str, dp_rank: int, address: str, interval_s: float = 1.0,
                 digest: Optional[PrefixDigest] = None) -> None:
        self.coordinator = coordinator
        self.dp_rank = dp_rank
        self.address = address
        self.interval_s = interval_s
        self.digest = digest  # committed by ``offer`` (the engine thread), read by the stream
        self.reports = 0
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()  # guards the two fields below (the engine thread writes them)
        self._latest: Optional[EngineLoad] = None
        self._dead = False
        self._news = asyncio.Event()
        self._channel = aio_channel(coordinator)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._stream = ReconnectingStream("load-reporter", self._session, self._lost)

    def offer(self, load: Optional[EngineLoad]) -> None:
        """The engine's load now (None: the engine is dead); cheap enough to call after every step."""
        committed = load is not None and self.digest is not None and self.digest.commit()
        with self._lock:
            if load is None:
                changed, self._dead = True, True
            else:
                changed = committed or self._latest is None or load.routing_key() != self._latest.routing_key()
                self._latest = load
        if changed:
            self._loop.call_soon_threadsafe(self._news.set)

    async def _session(self) -> bool:
        await self._stub.ReportLoad(self._reports(), wait_for_ready=True)
        return not self._dead  # a dead engine's stream ended on purpose: no reconnect

    def _lost(self, reason: str) -> None:
        if not self._dead:
            logger.warning("coordinator %s: %s; reconnecting", self.coordinator, reason)

    async def _reports(self) -> AsyncIterator[coordinator_pb2.ReportLoadRequest]:
        sent, sent_at = None, 0.0  # a new stream starts with a report
        digest_sent: Optional[Cursor] = None  # ... and with the whole digest
        while True:
            self._news.clear()  # before reading: an offer from now on wakes the wait below
            with self._lock:
                load, dead = self._latest, self._dead
            if dead:
                return
            update = self.digest.since(digest_sent) if self.digest is not None and load is not None else None
            due = load is not None and (load.routing_key() != sent or update is not None
                                        or time.monotonic() - sent_at >= self.interval_s)
            if due:
                sent, sent_at = load.routing_key(), time.monotonic()
                self.reports += 1
                msg = coordinator_pb2.EngineLoad(dp_rank=self.dp_rank, address=self.address,
                                                 num_waiting=load.num_waiting, num_running=load.num_running,
                                                 kv_cache_usage=load.kv_cache_usage)
                if update is not None:
                    msg.prefix_digest.CopyFrom(digest_to_pb(update))
                    digest_sent = update.cursor
                yield coordinator_pb2.ReportLoadRequest(load=msg)
            wait = None if load is None else max(0.0, sent_at + self.interval_s - time.monotonic())
            try:
                await asyncio.wait_for(self._news.wait(), wait)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        await self._stream.close()
        await self._channel.close()
