"""``FakeEngineClient``: the part of ``EngineClient``'s interface the gateway service uses, in memory
(sinks per request, readiness flags, recorded aborts); tests subclass it with their ``add_request``."""

from __future__ import annotations

import asyncio
import threading


class FakeEngineClient:
    def __init__(self, name: str, serving: bool = True, sessions: int = 0) -> None:
        self.address = name
        self.serving = serving  # READY, as its health Watch says
        self.recovering = False
        self.sessions = sessions
        self.ready = threading.Event()
        self.ready.set()
        self.queues: dict = {}
        self.added: list = []
        self.aborted: list[str] = []
        self.loop = asyncio.get_running_loop()

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    def register(self, request_id, outputs):
        self.queues[request_id] = outputs

    def unregister(self, request_id):
        self.queues.pop(request_id, None)

    async def abort(self, request_ids):
        self.aborted += request_ids
