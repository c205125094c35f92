"""``WaveClient``: an engine's part in MoE request waves (data parallelism with an MoE model).

While any engine of the DP group has work, all of them step in lockstep; an engine without
requests runs a dummy step (an empty batch through its executor). After every step of a wave the
engine meets the others at the coordinator's barrier (``SyncStep``), which also reduces "has
unfinished requests"; when none has, the wave ends for all at the same step. An idle engine that
receives a request asks the coordinator to start a wave (``StartWave``); the others see the running
wave in the coordinator's snapshots (``WatchLoad``) and join it at step 0. Dense models skip all
of this (the engine creates no ``WaveClient``). With expert parallelism the engines' MoE layers
exchange tokens inside each forward pass, so ``EngineCore.lockstep`` makes every wave step submit
exactly one ``execute_model`` (an empty one when nothing is scheduled), and the workers run an
empty step's MoE collectives on zero tokens; a dummy step is such an empty step.

When the coordinator dies the engine keeps serving: a barrier that fails ends this engine's wave
(it steps alone until the coordinator returns), a wave that cannot start is skipped, and a
restarted coordinator, whose wave numbers begin again at 0, is recognised on the first snapshot
after the subscription reconnects, so the engine joins its waves.

The client is created on the server's event loop, where its subscription and calls run; ``poll``,
``on_request`` and ``after_step`` are called from the engine's loop thread, which waits for the
coordinator's answer (a barrier is exactly that wait).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Optional, TypeVar

import grpc

from gridserve.api.coordinator.v1 import coordinator_pb2
from gridserve.shared.rpc.client import DEFAULT_DEADLINE_S
from gridserve.shared.rpc.coordinator_client import LoadSubscription

logger = logging.getLogger(__name__)

T = TypeVar("T")
SYNC_STEP_TIMEOUT_S = 60.0


def is_moe(hf_config: dict) -> bool:
    """Whether the model routes tokens to experts (Mixtral, Qwen-MoE, DeepSeek-style configs)."""
    return any((hf_config.get(k) or 0) > 0 for k in ("num_local_experts", "num_experts", "n_routed_experts"))


class WaveClient:
    def __init__(self, coordinator: str, dp_rank: int) -> None:
        self.coordinator = coordinator
        self.dp_rank = dp_rank
        self.wave: Optional[int] = None  # the wave this engine is in (None: idle)
        self.step = 0
        self.next_wave = 0  # waves below this one are done for this engine
        self.dummy_steps = 0
        self.waves_completed = 0
        self._seen = (0, False)  # the coordinator's latest (wave, running)
        self._seen_lock = threading.Lock()
        self._reconnected = False  # the subscription broke; the next snapshot may be a new coordinator's
        self._restarted_at: Optional[int] = None  # a new coordinator's wave number, for the engine thread
        self._loop = asyncio.get_running_loop()
        self._subscription = LoadSubscription(coordinator, f"engine-{dp_rank}", self._on_snapshot,
                                              on_lost=self._on_lost, name="wave-watcher")
        self._stub = self._subscription.stub

    def poll(self) -> bool:
        """Join a wave another engine started, if one runs that this engine has not done; True if in one."""
        if self.wave is None:
            with self._seen_lock:
                wave, running = self._seen
                restarted_at, self._restarted_at = self._restarted_at, None
            if restarted_at is not None and restarted_at < self.next_wave:
                logger.info("the coordinator restarted (wave %d, was %d)", restarted_at, self.next_wave)
                self.next_wave = restarted_at
            if running and wave >= self.next_wave:
                self._join(wave)
        return self.wave is not None

    def on_request(self) -> None:
        """A request arrived: outside a wave, start one (or join the one running)."""
        if self.wave is not None:
            return
        request = coordinator_pb2.StartWaveRequest(dp_rank=self.dp_rank)
        response = self._wait(lambda: self._stub.StartWave(request, timeout=DEFAULT_DEADLINE_S),
                              DEFAULT_DEADLINE_S)
        self._join(response.wave)

    def after_step(self, unfinished: bool, dummy: bool) -> None:
        """The step's barrier; leaves the wave when no engine has unfinished requests."""
        if self.wave is None:
            return
        self.dummy_steps += int(dummy)
        request = coordinator_pb2.SyncStepRequest(dp_rank=self.dp_rank, wave=self.wave, step=self.step,
                                                  unfinished=unfinished)
        try:
            response = self._wait(lambda: self._stub.SyncStep(request, timeout=SYNC_STEP_TIMEOUT_S),
                                  SYNC_STEP_TIMEOUT_S)
            any_unfinished = response.any_unfinished
        except grpc.RpcError as exc:
            logger.error("wave %d step %d: %s; leaving the wave", self.wave, self.step, exc.details())
            any_unfinished = False
        self.step += 1
        if not any_unfinished:
            logger.debug("wave %d done after %d steps (%d dummy)", self.wave, self.step, self.dummy_steps)
            self.next_wave = self.wave + 1
            self.waves_completed += 1
            self.wave = None

    def _wait(self, call: Callable[[], Awaitable[T]], timeout: float) -> T:
        """Make the unary ``call`` on the event loop and wait for its answer (engine thread)."""
        return asyncio.run_coroutine_threadsafe(_awaited(call), self._loop).result(timeout + 5.0)

    def _join(self, wave: int) -> None:
        logger.debug("joining wave %d", wave)
        self.wave, self.step = wave, 0
        self.next_wave = max(self.next_wave, wave)

    def _on_snapshot(self, snapshot: coordinator_pb2.WatchLoadResponse) -> None:
        with self._seen_lock:
            self._seen = (snapshot.wave, snapshot.wave_running)
            if self._reconnected:
                self._reconnected, self._restarted_at = False, snapshot.wave

    def _on_lost(self) -> None:
        with self._seen_lock:
            self._reconnected = True

    async def close(self) -> None:
        await self._subscription.close()


async def _awaited(call: Callable[[], Awaitable[T]]) -> T:
    return await call()
