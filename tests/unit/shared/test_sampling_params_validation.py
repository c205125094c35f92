"""``SamplingParams`` refuses NaN and infinities, naming the field: the offline ``LLM`` and the
engine (which re-validates what gateways send) share these checks with the gateway's models."""

from __future__ import annotations

import math

import pytest

from gridserve import SamplingParams
from gridserve.shared.errors import InvalidArgumentError


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == f"sampling_params.{field}"


def test_a_nan_logit_bias_is_refused():
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(logit_bias={5: math.nan})
    assert info.value.field == "sampling_params.logit_bias"
