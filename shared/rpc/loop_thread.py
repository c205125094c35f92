"""``LoopThread``: an asyncio event loop running in a daemon thread of its own.

A role's ``main`` and its blocking loops (the engine's busy loop, the worker's forward pass, the
offline ``LLM``) are plain threads; every gRPC server, stream and client runs on an event loop. This
is the bridge: coroutines and callables are handed to the loop from any thread, and the caller
either waits for the result (``run``, ``call``) or takes a ``concurrent.futures.Future``
(``submit``). Code already on the loop must ``await`` instead: ``run`` from the loop's own thread
would wait for itself, so it raises.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Optional, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
STOP_TIMEOUT_S = 5.0


class LoopThread:
    """One event loop, run forever by one daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def in_loop(self) -> bool:
        """Whether the calling thread is the loop's."""
        return threading.current_thread() is self._thread

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future:
        """Schedule ``coroutine`` on the loop; its result arrives in the returned future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: Optional[float] = None) -> T:
        """Run ``coroutine`` on the loop and wait (from another thread) for its result."""
        if self.in_loop():
            coroutine.close()
            raise RuntimeError("LoopThread.run called on its own loop: await the coroutine instead")
        return self.submit(coroutine).result(timeout)

    def call(self, fn: Callable[[], T], timeout: Optional[float] = None) -> T:
        """Run the plain callable ``fn`` on the loop (e.g. to build an asyncio client there)."""
        return self.run(_call(fn), timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread (idempotent)."""
        if not self._thread.is_alive():
            return
        try:
            self.run(_cancel_others(), timeout=STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - stopping must go on
            logger.exception("cancelling the loop's tasks failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(STOP_TIMEOUT_S)


async def _call(fn: Callable[[], T]) -> T:
    return fn()


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
