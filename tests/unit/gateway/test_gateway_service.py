"""``GatewayService`` on its asyncio loop with a fake engine client: in-flight counts stay right
whenever the caller leaves (during tokenization, mid-stream), and a finished request's result."""

from __future__ import annotations

import asyncio
import threading

from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from gridserve.services.gateway.service import GatewayService
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.sampling_params import SamplingParams


class _SlowTokenizer:
    """Tokenizes only once ``release`` is set (the test holds a request inside tokenization)."""

    eos_token_id = None

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        vocab = {chr(65 + i): i for i in range(26)}
        self.backend_tokenizer = Tokenizer(WordLevel(vocab, unk_token="A"))

    def encode(self, text, add_special_tokens=True):
        self.started.set()
        self.release.wait(10)
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return self.backend_tokenizer.decode(ids)


class _FakeEngine:
    """An engine client that records calls; ``emit`` plays an engine output."""

    address = "fake:1"
    sessions = 0

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.ready.set()
        self.serving = True
        self.recovering = False
        self.queues: dict = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.loop = asyncio.get_running_loop()  # as the asyncio client: built on the server's loop

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    def register(self, request_id, outputs):
        self.queues[request_id] = outputs

    def unregister(self, request_id):
        self.queues.pop(request_id, None)

    async def add_request(self, request_id, token_ids, params, parent_request_id="", traceparent="", mm_features=None):
        self.added.append(request_id)

    async def abort(self, request_ids):
        self.aborted += request_ids

    def emit(self, request_id, token, finished=False):
        out = EngineCoreOutput(request_id=request_id, new_token_ids=[token],
                               finish_reason=FinishReason.LENGTH if finished else None)
        self.queues[request_id].put_nowait(out)


def _service():
    tokenizer, engine = _SlowTokenizer(), _FakeEngine()
    return GatewayService(tokenizer, [engine], "m", 64, 100, 20), tokenizer, engine


async def _consume(stream) -> list:
    return [chunk async for chunk in stream]


async def _until_added(engine: _FakeEngine, task: asyncio.Future) -> None:
    while not engine.added:
        if task.done():
            task.result()  # raises what ended it
        await asyncio.sleep(0.01)


def test_a_client_leaving_during_tokenization_leaves_no_in_flight_count_behind():
    async def go():
        service, tokenizer, engine = _service()
        task = asyncio.ensure_future(_consume(service.generate("hello", SamplingParams(max_tokens=4))))
        await asyncio.to_thread(tokenizer.started.wait, 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        tokenizer.release.set()
        await asyncio.sleep(0.1)  # tokenization ends in the pool after the caller left
        assert (service.in_flight, engine.num_in_flight, engine.added) == (0, 0, [])

    asyncio.run(go())


def test_a_client_leaving_mid_stream_aborts_its_engine_request_and_counts_return_to_zero():
    async def go():
        service, tokenizer, engine = _service()
        tokenizer.release.set()
        stream = service.generate("hi", SamplingParams(max_tokens=4))
        task = asyncio.ensure_future(_consume(stream))
        await _until_added(engine, task)
        assert (service.in_flight, engine.num_in_flight) == (1, 1)
        engine.emit(engine.added[0], 3)
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)
        assert (service.in_flight, engine.num_in_flight) == (0, 0)
        assert engine.aborted == engine.added

    asyncio.run(go())


def test_a_finished_request_returns_its_tokens_and_text():
    async def go():
        service, tokenizer, engine = _service()
        tokenizer.release.set()
        task = asyncio.ensure_future(service.complete("hi", SamplingParams(max_tokens=2)))
        await _until_added(engine, task)
        engine.emit(engine.added[0], 1)
        engine.emit(engine.added[0], 2, finished=True)
        out = await task
        assert out.outputs[0].token_ids == [1, 2] and out.outputs[0].text == tokenizer.decode([1, 2])
        assert out.outputs[0].finish_reason == "length"
        assert (service.in_flight, engine.num_in_flight, engine.aborted) == (0, 0, [])

    asyncio.run(go())


def test_seeded_samples_wrap_within_the_engines_64_bit_seed():
    from gridserve.services.gateway.processor import child_requests

    children = child_requests("r", SamplingParams(n=2, seed=2**63 - 1))
    assert [params.seed for _, _, params in children] == [2**63 - 1, -(2**63)]


def test_a_request_the_engine_ended_with_an_error_raises_it_and_leaves_nothing_behind():
    from gridserve.services.gateway.api_errors import to_api_error
    from gridserve.shared.errors import RequestFailedError
    from gridserve.shared.rpc.errors import status_for

    async def go():
        service, tokenizer, engine = _service()
        tokenizer.release.set()
        task = asyncio.ensure_future(_consume(service.generate("hi", SamplingParams(max_tokens=4))))
        await _until_added(engine, task)
        engine.emit(engine.added[0], 3)
        engine.queues[engine.added[0]].put_nowait(EngineCoreOutput(
            engine.added[0], [], finish_reason=FinishReason.ERROR, error="structured outputs: broken"))
        error = (await asyncio.gather(task, return_exceptions=True))[0]
        assert isinstance(error, RequestFailedError) and "structured outputs: broken" in str(error)
        assert (service.in_flight, engine.num_in_flight) == (0, 0)
        assert status_for(error)[0].name == "INTERNAL" and "broken" in status_for(error)[1]
        api = to_api_error(error)
        assert api.status == 500 and "structured outputs: broken" in api.message

    asyncio.run(go())
