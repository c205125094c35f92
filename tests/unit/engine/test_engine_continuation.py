"""An engine continuation (``AddRequest`` with ``output_token_ids``): what the servicer refuses
(naming the field) and how the domain ``Request`` starts (its tokens so far are output)."""

from __future__ import annotations

import pytest

from gridserve.api.engine.v1 import engine_pb2
from gridserve.services.engine.request import Request
from gridserve.services.engine.servicer import _check_continuation
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import SamplingParams


def _add(output: list[int]) -> engine_pb2.AddRequestRequest:
    return engine_pb2.AddRequestRequest(request_id="r", gateway_id="g", prompt_token_ids=[1, 2, 3],
                                        output_token_ids=output, continuation=True)


@pytest.mark.parametrize("output, message", [
    ([5, 6, 7, 8], "max_tokens=4"),       # nothing left to generate
    ([5, 6, 99], "outside [0, 50)"),  # not a token id
    ([-1], "outside [0, 50)"),
])
def test_bad_continuations_are_refused_naming_the_field(output, message):
    with pytest.raises(InvalidArgumentError, match="output_token_ids") as info:
        _check_continuation(_add(output), SamplingParams(max_tokens=4), max_model_len=64, vocab_size=50)
    assert message in str(info.value)


def test_a_continuation_without_room_in_the_model_is_refused():
    with pytest.raises(InvalidArgumentError, match="max_model_len=6"):
        _check_continuation(_add([4, 5, 6]), SamplingParams(max_tokens=10), max_model_len=6, vocab_size=50)


def test_a_good_continuation_passes_and_its_tokens_are_output():
    _check_continuation(_add([4, 5]), SamplingParams(max_tokens=4), max_model_len=64, vocab_size=50)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), output_token_ids=[4, 5])
    assert (request.num_prompt_tokens, request.num_output_tokens, request.all_token_ids) == (3, 2, [1, 2, 3, 4, 5])
    assert request.admit_always is False  # set by the servicer from AddRequest.continuation
