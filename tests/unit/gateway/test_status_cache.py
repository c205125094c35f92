"""``GET /v1/status`` costs one fan-out however many ask: concurrent callers share the snapshot being
taken, and a snapshot serves every caller for ``cache_s`` seconds after it was taken."""

from __future__ import annotations

import asyncio

from gridserve.services.gateway.status import StatusCollector


class _CountingCollector(StatusCollector):
    """A collector whose every RPC (health, GetLoad, GetStatus) is counted and answers nothing."""

    def __init__(self, **kwargs) -> None:
        super().__init__("gw:1", ["e0:1", "e1:1"], "coord:1", lambda: True, lambda i: True, **kwargs)
        self.calls = 0

    async def _call(self, method, request):
        self.calls += 1
        await asyncio.sleep(0.05)  # the engines take a while to answer
        return None


CALLS_PER_FAN_OUT = 1 + 2 * 3  # the coordinator's health; each engine's health, GetLoad and GetStatus


def test_concurrent_status_calls_share_one_fan_out():
    async def go():
        collector = _CountingCollector()
        snapshots = await asyncio.gather(*(collector.snapshot() for _ in range(20)))
        assert collector.calls == CALLS_PER_FAN_OUT
        assert all(s is snapshots[0] for s in snapshots)
        assert [r.health for r in snapshots[0].roles] == ["SERVING", "UNREACHABLE", "UNREACHABLE", "UNREACHABLE"]

    asyncio.run(go())


def test_a_snapshot_is_reused_for_cache_s_then_taken_again():
    async def go():
        collector = _CountingCollector(cache_s=0.3)
        first = await collector.snapshot()
        assert await collector.snapshot() is first and collector.calls == CALLS_PER_FAN_OUT
        await asyncio.sleep(0.35)
        assert await collector.snapshot() is not first
        assert collector.calls == 2 * CALLS_PER_FAN_OUT

    asyncio.run(go())


def test_a_caller_that_goes_away_does_not_cancel_the_others():
    async def go():
        collector = _CountingCollector()
        leaving = asyncio.ensure_future(collector.snapshot())
        staying = asyncio.ensure_future(collector.snapshot())
        await asyncio.sleep(0.01)
        leaving.cancel()
        snapshot = await staying
        assert snapshot.roles and collector.calls == CALLS_PER_FAN_OUT

    asyncio.run(go())
