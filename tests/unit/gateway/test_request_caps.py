"""One request cannot take the engines for itself: ``--max-sequences-per-request`` caps ``n`` x the
prompts of a completions request, ``--max-prompt-tokens-per-request`` the prompt tokens it has in
the engines at once; beyond them it is HTTP 400 naming the field, and nothing reaches an engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from gridserve.services.gateway.limits import RequestLimits, add_limit_arguments
from gridserve.services.gateway.routes import OpenAIRoutes
from gridserve.services.gateway.service import GatewayService
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.sampling_params import SamplingParams
from tests.unit.gateway.fake_engine_client import FakeEngineClient
from tests.unit.gateway.test_gateway_admission import _Tokenizer


class _Engine(FakeEngineClient):
    """Finishes every request at once (or, with ``hold``, keeps them until aborted)."""

    def __init__(self, hold: bool = False) -> None:
        super().__init__("e")
        self.hold = hold

    async def add_request(self, request_id, token_ids, params, parent_request_id="", traceparent="",
                          mm_features=None, output_token_ids=None, continuation=False):
        self.added.append((request_id, len(token_ids)))
        if not self.hold:
            self.queues[request_id].put_nowait(
                EngineCoreOutput(request_id=request_id, new_token_ids=[1], finish_reason=FinishReason.LENGTH))


def _routes(engine: _Engine, **limits) -> OpenAIRoutes:
    return OpenAIRoutes(GatewayService(_Tokenizer(), [engine], "m", 64, 100, 20, limits=RequestLimits(**limits)), "m")


def _completion(prompt, n: int = 1, stream: bool = False) -> bytes:
    return json.dumps({"prompt": prompt, "n": n, "max_tokens": 1, "stream": stream}).encode()


def _error(response) -> dict:
    return json.loads(b"".join(response.chunks))["error"]


def test_the_caps_are_gateway_flags_with_room_for_the_widest_single_prompt_request():
    import argparse

    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    args = parser.parse_args(["--max-sequences-per-request", "8", "--max-prompt-tokens-per-request", "100"])
    limits = RequestLimits.from_args(args)
    assert (limits.max_sequences_per_request, limits.max_prompt_tokens_per_request) == (8, 100)
    assert limits.to_argv() == ["--max-sequences-per-request", "8", "--max-prompt-tokens-per-request", "100"]
    default = RequestLimits()
    assert default.max_sequences_per_request >= max(default.max_n, default.max_best_of)  # beam width fits too


def test_more_sequences_than_the_cap_is_400_naming_n_and_reaches_no_engine():
    async def go():
        engine = _Engine()
        routes = _routes(engine)
        for stream in (False, True):
            response = await routes.completions(_completion(["ab", "cd", "ef"], n=100, stream=stream))
            assert response.status == 400
            error = _error(response)
            assert error["param"] == "n" and "300" in error["message"] and "256" in error["message"]
            assert "--max-sequences-per-request" in error["message"]
        assert engine.added == []
        response = await routes.completions(_completion(["ab", "cd", "ef"], n=85))  # 255 sequences
        assert response.status == 200 and len(engine.added) == 255

    asyncio.run(go())


def test_prompt_tokens_in_flight_beyond_the_cap_are_400_naming_prompt_and_leave_nothing_behind():
    async def go():
        engine = _Engine(hold=True)
        routes = _routes(engine, max_prompt_tokens_per_request=40)
        response = await asyncio.wait_for(routes.completions(_completion(["a" * 15, "b" * 15, "c" * 15])), 10)
        assert response.status == 400
        error = _error(response)
        assert error["param"] == "prompt" and "--max-prompt-tokens-per-request" in error["message"]
        await asyncio.sleep(0.05)
        assert len(engine.added) <= 2 and sorted(engine.aborted) == sorted(rid for rid, _ in engine.added)
        assert routes.service.in_flight == 0

    asyncio.run(go())


def test_one_prompt_longer_than_the_cap_still_runs_and_prompts_streamed_one_by_one_fit():
    async def go():
        engine = _Engine()
        routes = _routes(engine, max_prompt_tokens_per_request=40)
        response = await routes.completions(_completion("a" * 50))  # max_model_len bounds a lone prompt
        assert response.status == 200
        response = await routes.completions(_completion(["a" * 30, "b" * 30], stream=True))
        assert response.status == 200  # streamed prompts run one after the other: 30 in flight at most
        assert [c async for c in response.chunks][-1].strip() == b"data: [DONE]"

    asyncio.run(go())


def test_the_typed_api_s_one_prompt_request_is_capped_by_n():
    async def go():
        service = GatewayService(_Tokenizer(), [_Engine()], "m", 64, 100, 20,
                                 limits=RequestLimits(max_sequences_per_request=4))
        with pytest.raises(InvalidArgumentError, match="--max-sequences-per-request") as error:
            await service.complete("hi", SamplingParams(max_tokens=1, n=5))
        assert error.value.field == "n"
        assert len((await service.complete("hi", SamplingParams(max_tokens=1, n=4))).outputs) == 4

    asyncio.run(go())
