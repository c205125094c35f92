"""``AsyncLLM`` with the engine in process and remote: the same outputs as ``LLM``; abort frees blocks."""

from __future__ import annotations

import asyncio

import pytest

from gridserve import LLM, AsyncLLM, SamplingParams
from gridserve.api.engine.v1 import engine_pb2
from gridserve.shared.rpc.client import make_channel

from .services import KV_BYTES, address, deployment, engine_stub

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:", "for i in range("]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12),
          SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=2),
          SamplingParams(temperature=0.0, max_tokens=12, n=2, seed=5),
          SamplingParams(temperature=1.0, seed=11, max_tokens=12, stop=["\n"])]


@pytest.fixture(scope="module")
def reference(llama_tiny):
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu")
    try:
        yield [_summary(o) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


def _summary(output) -> list[tuple]:
    return [(c.text, list(c.token_ids), c.finish_reason) for c in output.outputs]


async def _generate_all(engine: AsyncLLM) -> list[list[tuple]]:
    async def one(i: int):
        last, seen = None, 0
        async for out in engine.generate(PROMPTS[i], PARAMS[i], request_id=f"r{i}"):
            assert not (last is not None and last.finished)
            seen = max(seen, sum(len(c.token_ids) for c in out.outputs))  # cumulative outputs
            last = out
        assert last.finished and seen == sum(len(c.token_ids) for c in last.outputs)
        return _summary(last)

    return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))


async def _abort_mid_stream(engine: AsyncLLM, usage=None) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    outputs = []
    async for out in engine.generate([5, 17, 42], params, request_id="long"):
        outputs.append(out)
        if len(outputs) == 2:
            if usage is not None:
                assert await usage() > 0  # the request holds blocks until the abort
            await engine.abort("long")
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) < 400
    return outputs[-1].outputs[0].finish_reason


def test_in_process_async_llm_matches_llm_and_abort_frees_blocks(llama_tiny, reference):
    async def run():
        engine = AsyncLLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu")
        try:
            assert await _generate_all(engine) == reference
            async def usage() -> float:
                return (await engine.engines[0].load()).kv_cache_usage

            assert await _abort_mid_stream(engine, usage) == "abort"
            load = await engine.engines[0].load()
            assert load.num_running == 0 and load.num_waiting == 0
            return load
        finally:
            await engine.close()

    load = asyncio.run(run())
    assert load.kv_cache_usage == 0.0


def test_remote_async_llm_matches_llm_and_abort_frees_blocks(llama_tiny, reference, tmp_path):
    with deployment(llama_tiny, tmp_path) as services:
        engine_address = address(services, "engine")

        async def run():
            engine = AsyncLLM(engine_addresses=[engine_address])
            try:
                assert await _generate_all(engine) == reference
                assert await _abort_mid_stream(engine) == "abort"
            finally:
                await engine.close()

        asyncio.run(run())
        with make_channel(engine_address) as channel:
            load = engine_stub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        assert load.num_running == 0 and load.kv_cache_usage == 0.0


def test_from_engine_args_builds_the_same_engine(llama_tiny):
    engine = AsyncLLM.from_engine_args({"model": str(llama_tiny), "kv_cache_memory_bytes": KV_BYTES,
                                        "device": "cpu", "max_model_len": None})
    assert engine.config.cache.kv_cache_memory_bytes == KV_BYTES and not engine.engines


def test_only_requests_with_the_same_cache_salt_share_cached_prefix_blocks(llama_tiny):
    """The engine hashes the salt into the first block: a salted prompt reuses the blocks of the same
    prompt with the same salt, never those of another salt or of no salt (vLLM's ``cache_salt``)."""
    prompt = list(range(5, 5 + 48))  # three full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2)

    async def cached(engine: AsyncLLM, salt) -> int:
        async for out in engine.generate(prompt, params, cache_salt=salt):
            last = out
        return last.num_cached_tokens

    async def go():
        engine = AsyncLLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu")
        try:
            return [await cached(engine, salt) for salt in ("a", "a", "b", None, None, "b")]
        finally:
            await engine.close()

    first_a, again_a, first_b, plain, plain_again, again_b = asyncio.run(go())
    assert first_a == 0 and first_b == 0 and plain == 0  # nothing shared across salts or with no salt
    assert again_a == again_b == plain_again == 32  # the same salt (or none) hits the full blocks before the last
