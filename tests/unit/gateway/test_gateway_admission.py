"""``GatewayService`` admission and deadlines with fake engine clients: a refused add goes to the
next engine, every engine full is ``ResourceExhaustedError`` (HTTP 429 with ``Retry-After``), an
engine that is not READY gets nothing, and a request past its deadline is aborted
(``DeadlineExceededError``, HTTP 504) with the gateway's counts back at zero."""

from __future__ import annotations

import asyncio
import time

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from gridserve.services.gateway.api_errors import to_api_error
from gridserve.services.gateway.limits import RequestLimits
from gridserve.services.gateway.service import GatewayService
from gridserve.shared.errors import (
    DeadlineExceededError,
    EngineDeadError,
    FailedPreconditionError,
    ResourceExhaustedError,
)
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.sampling_params import SamplingParams
from tests.unit.gateway.fake_engine_client import FakeEngineClient


class _Tokenizer:
    eos_token_id = None

    def __init__(self) -> None:
        self.backend_tokenizer = Tokenizer(WordLevel({chr(65 + i): i for i in range(26)}, unk_token="A"))

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return self.backend_tokenizer.decode(ids)


class _Engine(FakeEngineClient):
    """An engine client whose queue is ``full`` or not; records adds and aborts."""

    def __init__(self, name: str, full: bool = False, serving: bool = True) -> None:
        super().__init__(name, serving=serving)
        self.full = full

    async def add_request(self, request_id, token_ids, params, parent_request_id="", traceparent="",
                          mm_features=None, output_token_ids=None, continuation=False):
        if not self.serving:
            raise FailedPreconditionError(f"{self.address} is sleeping")
        if self.full:
            raise ResourceExhaustedError(f"{self.address} is full")
        self.added.append(request_id)

    def finish(self, request_id):
        self.queues[request_id].put_nowait(
            EngineCoreOutput(request_id=request_id, new_token_ids=[1], finish_reason=FinishReason.LENGTH))


def _service(engines, **limits) -> GatewayService:
    return GatewayService(_Tokenizer(), engines, "m", 64, 100, 20, limits=RequestLimits(**limits))


async def _until_added(engine: _Engine, task: asyncio.Future) -> None:
    while not engine.added:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)


def test_a_full_engine_passes_the_request_to_the_next_one():
    async def go():
        full, free = _Engine("full", full=True), _Engine("free")
        service = _service([full, free])
        service.router._rotation = iter(range(0, 1000, 2))  # every choice starts at the full engine
        task = asyncio.ensure_future(service.complete("hi", SamplingParams(max_tokens=1)))
        await _until_added(free, task)
        assert full.added == [] and full.num_in_flight == 0
        free.finish(free.added[0])
        out = await task
        assert out.outputs[0].finish_reason == "length"
        assert (service.in_flight, free.num_in_flight, full.aborted, free.aborted) == (0, 0, [], [])

    asyncio.run(go())


def test_every_engine_full_is_resource_exhausted_and_leaves_nothing_behind():
    async def go():
        engines = [_Engine("a", full=True), _Engine("b", full=True)]
        service = _service(engines)
        with pytest.raises(ResourceExhaustedError, match="every engine's queue is full"):
            await service.complete("hi", SamplingParams(max_tokens=1, n=2))
        assert service.in_flight == 0
        assert [(e.num_in_flight, e.added, e.aborted) for e in engines] == [(0, [], [])] * 2

    asyncio.run(go())


def test_a_pinned_request_on_a_full_engine_is_refused_without_moving():
    async def go():
        full, free = _Engine("full", full=True), _Engine("free")
        service = _service([full, free])
        with pytest.raises(ResourceExhaustedError):
            await service.complete("hi", SamplingParams(max_tokens=1), data_parallel_rank=0)
        assert free.added == []

    asyncio.run(go())


def test_an_engine_that_is_not_ready_gets_no_new_request_while_another_is():
    async def go():
        sleeping, ready = _Engine("sleeping", serving=False), _Engine("ready")
        service = _service([sleeping, ready])
        for _ in range(4):
            task = asyncio.ensure_future(service.complete("hi", SamplingParams(max_tokens=1)))
            await _until_added(ready, task)
            ready.finish(ready.added.pop())
            await task
        assert sleeping.added == []
        # None is READY: a reachable one gets the request and says why it cannot serve it.
        ready.serving = False
        with pytest.raises(FailedPreconditionError, match="sleeping"):
            await service.complete("hi", SamplingParams(max_tokens=1))
        assert service.in_flight == 0 and not service.is_ready()
        for engine in (sleeping, ready):
            engine.ready.clear()  # and none reachable: no engine at all
        with pytest.raises(EngineDeadError, match="no engine is available"):
            await service.complete("hi", SamplingParams(max_tokens=1))

    asyncio.run(go())


def test_a_gateway_whose_engines_only_recover_stays_ready_and_a_sleeping_one_does_not():
    """A RECOVERING engine queues what it is sent while its workers are rebuilt (the request pauses,
    as streams do); a SLEEPING one refuses. Only the first keeps the gateway ready for the edge."""
    async def go():
        engine = _Engine("e", serving=False)
        service = _service([engine])
        assert not service.is_ready()  # not ready, and not recovering: sleeping, loading, draining
        engine.recovering = True
        assert service.is_ready()
        engine.ready.clear()  # unreachable: nothing can take it
        assert not service.is_ready()

    asyncio.run(go())


@pytest.mark.parametrize("caller, server", [(0.3, 600.0), (None, 0.3), (5.0, 0.3)])
def test_a_request_past_its_deadline_is_aborted_and_counts_return_to_zero(caller, server):
    async def go():
        engine = _Engine("slow")  # never answers
        service = _service([engine], request_timeout=server)
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="deadline"):
            await service.complete("hi", SamplingParams(max_tokens=8), timeout=caller)
        assert 0.25 < time.monotonic() - start < 2.0
        await asyncio.sleep(0.05)  # the abort is sent without waiting
        assert engine.aborted == engine.added and len(engine.added) == 1
        assert (service.in_flight, engine.num_in_flight) == (0, 0)

    asyncio.run(go())


def test_a_request_that_finishes_in_time_cancels_its_deadline():
    async def go():
        engine = _Engine("fast")
        service = _service([engine], request_timeout=0.2)
        task = asyncio.ensure_future(service.complete("hi", SamplingParams(max_tokens=1)))
        await _until_added(engine, task)
        engine.finish(engine.added[0])
        await task
        await asyncio.sleep(0.3)  # past the deadline: nothing fires, nothing is aborted
        assert engine.aborted == [] and service.in_flight == 0

    asyncio.run(go())


def test_refusals_and_deadlines_have_their_http_status_in_openai_shape():
    full = to_api_error(ResourceExhaustedError("every engine's queue is full", retry_after_s=2))
    assert (full.status, full.type, full.headers) == (429, "RateLimitError", {"retry-after": "2"})
    late = to_api_error(DeadlineExceededError("the request did not finish within its deadline"))
    assert (late.status, late.type) == (504, "TimeoutError")
    assert b'"code":504' in late.body().replace(b" ", b"")
