"""``RequestFailures`` and ``check_new_request``: the worker's record of requests that failed on
their own (step isolation), without torch."""

from __future__ import annotations

import pytest

from gridserve.services.worker.request_failures import RequestFailures, check_new_request
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import NewRequestData

VOCAB = 100


def _new(prompt=(1, 2, 3), output=(), **params) -> NewRequestData:
    return NewRequestData("r", list(prompt), SamplingParams(**params), [1], 0, list(output))


def test_a_request_within_the_vocabulary_passes():
    check_new_request(_new(output=[4], logit_bias={5: 1.0}, allowed_token_ids=[6, 7], stop_token_ids=[8],
                           bad_words_token_ids=[[9, 10]]), VOCAB)


@pytest.mark.parametrize(("request_kwargs", "field"), [
    ({"prompt": [1, VOCAB]}, "prompt_token_ids"),
    ({"output": [-1]}, "output_token_ids"),
    ({"logit_bias": {VOCAB + 5: 2.0}}, "sampling_params.logit_bias"),
    ({"allowed_token_ids": [3, 10**9]}, "sampling_params.allowed_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "sampling_params.stop_token_ids"),
    ({"bad_words_token_ids": [[1, VOCAB * 2]]}, "sampling_params.bad_words_token_ids"),
])
def test_a_token_id_out_of_range_is_refused_naming_the_field(request_kwargs, field):
    with pytest.raises(InvalidArgumentError) as info:
        check_new_request(_new(**request_kwargs), VOCAB)
    assert info.value.field == field and "out of range" in info.value.message


def test_a_failure_is_reported_once_and_withheld_until_forgotten():
    failures = RequestFailures()
    failures.reject("a", "token id 999 is out of range")
    failures.fail("b", "grammar broke")
    failures.fail("b", "again")  # already failed: not reported twice
    assert failures.take() == {"a": "token id 999 is out of range", "b": "grammar broke"}
    assert failures.take() == {}
    assert "a" in failures and "b" in failures and failures.rejected == {"a"}
    failures.forget("a")
    failures.forget("b")
    assert "a" not in failures and "b" not in failures and failures.rejected == set()
