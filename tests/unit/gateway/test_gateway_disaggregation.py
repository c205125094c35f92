"""Disaggregated prefill / decode in ``GatewayService`` with fake engine clients that report a
``kv_role``: a request runs prefill-only on the prefill engine, its first token reaches the client
once, and it continues on a decode engine with the prefill engine's ``KVTransferParams``; a prefill
engine lost before it answers sends the request to a decode engine whole; requests that cannot be
split, and deployments without both pools up, are served whole on the decode pool."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from gridserve.services.gateway.service import GatewayService
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.kv_transfer import KVLayout, KVTransferParams
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.rpc.engine_client import EngineLostError
from gridserve.shared.sampling_params import SamplingParams
from tests.unit.gateway.fake_engine_client import FakeEngineClient
from tests.unit.gateway.test_gateway_failover import _collect, _Tokenizer, _tokens, _until

PARAMS = KVTransferParams("t-1", "secret", ("w:1",), (4, 9), 5, 1e12, 16, "auto", "m")


class _Engine(FakeEngineClient):
    def __init__(self, name: str, kv_role: str) -> None:
        super().__init__(name, sessions=1)
        self.kv_role = kv_role
        self.added: list[dict] = []

    async def add_request(self, request_id, token_ids, params, output_token_ids=None, continuation=False,
                          prefill_only=False, kv_transfer_params=None, **_):
        if not self.ready.is_set():
            raise EngineDeadError(f"engine {self.address} is not reachable")
        self.added.append({"id": request_id, "output": output_token_ids, "continuation": continuation,
                           "prefill_only": prefill_only, "kv": kv_transfer_params})

    def emit(self, request_id, *tokens, finish=None, kv=None):
        self.queues[request_id].put_nowait(EngineCoreOutput(request_id, list(tokens), finish_reason=finish,
                                                            kv_transfer_params=kv))

    def die(self):
        self.ready.clear()
        for request_id, queue in list(self.queues.items()):
            queue.put_nowait(EngineLostError(f"engine {self.address}: gone", self, request_id, self.sessions))


def _setup():
    p, d1, d2 = _Engine("p:1", "kv_producer"), _Engine("d:1", "kv_consumer"), _Engine("d:2", "kv_consumer")
    return GatewayService(_Tokenizer(), [p, d1, d2], "m", 64, 26, 20), p, d1, d2


def _greedy(max_tokens: int = 4, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_prefill_then_decode_with_the_transfer_params_the_first_token_once():
    async def go():
        service, p, d1, d2 = _setup()
        task = asyncio.ensure_future(_collect(service.generate("hi", _greedy())))
        await _until(lambda: p.added, task)
        rid = p.added[0]["id"]
        assert p.added[0]["prefill_only"] and p.added[0]["kv"] is None
        p.emit(rid, 7, finish=FinishReason.LENGTH, kv=PARAMS)
        await _until(lambda: d1.added or d2.added, task)
        decoder = d1 if d1.added else d2
        assert decoder.added == [{"id": rid, "output": [7], "continuation": True, "prefill_only": False,
                                  "kv": PARAMS}]
        assert rid not in p.queues  # the prefill engine's part is over
        decoder.emit(rid, 8, 9)
        decoder.emit(rid, 10, finish=FinishReason.LENGTH)
        chunks = await task
        assert _tokens(chunks) == [7, 8, 9, 10] == chunks[-1].final.outputs[0].token_ids
        assert chunks[-1].final.outputs[0].finish_reason == "length"
        assert (service.in_flight, p.num_in_flight, decoder.num_in_flight) == (0, 0, 0)

    asyncio.run(go())


def test_a_request_the_prefill_engine_ends_by_its_own_rule_never_reaches_a_decode_engine():
    async def go():
        service, p, d1, d2 = _setup()
        task = asyncio.ensure_future(_collect(service.generate("hi", _greedy(max_tokens=1))))
        await _until(lambda: p.added, task)
        p.emit(p.added[0]["id"], 7, finish=FinishReason.LENGTH)  # no params: it is done
        chunks = await task
        assert _tokens(chunks) == [7] and not d1.added and not d2.added

    asyncio.run(go())


def test_a_prefill_engine_lost_before_it_answers_sends_the_request_to_a_decode_engine_whole():
    async def go():
        service, p, d1, d2 = _setup()
        task = asyncio.ensure_future(_collect(service.generate("hi", _greedy(max_tokens=2))))
        await _until(lambda: p.added, task)
        rid = p.added[0]["id"]
        p.die()
        await _until(lambda: d1.added or d2.added, task)
        decoder = d1 if d1.added else d2
        assert decoder.added[0]["kv"] is None and decoder.added[0]["output"] == []
        decoder.emit(rid, 1, 2, finish=FinishReason.LENGTH)
        assert _tokens(await task) == [1, 2]

    asyncio.run(go())


def test_a_decode_engine_lost_mid_stream_continues_on_the_other_decode_engine():
    async def go():
        service, p, d1, d2 = _setup()
        task = asyncio.ensure_future(_collect(service.generate("hi", _greedy(max_tokens=4))))
        await _until(lambda: p.added, task)
        rid = p.added[0]["id"]
        p.emit(rid, 7, finish=FinishReason.LENGTH, kv=PARAMS)
        await _until(lambda: d1.added or d2.added, task)
        first, other = (d1, d2) if d1.added else (d2, d1)
        first.emit(rid, 8)
        await asyncio.sleep(0.02)
        first.die()
        await _until(lambda: other.added, task)
        assert other.added[0]["output"] == [7, 8] and other.added[0]["kv"] is None  # not the prefill engine
        assert not p.added[1:]
        other.emit(rid, 9, 10, finish=FinishReason.LENGTH)
        assert _tokens(await task) == [7, 8, 9, 10]

    asyncio.run(go())


def test_unsplittable_requests_and_a_missing_pool_are_served_whole_by_decode_engines():
    async def go():
        service, p, d1, d2 = _setup()
        for params in (_greedy(prompt_logprobs=1), _greedy()):
            if params.prompt_logprobs is None:
                p.serving = False  # the prefill engine is not READY: no split
            task = asyncio.ensure_future(_collect(service.generate("hi", params)))
            await _until(lambda: len(d1.added) + len(d2.added) == 1, task)
            decoder = d1 if d1.added else d2
            assert not p.added and not decoder.added[0]["prefill_only"]
            decoder.emit(decoder.added[0]["id"], 1, finish=FinishReason.LENGTH)
            await task
            d1.added.clear()
            d2.added.clear()

    asyncio.run(go())


LAYOUT = KVLayout(block_size=16, kv_cache_dtype="auto", model="m")


def test_a_prefilled_request_goes_only_to_a_decode_engine_whose_kv_layout_pairs(caplog):
    async def go():
        service, p, d1, d2 = _setup()
        p.kv_layout, d1.kv_layout = LAYOUT, replace(LAYOUT, kv_cache_dtype="bfloat16")
        d2.kv_layout = LAYOUT
        for _ in range(3):  # the load router would spread them; the pairing keeps them off d1
            task = asyncio.ensure_future(_collect(service.generate("hi", _greedy())))
            await _until(lambda: len(p.added) == len(d2.added) + 1, task)
            rid = p.added[-1]["id"]
            p.emit(rid, 7, finish=FinishReason.LENGTH, kv=PARAMS)
            await _until(lambda rid=rid: d2.added and d2.added[-1]["id"] == rid, task)
            d2.emit(rid, 8, finish=FinishReason.LENGTH)
            assert _tokens(await task) == [7, 8]
        assert not d1.added and [a["kv"] for a in d2.added] == [PARAMS] * 3
        assert sum("cannot pair (kv_cache_dtype: prefill 'auto', decode 'bfloat16')" in r.message
                   for r in caplog.records) == 1  # logged once per pair

    asyncio.run(go())


def test_without_a_decode_engine_that_pairs_requests_are_not_split():
    async def go():
        service, p, d1, d2 = _setup()
        p.kv_layout = LAYOUT
        d1.kv_layout = d2.kv_layout = replace(LAYOUT, tensor_parallel_size=2, world_size=2)
        task = asyncio.ensure_future(_collect(service.generate("hi", _greedy())))
        await _until(lambda: d1.added or d2.added, task)
        decoder = d1 if d1.added else d2
        assert not p.added and decoder.added[0]["kv"] is None and not decoder.added[0]["prefill_only"]
        decoder.emit(decoder.added[0]["id"], 5, finish=FinishReason.LENGTH)
        assert _tokens(await task) == [5]

    asyncio.run(go())


def test_a_stop_string_on_the_first_token_releases_the_prefill_engine_s_blocks_at_once():
    async def go():
        service, p, d1, d2 = _setup()
        task = asyncio.ensure_future(_collect(service.generate("hi", _greedy(stop=["H"]))))
        await _until(lambda: p.added, task)
        rid = p.added[0]["id"]
        p.emit(rid, 7, finish=FinishReason.LENGTH, kv=PARAMS)  # token 7 is "H": the stop string
        chunks = await task
        assert chunks[-1].final.outputs[0].finish_reason == "stop" and not d1.added and not d2.added
        await _until(lambda: p.aborted)
        assert p.aborted == [rid]  # the abort of the held request frees its KV on the prefill engine

    asyncio.run(go())


def test_a_client_gone_after_the_hand_off_aborts_on_the_decode_and_the_prefill_engine():
    async def go():
        service, p, d1, d2 = _setup()
        stream = service.generate("hi", _greedy(max_tokens=8))
        pending = asyncio.ensure_future(stream.__anext__())
        await _until(lambda: p.added, pending)
        rid = p.added[0]["id"]
        p.emit(rid, 7, finish=FinishReason.LENGTH, kv=PARAMS)
        first = await pending
        assert _tokens([first]) == [7]
        decoder = d1 if d1.added else d2
        assert decoder.added[0]["kv"] == PARAMS
        await stream.aclose()  # the client went away before the decode engine pulled
        await _until(lambda: p.aborted and decoder.aborted)
        assert p.aborted == decoder.aborted == [rid]

    asyncio.run(go())


def test_a_request_that_completes_on_the_decode_engine_aborts_nothing():
    async def go():
        service, p, d1, d2 = _setup()
        task = asyncio.ensure_future(_collect(service.generate("hi", _greedy(max_tokens=2))))
        await _until(lambda: p.added, task)
        rid = p.added[0]["id"]
        p.emit(rid, 7, finish=FinishReason.LENGTH, kv=PARAMS)
        await _until(lambda: d1.added or d2.added, task)
        (d1 if d1.added else d2).emit(rid, 8, finish=FinishReason.LENGTH)
        assert _tokens(await task) == [7, 8]
        await asyncio.sleep(0.05)
        assert not p.aborted and not d1.aborted and not d2.aborted

    asyncio.run(go())
