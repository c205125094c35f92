"""vLLM's SamplingParams through the offline engine: n, penalties, bias, bad words, prompt logprobs."""

from __future__ import annotations

import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.errors import InvalidArgumentError

from .hf_reference import hf_model

PROMPT = list(range(100, 170))  # 70 tokens: 4 full blocks of 16


@pytest.fixture(scope="module")
def llm(llama_tiny) -> LLM:
    return LLM(model=str(llama_tiny), kv_cache_memory_bytes=32 << 20, max_model_len=256)


def _one(llm: LLM, params: SamplingParams, prompt=None):
    return llm.generate({"prompt_token_ids": prompt or PROMPT}, params, use_tqdm=False)[0]


def test_n_samples_share_one_prompt_computation(llm):
    assert llm.reset_prefix_cache()
    before = llm.stats()
    out = _one(llm, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    after = llm.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in out.outputs)
    # The first child computes the 4 full prompt blocks; the other three find them in the cache.
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * 64
    again = _one(llm, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_mixed_batch_gives_each_request_its_solo_output(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, top_p=0.8, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, logit_bias={200: 5.0, 201: -100.0}, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, presence_penalty=1.0, min_p=0.05, max_tokens=10, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": [300 + 7 * i + j for j in range(5 + 9 * i)]} for i in range(len(params))]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, joint in zip(prompts, params, together):
        alone = llm.generate(prompt, p, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == joint.outputs[0].token_ids


def test_penalties_change_the_greedy_output(llm):
    plain = _one(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).outputs[0].token_ids
    penalised = _one(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                         frequency_penalty=2.0)).outputs[0].token_ids
    assert plain != penalised
    assert max(penalised.count(t) for t in set(penalised)) <= max(plain.count(t) for t in set(plain))


def test_logit_bias_forces_a_token(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={1234: 100.0}))
    assert out.outputs[0].token_ids == [1234] * 5


def test_allowed_token_ids_restrict_output(llm):
    out = _one(llm, SamplingParams(temperature=1.0, seed=0, max_tokens=20, ignore_eos=True,
                                   allowed_token_ids=[500, 501, 502]))
    assert set(out.outputs[0].token_ids) <= {500, 501, 502}


def test_bad_words_are_never_generated(llm):
    tok = llm.get_tokenizer()
    plain = _one(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)).outputs[0].token_ids
    word = tok.decode([plain[0]]).strip() or tok.decode([plain[1]]).strip()
    out = _one(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=[word]))
    banned = {ids[-1] for ids in (tok.encode(word), tok.encode(" " + word)) if len(ids) == 1}
    assert banned and not banned & set(out.outputs[0].token_ids)


def test_prompt_logprobs_match_transformers(llm, llama_tiny):
    import torch

    prompt = PROMPT[:40]
    out = _one(llm, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    with torch.inference_mode():
        logits = hf_model(str(llama_tiny))(torch.tensor([prompt])).logits[0].float()
    reference = torch.log_softmax(logits, -1)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        actual = prompt[pos]
        assert entry[actual].logprob == pytest.approx(reference[pos - 1, actual].item(), abs=1e-4)
        top = reference[pos - 1].topk(3)
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token].logprob == pytest.approx(value, abs=1e-4)


def test_prompt_logprobs_survive_chunked_prefill(llama_tiny):
    chunked = LLM(model=str(llama_tiny), kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=16)
    whole = LLM(model=str(llama_tiny), kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    a = chunked.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].prompt_logprobs
    b = whole.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].prompt_logprobs
    assert len(a) == len(b) == len(PROMPT)
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) for t in x)


def test_detokenize_false_returns_ids_without_text(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False))
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 6


def test_truncate_prompt_tokens_keeps_the_tail(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=10))
    assert out.prompt_token_ids == PROMPT[-10:]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": -1}, "sampling_params.n"),
        ({"top_k": -2}, "sampling_params.top_k"),
        ({"repetition_penalty": 0.0}, "sampling_params.repetition_penalty"),
        ({"presence_penalty": 3.0}, "sampling_params.presence_penalty"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logprobs": 21}, "sampling_params.logprobs"),
        ({"prompt_logprobs": 50}, "sampling_params.prompt_logprobs"),
        ({"logit_bias": {99999: 1.0}}, "sampling_params.logit_bias"),
        ({"allowed_token_ids": [5, 70000]}, "sampling_params.allowed_token_ids"),
    ],
)
def test_values_checked_against_the_server_name_the_field(llm, kwargs, field):
    with pytest.raises(InvalidArgumentError) as err:
        _one(llm, SamplingParams(**kwargs))
    assert err.value.field == field
