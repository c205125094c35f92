"""Engine failover in ``GatewayService`` with fake engine clients: a sample whose engine's stream
broke continues on a live engine as a continuation (same id, the tokens so far as output, same
seed), the client sees every token once, ``n > 1`` samples move one by one, stale news is
ignored, and without a live engine the request ends with ``EngineDeadError``."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from gridserve.services.gateway.observability import GatewayMetrics
from gridserve.services.gateway.service import GatewayService
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.rpc.engine_client import EngineLostError
from gridserve.shared.sampling_params import SamplingParams
from tests.unit.gateway.fake_engine_client import FakeEngineClient


class _Tokenizer:
    eos_token_id = None

    def __init__(self) -> None:
        vocab = {chr(65 + i): i for i in range(26)}
        self.backend_tokenizer = Tokenizer(WordLevel(vocab, unk_token="A"))
        self.backend_tokenizer.pre_tokenizer = Whitespace()

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 26 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return self.backend_tokenizer.decode(ids)


class _Engine(FakeEngineClient):
    def __init__(self, name: str) -> None:
        super().__init__(name, sessions=1)
        self.added: list[tuple] = []  # (request_id, params, output_token_ids, continuation)

    async def add_request(self, request_id, token_ids, params, parent_request_id="", traceparent="",
                          mm_features=None, output_token_ids=None, continuation=False):
        if not self.ready.is_set():
            raise EngineDeadError(f"engine {self.address} is not reachable")
        self.added.append((request_id, params, output_token_ids, continuation))

    def emit(self, request_id, *tokens, finished=False):
        out = EngineCoreOutput(request_id=request_id, new_token_ids=list(tokens),
                               finish_reason=FinishReason.LENGTH if finished else None)
        self.queues[request_id].put_nowait(out)

    def die(self):
        """What ``EngineClient`` does when the output stream breaks."""
        self.ready.clear()
        for request_id, queue in list(self.queues.items()):
            queue.put_nowait(EngineLostError(f"engine {self.address}: gone", self, request_id, self.sessions))


async def _until(predicate, task=None):
    for _ in range(500):
        if predicate():
            return
        if task is not None and task.done():
            task.result()
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def _collect(stream) -> list:
    return [chunk async for chunk in stream]


def _setup():
    a, b = _Engine("a:1"), _Engine("b:1")
    service = GatewayService(_Tokenizer(), [a, b], "m", 64, 26, 20, metrics=GatewayMetrics("m"))
    return service, a, b


def _failovers(service, engine: str) -> float:
    value = service.metrics.registry.get_sample_value("gridserve:engine_failovers_total",
                                                      {"model_name": "m", "engine": engine})
    return value or 0.0


def _tokens(chunks, index=0) -> list[int]:
    return [t for c in chunks for d in c.deltas if d.index == index for t in d.token_ids]


def _text(chunks, index=0) -> str:
    return "".join(d.text for c in chunks for d in c.deltas if d.index == index)


def test_a_sample_continues_on_the_live_engine_with_its_tokens_and_seed():
    async def go():
        service, a, b = _setup()
        b.ready.clear()  # the request goes to a
        task = asyncio.ensure_future(_collect(service.generate("hi", SamplingParams(max_tokens=6))))
        await _until(lambda: a.added, task)
        rid, params, _, _ = a.added[0]
        assert params.seed is not None  # drawn by the gateway for an unseeded sampled request
        a.emit(rid, 1, 2)
        a.emit(rid, 3)
        b.ready.set()
        a.die()
        await _until(lambda: b.added, task)
        cont_id, cont_params, done, continuation = b.added[0]
        assert (cont_id, done, continuation, cont_params.seed) == (rid, [1, 2, 3], True, params.seed)
        assert rid not in a.queues and rid in a.aborted  # in case only the stream broke
        b.emit(rid, 4, 5)
        b.emit(rid, 6, finished=True)
        chunks = await task
        final = chunks[-1].final
        assert _tokens(chunks) == [1, 2, 3, 4, 5, 6] == final.outputs[0].token_ids
        assert _text(chunks) == final.outputs[0].text == "B C D E F G"
        assert (service.in_flight, a.num_in_flight, b.num_in_flight) == (0, 0, 0)
        assert (_failovers(service, "0"), _failovers(service, "1")) == (1.0, 0.0)

    asyncio.run(go())


def test_greedy_requests_get_no_seed():
    async def go():
        service, a, b = _setup()
        task = asyncio.ensure_future(_collect(service.generate("hi", SamplingParams(temperature=0, max_tokens=2))))
        engine = await _first_added(a, b, task)
        assert engine.added[0][1].seed is None
        engine.emit(engine.added[0][0], 1, 2, finished=True)
        await task

    asyncio.run(go())


async def _first_added(a, b, task):
    await _until(lambda: a.added or b.added, task)
    return a if a.added else b


def test_n_samples_fail_over_independently():
    async def go():
        service, a, b = _setup()
        b.ready.clear()
        task = asyncio.ensure_future(_collect(service.generate("hi", SamplingParams(n=2, seed=7, max_tokens=4))))
        await _until(lambda: len(a.added) == 2, task)
        (c0, p0, _, _), (c1, p1, _, _) = a.added
        a.emit(c0, 1, 2)
        a.emit(c1, 9)
        a.emit(c1, 8, 7, 6, finished=True)  # sample 1 finishes before the engine dies
        b.ready.set()
        a.die()
        await _until(lambda: b.added, task)
        await asyncio.sleep(0.05)
        assert [(r, d, c, p.seed) for r, p, d, c in b.added] == [(c0, [1, 2], True, p0.seed)]
        b.emit(c0, 3, 4, finished=True)
        chunks = await task
        assert _tokens(chunks, 0) == [1, 2, 3, 4] and _tokens(chunks, 1) == [9, 8, 7, 6]
        assert [o.token_ids for o in chunks[-1].final.outputs] == [[1, 2, 3, 4], [9, 8, 7, 6]]

    asyncio.run(go())


def test_stale_news_of_an_older_stream_is_ignored():
    async def go():
        service, a, b = _setup()
        b.ready.clear()
        task = asyncio.ensure_future(_collect(service.generate("hi", SamplingParams(max_tokens=3))))
        await _until(lambda: a.added, task)
        rid = a.added[0][0]
        a.queues[rid].put_nowait(EngineLostError("old", a, rid, a.sessions - 1))
        a.emit(rid, 1, 2, 3, finished=True)
        chunks = await task
        assert _tokens(chunks) == [1, 2, 3] and len(a.added) == 1 and not b.added

    asyncio.run(go())


def test_without_a_live_engine_the_request_fails(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_FAILOVER_TIMEOUT_S", "0.2")

    async def go():
        service, a, b = _setup()
        b.ready.clear()
        task = asyncio.ensure_future(_collect(service.generate("hi", SamplingParams(max_tokens=3))))
        await _until(lambda: a.added, task)
        a.emit(a.added[0][0], 1)
        a.die()
        with pytest.raises(EngineDeadError):
            await task
        assert service.in_flight == 0

    asyncio.run(go())


def test_an_engine_that_dies_during_add_request_is_failed_over_too():
    async def go():
        service, a, b = _setup()
        real_add = a.add_request

        async def dying_add(*args, **kwargs):
            a.ready.clear()
            return await real_add(*args, **kwargs)

        a.add_request = dying_add
        b.ready.clear()
        task = asyncio.ensure_future(_collect(service.generate("hi", SamplingParams(max_tokens=2))))
        await asyncio.sleep(0.1)
        b.ready.set()
        await _until(lambda: b.added, task)
        rid, _, done, continuation = b.added[0]
        assert (done, continuation) == ([], True)
        b.emit(rid, 5, 6, finished=True)
        assert _tokens(await task) == [5, 6]

    asyncio.run(go())
