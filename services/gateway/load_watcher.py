"""``LoadWatcher``: the gateway's subscription to the coordinator's load snapshots.

Each engine's entry goes to the ``Router`` by DP rank (the gateway's ``--engines`` list is in rank
order, so the engines' own bind addresses never need to match the names gateways reach them by); an
engine missing from a snapshot (it stopped reporting), or every engine while the coordinator is
unreachable, is forgotten, so the router falls back to this gateway's own in-flight counts for it.
An entry's prefix-cache digest update goes to the router too; one that does not follow the copy the
router has (a gap: never on one ordered stream, but cheap to repair) ends the stream, and the next
one starts with every digest in full. ``wave`` is the coordinator's current request wave (MoE
lockstep). Create it on the gateway's event loop, where the subscription runs.
"""

from __future__ import annotations

from gridserve.api.coordinator.v1 import coordinator_pb2
from gridserve.services.gateway.router import Router
from gridserve.shared.load import EngineLoad
from gridserve.shared.rpc.coordinator_client import LoadSubscription
from gridserve.shared.rpc.digest_convert import digest_from_pb


class DigestGap(RuntimeError):
    """A digest update that does not follow the router's copy: the watch starts over."""


class LoadWatcher:
    def __init__(self, address: str, subscriber_id: str, router: Router) -> None:
        self.address = address
        self.router = router
        self.wave = 0
        self.snapshots = 0
        self._subscription = LoadSubscription(address, subscriber_id, self._apply, on_lost=self._forget_all,
                                              name="load-watcher")

    def _apply(self, snapshot: coordinator_pb2.WatchLoadResponse) -> None:
        seen = set()
        gaps = []
        for load in snapshot.engines:
            rank = load.dp_rank  # the gateway's --engines are in DP rank order
            if rank >= self.router.num_engines:
                continue
            seen.add(rank)
            self.router.on_report(rank, EngineLoad(load.num_waiting, load.num_running, load.kv_cache_usage))
            digest = digest_from_pb(load)
            if digest is not None and not self.router.on_digest(rank, digest):
                gaps.append(rank)
        for rank in set(range(self.router.num_engines)) - seen:
            self.router.on_report(rank, None)
            self.router.forget_digest(rank)
        self.wave = snapshot.wave
        self.snapshots += 1
        if gaps:
            raise DigestGap(f"prefix digests of engines {gaps} do not follow this gateway's copies")

    def _forget_all(self) -> None:
        for rank in range(self.router.num_engines):
            self.router.on_report(rank, None)
            self.router.forget_digest(rank)

    async def close(self) -> None:
        await self._subscription.close()
