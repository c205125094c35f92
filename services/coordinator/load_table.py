"""``LoadTable``: the coordinator's view of every engine's load, versioned so watchers wake on change.

Engines report (waiting, running, KV-cache usage) whenever it changes; an engine whose report stream
ends leaves the table. Watchers block in ``wait_for_change`` until the version moves past theirs or
the publish interval passes (then they republish the same snapshot, so a gateway notices a silent
coordinator). ``bump`` wakes them for a change kept elsewhere (the MoE wave state).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load at one moment."""

    dp_rank: int
    address: str
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    reported_at: float = 0.0  # time.monotonic() of the report (the coordinator's clock)


class LoadTable:
    """Thread-safe table of the latest report of each engine (keyed by DP rank)."""

    def __init__(self) -> None:
        self._loads: dict[int, EngineLoad] = {}
        self._version = 0
        self._changed = threading.Condition()

    def update(self, load: EngineLoad) -> None:
        with self._changed:
            old = self._loads.get(load.dp_rank)
            self._loads[load.dp_rank] = load
            if old is None or _key(old) != _key(load):
                self._version += 1
                self._changed.notify_all()

    def remove(self, dp_rank: int) -> None:
        with self._changed:
            if self._loads.pop(dp_rank, None) is not None:
                self._version += 1
                self._changed.notify_all()

    def bump(self) -> None:
        """Wake every watcher (something they publish besides the loads changed)."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def snapshot(self) -> tuple[int, list[EngineLoad]]:
        """(version, loads sorted by DP rank)."""
        with self._changed:
            return self._version, [self._loads[r] for r in sorted(self._loads)]

    def wait_for_change(self, version: int, timeout: float) -> tuple[int, list[EngineLoad]]:
        """The snapshot once the version differs from ``version``, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._version == version:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._version, [self._loads[r] for r in sorted(self._loads)]


def _key(load: EngineLoad) -> tuple:
    return load.address, load.num_waiting, load.num_running, round(load.kv_cache_usage, 3)
