"""Proto <-> domain conversions round-trip exactly (what crosses the engine/worker/gateway wires)."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from gridserve.api.common.v1 import common_pb2
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.rpc.convert import (
    engine_output_from_pb,
    engine_output_to_pb,
    image_features_from_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
)
from gridserve.shared.rpc.tensors import pack_raw
from gridserve.shared.rpc.worker_convert import (
    config_from_pb,
    config_to_pb,
    runner_output_from_pb,
    runner_output_to_pb,
    scheduler_output_from_pb,
    scheduler_output_to_pb,
)
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)


def _rich_params() -> SamplingParams:
    params = SamplingParams(
        temperature=0.0, top_p=0.9, top_k=5, seed=7, max_tokens=12, min_tokens=2, stop=["\n\n"],
        stop_token_ids=[3], logprobs=2, prompt_logprobs=1, ignore_eos=True, skip_special_tokens=False,
        presence_penalty=0.5, repetition_penalty=1.1, logit_bias={5: -1.5}, allowed_token_ids=[5, 6, 7],
        bad_words=["foo"], truncate_prompt_tokens=8, structured_outputs={"choice": ["yes", "no"]},
    )
    params.bad_words_token_ids = [[11, 12], [13]]
    return params


def test_every_sampling_params_field_survives_the_wire():
    params = _rich_params()
    assert sampling_params_from_pb(sampling_params_to_pb(params)) == params


def test_unset_sampling_fields_take_vllm_defaults():
    assert sampling_params_from_pb(common_pb2.SamplingParams()) == SamplingParams()


def test_every_sampling_params_field_has_a_proto_field():
    proto_fields = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert {f.name for f in dataclasses.fields(SamplingParams)} <= proto_fields


def test_config_round_trips(llama_tiny):
    config = GridserveConfig.from_kwargs(model=str(llama_tiny), kv_cache_memory_bytes=1 << 20,
                                         worker_addresses=["127.0.0.1:1"]).finalize()
    assert config_from_pb(config_to_pb(config)) == config


def test_scheduler_and_runner_outputs_round_trip():
    sched = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], _rich_params(), [4, 5], 0, [9])],
        scheduled_cached_reqs=[CachedRequestData("b", [6], 17)],
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        finished_req_ids={"c", "d"},
    )
    assert scheduler_output_from_pb(scheduler_output_to_pb(sched)) == sched
    lp = TokenLogprobs([7, 8, 9], [-0.5, -1.25, -2.0], 1)
    out = ModelRunnerOutput(["a", "b"], [7, 3], [lp, None], prompt_logprobs={"a": [lp, lp]},
                            failed={"e": "structured outputs: broken"})
    assert runner_output_from_pb(runner_output_to_pb(out)) == out


def test_a_new_request_s_images_travel_as_typed_float32_tensors():
    pixels = struct.pack("<12f", *[i / 7 for i in range(12)])
    image = ImageFeature(pixels, (3, 2, 2), offset=1, length=2)
    sched = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 9, 9, 2], _rich_params(), [4], 0, mm_features=[image])],
        num_scheduled_tokens={"a": 4}, total_num_scheduled_tokens=4)
    msg = scheduler_output_to_pb(sched)
    tensor = msg.scheduled_new_reqs[0].mm_features[0].pixel_values
    assert tensor.dtype == common_pb2.DTYPE_FLOAT32 and list(tensor.shape) == [3, 2, 2]
    back = scheduler_output_from_pb(msg)
    assert back == sched and back.scheduled_new_reqs[0].mm_features[0].identifier == image.identifier


def test_a_pooling_request_carries_pooling_params_instead_of_sampling_params():
    pooling = PoolingParams(task="embed", dimensions=8)
    sched = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("p", [1, 2], SamplingParams(max_tokens=1), [3], 0,
                                           pooling_params=pooling, token_type_ids=[0, 1]),
                            NewRequestData("g", [4], _rich_params(), [5], 0)],
        num_scheduled_tokens={"p": 2, "g": 1}, total_num_scheduled_tokens=3)
    msg = scheduler_output_to_pb(sched)
    # the two are a oneof: a pooling request has no sampling parameters on the wire
    assert [r.WhichOneof("params") for r in msg.scheduled_new_reqs] == ["pooling_params", "sampling_params"]
    assert scheduler_output_from_pb(msg) == sched


@pytest.mark.parametrize("offset, length, shape, field", [
    (3, 2, (3, 2, 2), "mm_features[0]"),  # runs past the 4-token prompt
    (1, 0, (3, 2, 2), "mm_features[0]"),
    (1, 2, (3, 2, 3), "mm_features[0].pixel_values"),  # bytes do not fill the shape
])
def test_images_that_do_not_fit_the_prompt_or_their_shape_are_refused(offset, length, shape, field):
    msg = common_pb2.ImageFeature(pixel_values=pack_raw(b"\0" * 48, common_pb2.DTYPE_FLOAT32, shape),
                                  offset=offset, length=length)
    with pytest.raises(InvalidArgumentError) as err:
        image_features_from_pb([msg], num_prompt_tokens=4)
    assert err.value.field == field


def test_engine_output_round_trips():
    lp = TokenLogprobs([7, 8], [-0.5, -1.0], 1)
    out = EngineCoreOutput("r", [7], [lp], [lp], FinishReason.STOP, stop_reason=7, num_cached_tokens=16)
    assert engine_output_from_pb(engine_output_to_pb(out)) == out
    failed = EngineCoreOutput("f", [], finish_reason=FinishReason.ERROR, error="token id 9 is out of range")
    assert engine_output_from_pb(engine_output_to_pb(failed)) == failed
