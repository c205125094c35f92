"""``Router``: which engine gets a request (data parallelism, many gateways to many engines).

Each engine's score is its queue depth and running count as last reported to the coordinator
(``4 * waiting + running``, so a queued request weighs more than a running one), plus what this
gateway itself sent it since that report and is still in flight (so a burst between two snapshots
does not all land on the same engine), plus a penalty once its KV cache is more than half full. The lowest score wins;
ties go to the first engine from a start index that rotates on every call. Without any report
(no coordinator, DP = 1) the score is this gateway's own in-flight count per engine. An explicit
``data_parallel_rank`` on a request wins over the score.
"""

from __future__ import annotations

import itertools
import threading
from typing import Optional

from gridserve.shared.errors import EngineDeadError, InvalidArgumentError
from gridserve.shared.load import EngineLoad

WAITING_WEIGHT = 4.0
# A completely full KV cache counts like this many extra queued requests (linear above one half).
KV_PENALTY = 16.0


def engine_score(load: Optional[EngineLoad], sent_since_report: int, in_flight: int) -> float:
    """Lower is better. Of the requests sent since the report only those still in flight count
    (short ones may have come and gone between two reports); without any report, ``in_flight``."""
    if load is None:
        return float(in_flight)
    unseen = min(sent_since_report, in_flight)
    score = WAITING_WEIGHT * (load.num_waiting + unseen) + load.num_running
    if load.kv_cache_usage > 0.5:
        score += KV_PENALTY * 2.0 * (load.kv_cache_usage - 0.5)
    return score


class Router:
    """Picks an engine index among ``num_engines`` (DP rank order); thread-safe."""

    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        self._lock = threading.Lock()
        self._rotation = itertools.count()
        self._reported: list[Optional[EngineLoad]] = [None] * num_engines
        self._sent = [0] * num_engines  # requests sent since the engine's last report
        self.routed = [0] * num_engines  # requests routed to each engine, ever (for tests and metrics)

    def on_report(self, rank: int, load: Optional[EngineLoad]) -> None:
        """A coordinator snapshot's entry for engine ``rank`` (None: the engine left the table)."""
        with self._lock:
            self._reported[rank] = load
            self._sent[rank] = 0

    def choose(self, ready: list[bool], in_flight: list[int], data_parallel_rank: Optional[int] = None) -> int:
        """The engine for a new request among the ``ready`` ones (``in_flight``: this gateway's
        requests on each engine now); counts it as sent there."""
        with self._lock:
            if data_parallel_rank is not None:
                rank = self._explicit(data_parallel_rank, ready)
            else:
                rank = self._best(ready, in_flight)
            self._sent[rank] += 1
            self.routed[rank] += 1
            return rank

    def _explicit(self, rank: int, ready: list[bool]) -> int:
        if not 0 <= rank < self.num_engines:
            raise InvalidArgumentError("data_parallel_rank", f"must be in [0, {self.num_engines}), got {rank}")
        if not ready[rank]:
            raise EngineDeadError(f"the engine of data_parallel_rank {rank} is not available")
        return rank

    def _best(self, ready: list[bool], in_flight: list[int]) -> int:
        start = next(self._rotation) % self.num_engines
        best, best_score = -1, float("inf")
        for offset in range(self.num_engines):
            rank = (start + offset) % self.num_engines
            if not ready[rank]:
                continue
            score = engine_score(self._reported[rank], self._sent[rank], in_flight[rank])
            if score < best_score:
                best, best_score = rank, score
        if best < 0:
            raise EngineDeadError("no engine is available")
        return best
