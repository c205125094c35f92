"""The offline ``LLM`` API: sampling behaviour, stopping, chat, and clear errors for bad input."""

from __future__ import annotations

import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.errors import ConfigError, InvalidArgumentError, ModelNotFoundError


@pytest.fixture(scope="module")
def llm(llama_tiny) -> LLM:
    return LLM(model=str(llama_tiny), kv_cache_memory_bytes=32 << 20, max_model_len=256)


def _free_equals_total(llm: LLM) -> bool:
    kv = llm.llm_engine.core.kv_cache_manager
    return kv.num_free_blocks == kv.num_total_blocks


PROMPTS = ["def main():", "import sys", "class Queue:", "for i in range(10):", "return x + y", "# comment"]


def test_same_seed_gives_same_text_whatever_else_is_in_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["def main():"], seeded, use_tqdm=False)[0].outputs[0]
    others = SamplingParams(temperature=1.2, top_k=50, max_tokens=30, ignore_eos=True)
    mixed = llm.generate(PROMPTS, [seeded] + [others] * (len(PROMPTS) - 1), use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == mixed.token_ids
    assert alone.text == mixed.text


def test_different_seeds_give_different_texts(llm):
    texts = {
        llm.generate(["def main():"], SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].text
        for s in range(4)
    }
    assert len(texts) == 4


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_stop_string_truncates_text_and_sets_stop_reason(llm):
    full = llm.generate(["import sys"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    assert stop, "the greedy continuation is long enough to pick a stop string from"
    out = llm.generate(["import sys"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(["import sys"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                         include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == full.text[: full.text.index(stop) + len(stop)]
    assert _free_equals_total(llm)


def test_stop_token_id_ends_request_with_that_reason(llm):
    full = llm.generate(["class Queue:"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    target = full.token_ids[6]
    out = llm.generate(["class Queue:"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    first = full.token_ids.index(target)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_min_tokens_masks_stop_tokens_until_reached(llm):
    full = llm.generate(["class Queue:"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    first = full.token_ids[0]
    out = llm.generate(["class Queue:"], SamplingParams(temperature=0, max_tokens=20, min_tokens=5,
                                                           stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:5]
    assert len(out.token_ids) >= 5


def test_max_tokens_caps_output_with_length_reason(llm):
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.7, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 7 and o.outputs[0].finish_reason == "length" for o in out)


def test_prompt_forms_string_token_ids_and_dict_agree(llm):
    ids = llm.get_tokenizer().encode("def main():")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b, c = llm.generate(["def main():", ids, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.prompt_token_ids == ids and b.prompt is None


def test_chat_applies_the_chat_template(llm):
    messages = [{"role": "user", "content": "Write a loop."}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    assert len(out.outputs[0].token_ids) == 8


def test_abort_frees_every_block_and_is_idempotent(llm):
    engine = llm.llm_engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in PROMPTS]
    engine.step()
    engine.step()
    aborted = engine.abort_request(ids[:3])
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"] * 3
    assert engine.abort_request(ids[:3]) == []
    while engine.has_unfinished_requests():
        engine.step()
    assert _free_equals_total(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ("x " * 400, SamplingParams(), "prompt"),
        ([1, 2, 999999], SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_prompt_raises_error_naming_the_field(llm, prompt, params, field):
    with pytest.raises(InvalidArgumentError) as err:
        llm.generate([prompt], params, use_tqdm=False)
    assert err.value.field == field
    assert _free_equals_total(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "sampling_params.max_tokens"),
        ({"top_p": 0.0}, "sampling_params.top_p"),
        ({"top_p": 1.5}, "sampling_params.top_p"),
        ({"temperature": -0.5}, "sampling_params.temperature"),
        ({"min_p": 2.0}, "sampling_params.min_p"),
        ({"top_k": -3}, "sampling_params.top_k"),
    ],
)
def test_bad_sampling_params_raise_error_naming_the_field(kwargs, field):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_missing_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(model=str(missing))


def test_unknown_hub_id_offline_names_the_id_and_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as err:
        LLM(model="facebook/opt-125m")
    assert "facebook/opt-125m" in str(err.value) and str(tmp_path) in str(err.value)


def test_unknown_llm_argument_is_an_error(llama_tiny):
    with pytest.raises(ConfigError, match="not_an_option"):
        LLM(model=str(llama_tiny), not_an_option=3)


def test_invalid_config_value_names_the_field(llama_tiny):
    with pytest.raises(ConfigError) as err:
        LLM(model=str(llama_tiny), block_size=7)
    assert err.value.field == "cache.block_size"


def test_kv_cache_smaller_than_one_request_is_rejected(llama_tiny):
    with pytest.raises(ConfigError) as err:
        LLM(model=str(llama_tiny), kv_cache_memory_bytes=64 << 10)
    assert err.value.field == "cache.kv_cache_memory_bytes"


def test_pipeline_parallelism_is_refused_for_an_architecture_that_cannot_split(opt_tiny):
    with pytest.raises(ConfigError) as err:
        LLM(model=str(opt_tiny), pipeline_parallel_size=2)
    assert err.value.field == "parallel.pipeline_parallel_size" and "OPTForCausalLM" in err.value.message
