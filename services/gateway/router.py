"""``Router``: which engine gets a request (data parallelism, many gateways to many engines).

Each engine's score is its queue depth and running count as last reported to the coordinator
(``4 * waiting + running``, so a queued request weighs more than a running one), plus what this
gateway itself sent it since that report and is still in flight (so a burst between two snapshots
does not all land on the same engine), plus a penalty once its KV cache is more than half full. The lowest score wins;
ties go to the first engine from a start index that rotates on every call. Without any report
(no coordinator, DP = 1) the score is this gateway's own in-flight count per engine. An explicit
``data_parallel_rank`` on a request wins over the score.

``--routing-policy prefix`` (cache-aware routing) also looks at which prompt blocks each engine
already holds in its prefix cache. Engines publish their prefix-cache digests through the
coordinator (``shared/prefix_digest.py``); the gateway hashes the prompt's full blocks exactly as
the engines do (``shared/prefix_hash.py``, with the block size the digests carry) and counts, per
engine, the leading blocks it holds: the blocks in its digest, and the ones this gateway sent it in
the last ``EXPECT_S`` seconds (the time an engine takes to compute and publish them: a burst of
requests sharing a new prefix follows the first one instead of spreading before any digest says
where it is). The rule:

* the candidates are the ready engines whose score is at most ``PREFIX_LOAD_SLACK`` above the least
  loaded engine's (8 queued requests, or 32 running, more): a hot prefix fills its engine only up
  to there, then its requests spill to the least-loaded engines, which then cache it too. The slack
  is wide on purpose: requests queued behind a cached prefix are cheap (their prefill is mostly
  hits), and a spilled request evicts another prefix where it lands (``bench prefix-routing``: a
  slack of 8 halved the hit rate, 32 kept it above 90 %);
* among them the one holding the longest leading run of the prompt's blocks wins; equal runs go to
  the lower score, then to the rotation, as with ``load``;
* an engine whose digest is unknown (none yet, or a gap being repaired) holds nothing; with no
  digest at all, or no block matched anywhere, this is exactly the ``load`` choice.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Optional

from gridserve.shared.errors import EngineDeadError, InvalidArgumentError
from gridserve.shared.load import EngineLoad
from gridserve.shared.prefix_digest import DigestUpdate, PrefixDigest

ROUTING_POLICIES = ("load", "prefix")
WAITING_WEIGHT = 4.0
# A completely full KV cache counts like this many extra queued requests (linear above one half).
KV_PENALTY = 16.0
# Prefix policy: how far above the least-loaded engine's score an engine may be and still get a
# request for the prefix it holds (8 queued requests).
PREFIX_LOAD_SLACK = 32.0
# Prefix policy: seconds the blocks of a prompt sent to an engine count as held there before its
# digest says so.
EXPECT_S = 10.0


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
    """Picks an engine index among ``num_engines`` (DP rank order); thread-safe. ``policy``: ``load``
    or ``prefix`` (module docstring)."""

    def __init__(self, num_engines: int, policy: str = "load", clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in ROUTING_POLICIES:
            raise InvalidArgumentError("routing_policy", f"must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        self.num_engines = num_engines
        self.policy = policy
        self.clock = clock
        self._lock = threading.Lock()
        self._rotation = itertools.count()
        self._reported: list[Optional[EngineLoad]] = [None] * num_engines
        self._sent = [0] * num_engines  # requests sent since the engine's last report
        self.routed = [0] * num_engines  # requests routed to each engine, ever (for tests and metrics)
        # Prefix policy: each engine's published digest (a copy), and the block keys this gateway
        # sent it lately -> until when they count as held there (oldest first).
        self.digests: list[Optional[PrefixDigest]] = [None] * num_engines
        self._expected: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(num_engines)]

    def on_report(self, rank: int, load: Optional[EngineLoad]) -> None:
        """A coordinator snapshot's entry for engine ``rank`` (None: the engine left the table)."""
        with self._lock:
            self._reported[rank] = load
            self._sent[rank] = 0

    # ---- prefix digests -------------------------------------------------------------------------
    def on_digest(self, rank: int, update: DigestUpdate) -> bool:
        """Engine ``rank``'s digest update; False on a gap (its copy is empty until a reset)."""
        with self._lock:
            copy = self.digests[rank]
            if copy is None:
                copy = self.digests[rank] = PrefixDigest(update.block_size, update.capacity, bound=0)
            expected = self._expected[rank]
            for key in update.removed:  # evicted: what this gateway expected there is gone
                expected.pop(key, None)
            return copy.apply(update)

    def forget_digest(self, rank: int) -> None:
        """Engine ``rank`` left the table (or the coordinator is gone): nothing known of its cache."""
        with self._lock:
            self.digests[rank] = None
            self._expected[rank].clear()

    @property
    def block_size(self) -> Optional[int]:
        """The block size prompts are hashed with (prefix policy, once an engine published a digest)."""
        if self.policy != "prefix":
            return None
        return next((d.block_size for d in self.digests if d is not None and d.known and d.block_size), None)

    # ---- choice ---------------------------------------------------------------------------------
    def choose(self, ready: list[bool], in_flight: list[int], data_parallel_rank: Optional[int] = None,
               prefix_keys: Sequence[int] = ()) -> int:
        """The engine for a new request among the ``ready`` ones (``in_flight``: this gateway's
        requests on each engine now); counts it as sent there. ``prefix_keys``: the digest keys of
        the prompt's full blocks, hashed with ``block_size`` (prefix policy)."""
        with self._lock:
            if data_parallel_rank is not None:
                rank = self._explicit(data_parallel_rank, ready)
            elif prefix_keys and self.policy == "prefix":
                rank = self._best_prefix(ready, in_flight, prefix_keys)
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

    def _order(self, ready: list[bool]) -> list[int]:
        """The ready engines from the rotating start index."""
        start = next(self._rotation) % self.num_engines
        order = [(start + offset) % self.num_engines for offset in range(self.num_engines)]
        return [rank for rank in order if ready[rank]]

    def _score(self, rank: int, in_flight: list[int]) -> float:
        return engine_score(self._reported[rank], self._sent[rank], in_flight[rank])

    def _best(self, ready: list[bool], in_flight: list[int]) -> int:
        best, best_score = -1, float("inf")
        for rank in self._order(ready):
            score = self._score(rank, in_flight)
            if score < best_score:
                best, best_score = rank, score
        if best < 0:
            raise EngineDeadError("no engine is available")
        return best

    def _best_prefix(self, ready: list[bool], in_flight: list[int], keys: Sequence[int]) -> int:
        scores = {rank: self._score(rank, in_flight) for rank in self._order(ready)}
        if not scores:
            raise EngineDeadError("no engine is available")
        ceiling = min(scores.values()) + PREFIX_LOAD_SLACK
        now = self.clock()
        best, best_key = -1, None
        for rank, score in scores.items():  # dicts keep the rotation's order
            if score > ceiling:
                continue
            key = (-self._held(rank, keys, now), score)
            if best_key is None or key < best_key:
                best, best_key = rank, key
        self._expect(best, keys, now)
        return best

    def _held(self, rank: int, keys: Sequence[int], now: float) -> int:
        """Leading ``keys`` engine ``rank`` holds: in its digest, or sent there lately."""
        digest = self.digests[rank]
        if digest is None or not digest.known or digest.block_size != self.block_size:
            return 0
        held, expected = digest.keys, self._expected[rank]
        for i, key in enumerate(keys):
            if key not in held and expected.get(key, 0.0) <= now:
                return i
        return len(keys)

    def _expect(self, rank: int, keys: Sequence[int], now: float) -> None:
        """The engine will hold ``keys`` once it ran the request: count them for ``EXPECT_S``
        (at most the engine's block count of them; the oldest go first)."""
        digest = self.digests[rank]
        if digest is None or not digest.known:
            return
        expected = self._expected[rank]
        until = now + EXPECT_S
        for key in keys:
            if key not in digest.keys:
                expected[key] = until
                expected.move_to_end(key)
        while expected and (len(expected) > digest.capacity or next(iter(expected.values())) <= now):
            expected.popitem(last=False)
