"""``shared.request_checks.check_request``: one check of a request against the model's limits, which
the gateway's ``InputProcessor`` and the engine's ``check_request`` both run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gridserve.services.engine import request_checks as engine_checks
from gridserve.services.gateway.processor import InputProcessor
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.request_checks import check_request
from gridserve.shared.sampling_params import SamplingParams

LIMITS = {"vocab_size": 100, "max_model_len": 32, "max_logprobs": 5}

BAD = [
    ([], SamplingParams(max_tokens=4), "prompt_token_ids"),
    (list(range(32)), SamplingParams(max_tokens=1), "prompt_token_ids"),
    ([1, 100], SamplingParams(max_tokens=4), "prompt_token_ids"),
    ([1, 2], SamplingParams(max_tokens=31), "sampling_params.max_tokens"),
    ([1, 2], SamplingParams(min_tokens=31, max_tokens=None), "sampling_params.min_tokens"),
    ([1, 2], SamplingParams(max_tokens=4, logprobs=6), "sampling_params.logprobs"),
    ([1, 2], SamplingParams(max_tokens=4, prompt_logprobs=6), "sampling_params.prompt_logprobs"),
    ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=[100]), "sampling_params.stop_token_ids"),
    ([1, 2], SamplingParams(max_tokens=4, allowed_token_ids=[3, 1000]), "sampling_params.allowed_token_ids"),
    ([1, 2], SamplingParams(max_tokens=4, logit_bias={-5: 1.0}), "sampling_params.logit_bias"),
]


@pytest.mark.parametrize("prompt, params, field", BAD)
def test_each_failure_names_its_field(prompt, params, field):
    with pytest.raises(InvalidArgumentError) as error:
        check_request(prompt, params, **LIMITS)
    assert error.value.field == field


def test_a_request_within_bounds_passes_and_zero_limits_are_not_checked():
    check_request([0, 99], SamplingParams(max_tokens=30, logprobs=5, stop_token_ids=[99], allowed_token_ids=[0, 1],
                                          logit_bias={2: 1.0}), **LIMITS)
    check_request([1], SamplingParams(max_tokens=None), **LIMITS)
    check_request([10**6] * 100, SamplingParams(max_tokens=10**4), vocab_size=0, max_model_len=0, max_logprobs=5)


def test_the_prompt_field_names_an_empty_or_too_long_prompt_only():
    for prompt in ([], list(range(32))):
        with pytest.raises(InvalidArgumentError) as error:
            check_request(prompt, SamplingParams(), **LIMITS, prompt_field="prompt")
        assert error.value.field == "prompt"
    with pytest.raises(InvalidArgumentError) as error:
        check_request([1, 100], SamplingParams(), **LIMITS, prompt_field="prompt")
    assert error.value.field == "prompt_token_ids"


@pytest.mark.parametrize("prompt, params, field", BAD)
def test_the_gateway_and_the_engine_refuse_the_same_requests(prompt, params, field):
    """The gateway caps ``max_tokens`` at what the prompt leaves, so there it never fails; an empty
    or too long prompt is the gateway caller's ``prompt``."""
    gateway = InputProcessor(tokenizer=None, max_model_len=32, vocab_size=100, max_logprobs=5)
    config = SimpleNamespace(model=SimpleNamespace(vocab_size=100, max_model_len=32, max_logprobs=5))
    with pytest.raises(InvalidArgumentError) as at_engine:
        engine_checks.check_request(config, prompt, params)
    assert at_engine.value.field == field
    if field == "sampling_params.max_tokens":
        assert gateway.process(prompt, params).sampling_params.max_tokens == 30
        return
    with pytest.raises(InvalidArgumentError) as at_gateway:
        gateway.process(prompt, params)
    assert at_gateway.value.field == ("prompt" if field == "prompt_token_ids" and len(prompt) in (0, 32) else field)
