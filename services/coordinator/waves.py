"""``Waves``: the coordinator's side of MoE request waves across data-parallel engines.

With a mixture-of-experts model every engine must run its forward passes in lockstep, so while
any engine has work, the idle ones run dummy steps. Under expert parallelism
(``--enable-expert-parallel``) the experts' exchange across the DP engines is real: every MoE layer
sends tokens to the workers holding their experts and combines the results through torch.distributed
collectives among the DP engines' workers (all-gather + all-reduce where vLLM uses an all-to-all;
``services/worker/fused_moe.py``), and the per-step barrier below lines the engines' steps up so
that those collectives pair (an idle engine's dummy step runs them on zero tokens). Without expert
parallelism every engine holds every expert and the barrier only keeps the engines in step.

A wave starts when an idle engine receives a request (``start``); during it every engine calls
``sync`` after each step, which waits for all ``dp_size`` engines and returns whether any still has
unfinished requests. The first step where none has ends the wave: the wave number (waves completed)
advances and the engines stop until the next ``start``. A barrier that does not fill within
``timeout_s`` (an engine died) fails the calls instead of hanging them, and ends the wave. Runs on
the coordinator's event loop: each barrier is an ``asyncio.Future`` its engines await.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class WaveError(RuntimeError):
    """A barrier that could not complete (an engine missing, or a wave that is not running)."""


class Waves:
    def __init__(self, dp_size: int, on_change: Callable[[], None] = lambda: None, timeout_s: float = 30.0) -> None:
        self.dp_size = dp_size
        self.on_change = on_change
        self.timeout_s = timeout_s
        self.wave = 0  # waves completed
        self.running = False
        self._arrived: dict[tuple[int, int], dict[int, bool]] = {}
        self._barriers: dict[tuple[int, int], asyncio.Future] = {}

    def state(self) -> tuple[int, bool]:
        return self.wave, self.running

    def start(self) -> int:
        """Start a wave unless one is running; return the running wave's number."""
        if not self.running:
            self.running = True
            self.on_change()
        return self.wave

    async def sync(self, rank: int, wave: int, step: int, unfinished: bool) -> bool:
        """Wait until every engine reached ``step`` of ``wave``; True if any has unfinished work."""
        key = (wave, step)
        barrier = self._barriers.get(key)
        if wave != self.wave or not self.running:
            if barrier is not None and barrier.done():  # the others already finished this barrier
                return barrier.result()
            raise WaveError(f"wave {wave} is not running (current {self.wave}, running={self.running})")
        if barrier is None:
            barrier = self._barriers[key] = asyncio.get_running_loop().create_future()
        arrived = self._arrived.setdefault(key, {})
        arrived[rank] = unfinished
        if len(arrived) == self.dp_size:
            self._complete(key, any(arrived.values()))
        try:
            return await asyncio.wait_for(asyncio.shield(barrier), self.timeout_s)
        except asyncio.TimeoutError:
            self._abandon(key)
            raise WaveError(f"step {step} of wave {wave}: only ranks {sorted(arrived)} of "
                            f"{self.dp_size} arrived within {self.timeout_s:.0f} s") from None

    def _complete(self, key: tuple[int, int], any_unfinished: bool) -> None:
        self._barriers[key].set_result(any_unfinished)
        del self._arrived[key]
        # Forget barriers two waves back (late readers of the last ones may still come).
        for old in [k for k in self._barriers if k[0] < key[0] - 1]:
            del self._barriers[old]
        if not any_unfinished:
            self._end_wave()

    def _abandon(self, key: tuple[int, int]) -> None:
        self._arrived.pop(key, None)
        barrier = self._barriers[key]
        if not barrier.done():
            barrier.set_result(False)
        if self.running and key[0] == self.wave:
            self._end_wave()

    def _end_wave(self) -> None:
        self.running = False
        self.wave += 1
        self.on_change()
