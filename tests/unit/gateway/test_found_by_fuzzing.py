"""Cases the fuzz suite found (``gridserve bench fuzz --examples 2000 --seed 7``): ``min_tokens``
beyond the room a long prompt leaves was let through by the gateway and refused by the engine's
re-validation, which the REST route answered 500. Now the gateway refuses it (400 naming the
field), and an engine's INVALID_ARGUMENT that still comes back is a 400 too, never a 500."""

from __future__ import annotations

import grpc
import pytest

from gridserve.services.gateway.api_errors import to_api_error
from gridserve.services.gateway.processor import InputProcessor
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import SamplingParams


def test_min_tokens_beyond_the_room_the_prompt_leaves_is_refused_by_the_gateway():
    processor = InputProcessor(tokenizer=None, max_model_len=48, vocab_size=100, max_logprobs=5)
    with pytest.raises(InvalidArgumentError) as err:
        processor.process({"prompt_token_ids": list(range(47))}, SamplingParams(max_tokens=4, min_tokens=2))
    assert err.value.field == "sampling_params.min_tokens" and "max_model_len=48" in err.value.message
    ok = processor.process({"prompt_token_ids": list(range(46))}, SamplingParams(max_tokens=4, min_tokens=2))
    assert ok.sampling_params.max_tokens == 2


def test_an_engines_invalid_argument_is_a_400_naming_the_field():
    exc = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               "sampling_params.min_tokens: must not exceed max_tokens=1, got 2")
    error = to_api_error(exc)
    assert (error.status, error.param) == (400, "min_tokens")
    assert error.message == "min_tokens: must not exceed max_tokens=1, got 2"
