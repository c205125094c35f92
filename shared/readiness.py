"""``Readiness``: one role's lifecycle state, the one thing health, metrics and the router read.

A role is in exactly one state::

    LOADING -> READY <-> SLEEPING
                 |  <-> RECOVERING      (a worker group is being rebuilt; requests pause)
                 v
    (any) -> DRAINING -> DEAD           (SIGTERM)
    (any) -> DEAD                       (a fault nothing recovers from)

*Readiness* (can it take work now) is ``state is READY``. *Liveness* (is the process worth keeping)
is ``state is not DEAD`` and, when a watchdog is armed, the role's busy thread beat within its
timeout: a loop thread that died or hangs outside any step makes the role not live, and the
orchestrator restarts it. ``RpcServer`` maps both onto ``grpc.health.v1`` (readiness: service
``""`` and the role's services; liveness: service ``"liveness"``); the engine's load report and
metrics carry ``state.value``. No torch, no gRPC: every role and the gateway's router use it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

logger = logging.getLogger(__name__)


class State(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    SLEEPING = "sleeping"
    DRAINING = "draining"
    RECOVERING = "recovering"
    DEAD = "dead"


# Allowed moves; anything else is a bug in the caller and raises.
_TRANSITIONS: dict[State, frozenset[State]] = {
    State.LOADING: frozenset({State.READY, State.DRAINING, State.DEAD}),
    State.READY: frozenset({State.SLEEPING, State.RECOVERING, State.DRAINING, State.DEAD}),
    State.SLEEPING: frozenset({State.READY, State.DRAINING, State.DEAD}),
    State.RECOVERING: frozenset({State.READY, State.DRAINING, State.DEAD}),
    State.DRAINING: frozenset({State.DEAD}),
    State.DEAD: frozenset(),
}

LIVENESS_SERVICE = "liveness"  # the grpc.health.v1 service name a liveness probe asks for


class Readiness:
    """A role's state, its listeners and an optional watchdog over the role's busy thread.

    ``set`` may be called from any thread; listeners run on the caller's thread with
    ``(state, reason)`` and must not block. ``arm_watchdog(timeout_s)`` makes liveness require a
    ``beat()`` at least every ``timeout_s`` seconds (the engine's loop beats every iteration).
    """

    def __init__(self, role: str = "") -> None:
        self.role = role
        self._lock = threading.Lock()
        self._state = State.LOADING
        self._reason = "starting"
        self._since = time.monotonic()
        self._listeners: list[Callable[[State, str], None]] = []
        self._watchdog_s: Optional[float] = None
        self._last_beat = time.monotonic()

    @property
    def state(self) -> State:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def since(self) -> float:
        """``time.monotonic()`` when the current state began."""
        return self._since

    @property
    def ready(self) -> bool:
        return self._state is State.READY

    @property
    def live(self) -> bool:
        if self._state is State.DEAD:
            return False
        if self._watchdog_s is None:
            return True
        return time.monotonic() - self._last_beat <= self._watchdog_s

    def set(self, state: State, reason: str = "") -> bool:
        """Move to ``state``; whether it changed. Moving to the current state is a no-op; a move the
        table forbids raises ``ValueError`` (DEAD is final; DRAINING leads only to DEAD)."""
        with self._lock:
            if state is self._state:
                return False
            if state not in _TRANSITIONS[self._state]:
                raise ValueError(f"{self.role or 'role'}: cannot go from {self._state.value} to {state.value}")
            previous, self._state, self._reason, self._since = self._state, state, reason, time.monotonic()
            listeners = list(self._listeners)
        logger.log(logging.WARNING if state in (State.DEAD, State.RECOVERING) else logging.INFO,
                   "%s %s -> %s%s", self.role or "role", previous.value, state.value,
                   f": {reason}" if reason else "")
        for listener in listeners:
            try:
                listener(state, reason)
            except Exception:  # noqa: BLE001 - one listener must not stop the others
                logger.exception("readiness listener failed")
        return True

    def try_set(self, state: State, reason: str = "") -> bool:
        """``set`` that ignores a forbidden move (e.g. READY after a drain began); whether it moved."""
        try:
            return self.set(state, reason)
        except ValueError:
            return False

    def watch(self, listener: Callable[[State, str], None]) -> None:
        """Call ``listener(state, reason)`` on every change from now on (not for the current one)."""
        with self._lock:
            self._listeners.append(listener)

    # ---- watchdog --------------------------------------------------------------------------------
    def arm_watchdog(self, timeout_s: float) -> None:
        self._watchdog_s = timeout_s
        self.beat()

    def beat(self) -> None:
        self._last_beat = time.monotonic()

    @property
    def watchdog_s(self) -> Optional[float]:
        return self._watchdog_s
