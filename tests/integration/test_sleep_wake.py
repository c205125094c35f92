"""``LLM.sleep(level)`` / ``LLM.wake_up(tags)``: what each tag restores, memory released, same outputs."""

from __future__ import annotations

import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.errors import FailedPreconditionError, InvalidArgumentError

pytestmark = pytest.mark.slow

KV_BYTES = 64 << 20
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 3]}, {"prompt_token_ids": [250, 7, 1000, 33]}]


@pytest.fixture(scope="module")
def llm(llama_tiny):
    engine = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu")
    yield engine
    engine.shutdown()


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("level", [1, 2])
def test_partial_wake_up_restores_each_tag_and_generation_is_identical(llm, level):
    before = _greedy(llm)
    (slept,) = llm.sleep(level=level)
    assert llm.sleeping_tags == ["kv_cache", "weights"]
    # the KV cache (64 MiB here) goes back to the operating system
    assert slept["rss_before"] - slept["rss_after"] > KV_BYTES // 2, slept
    assert llm.wake_up(["weights"]) and llm.sleeping_tags == ["kv_cache"]
    with pytest.raises(FailedPreconditionError, match="kv_cache"):
        _greedy(llm)
    assert llm.wake_up(["weights"]) == []  # already awake: nothing to do
    (woken,) = llm.wake_up(["kv_cache"])
    assert llm.sleeping_tags == []
    assert woken["rss_after"] - woken["rss_before"] > KV_BYTES // 2, woken
    assert _greedy(llm) == before


def test_wake_up_with_an_unknown_tag_names_the_field(llm):
    llm.sleep(level=1)
    try:
        with pytest.raises(InvalidArgumentError) as info:
            llm.wake_up(["weights", "kv"])
        assert info.value.field == "tags"
    finally:
        llm.wake_up()
    assert llm.sleeping_tags == []
