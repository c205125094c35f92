"""Sampling defaults from the checkpoint's ``generation_config.json`` (``--generation-config``), without
a model: what is read and refused at start, how the engine hands them to the gateway, and that a
request gets them only for the fields it leaves out (the OpenAI routes and the typed gRPC API)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from gridserve.api.common.v1 import common_pb2
from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.services.gateway.limits import RequestLimits
from gridserve.services.gateway.routes import OpenAIRoutes
from gridserve.services.gateway.service import SampleDelta, StreamChunk
from gridserve.shared.config import GridserveConfig, ModelConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.generation_config import read_default_sampling_params
from gridserve.shared.outputs import CompletionOutput, RequestOutput
from gridserve.shared.sampling_params import SamplingParams

# What a model creator typically ships: sampling keys among others that are not sampling defaults.
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.0,
                     "top_p": 0.9, "top_k": 5, "min_p": None, "repetition_penalty": 1.1, "max_new_tokens": 7,
                     "transformers_version": "5.24.0"}
DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1, "max_tokens": 7}


def _checkpoint(folder: Path, generation_config: dict | None = GENERATION_CONFIG) -> Path:
    """A model folder the config can resolve (no weights: nothing here loads a model)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "num_attention_heads": 2,
              "hidden_size": 8, "vocab_size": 128, "max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_the_models_sampling_keys_become_the_defaults_and_max_new_tokens_is_max_tokens(tmp_path, caplog):
    model = _checkpoint(tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="gridserve.shared.generation_config"):
        config = ModelConfig(model=str(model)).resolve()
    assert config.default_sampling_params == DEFAULTS  # min_p null, do_sample and token ids ignored
    assert [r for r in caplog.records if "overrides the default sampling parameters" in r.getMessage()]


def test_vllm_ignores_the_file_and_a_folder_reads_its_own(tmp_path):
    model = _checkpoint(tmp_path / "m")
    assert ModelConfig(model=str(model), generation_config="vllm").resolve().default_sampling_params == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 40, "temperature": 0.7}))
    config = ModelConfig(model=str(model), generation_config=str(other)).resolve()
    assert config.default_sampling_params == {"temperature": 0.7, "top_k": 40}


def test_a_model_without_the_file_and_a_gguf_file_have_no_defaults(tmp_path):
    assert ModelConfig(model=str(_checkpoint(tmp_path / "m", None))).resolve().default_sampling_params == {}
    assert read_default_sampling_params(str(tmp_path / "model.Q4_0.gguf"), "auto") == {}


@pytest.mark.parametrize(("values", "field"), [
    ({"temperature": -1.0}, "model.generation_config.temperature"),
    ({"top_p": 0.0}, "model.generation_config.top_p"),
    ({"top_p": "0.9"}, "model.generation_config.top_p"),
    ({"top_k": 2.5}, "model.generation_config.top_k"),
    ({"repetition_penalty": True}, "model.generation_config.repetition_penalty"),
    ({"max_new_tokens": 0}, "model.generation_config.max_new_tokens"),
    ({"max_new_tokens": 2**40}, "model.generation_config.max_new_tokens"),
])
def test_a_value_no_request_could_set_fails_the_start_naming_the_key(tmp_path, values, field):
    model = _checkpoint(tmp_path / "m", values)
    with pytest.raises(ConfigError) as err:
        ModelConfig(model=str(model)).resolve()
    assert err.value.field == field


def test_a_folder_without_the_file_or_an_empty_mode_is_refused(tmp_path):
    model = _checkpoint(tmp_path / "m")
    with pytest.raises(ConfigError, match="generation_config.json") as err:
        ModelConfig(model=str(model), generation_config=str(tmp_path / "nowhere")).resolve()
    assert err.value.field == "model.generation_config"
    with pytest.raises(ConfigError) as err:
        ModelConfig(generation_config="")
    assert err.value.field == "model.generation_config"


def test_the_option_and_its_variable_reach_the_engine_config(tmp_path, monkeypatch):
    from gridserve.cli import _parser
    from gridserve.roles import engine_config

    model = str(_checkpoint(tmp_path / "m"))
    argv = ["engine", "--model", model, "--workers", "127.0.0.1:1"]
    assert engine_config(_parser().parse_args(argv), []).model.default_sampling_params == DEFAULTS
    flagged = engine_config(_parser().parse_args([*argv, "--generation-config", "vllm"]), [])
    assert flagged.model.generation_config == "vllm" and flagged.model.default_sampling_params == {}
    monkeypatch.setenv("GRIDSERVE_GENERATION_CONFIG", "vllm")
    assert engine_config(_parser().parse_args(argv), []).model.default_sampling_params == {}


def test_the_defaults_travel_to_the_workers_and_from_the_engine_to_the_gateway(tmp_path):
    from gridserve.services.engine.servicer import EngineServicer
    from gridserve.services.gateway.main import _sampling_defaults
    from gridserve.shared.rpc.worker_convert import config_from_pb, config_to_pb

    config = GridserveConfig.from_kwargs(model=str(_checkpoint(tmp_path / "m"))).finalize()
    assert config_from_pb(config_to_pb(config)) == config
    info = asyncio.run(EngineServicer(config).GetInfo(engine_pb2.GetInfoRequest(), None))
    assert _sampling_defaults(info) == DEFAULTS
    assert _sampling_defaults(engine_pb2.GetInfoResponse()) == {}  # --generation-config vllm, or no file


# ---- the gateway: a request's own values win -----------------------------------------------------
class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


class _RecordingService:
    """Just enough of GatewayService: records the SamplingParams each request would send."""

    model_name = "m"
    max_model_len = 64

    def __init__(self, defaults: dict) -> None:
        self.sampling_defaults = defaults
        self.limits = RequestLimits()
        self.tokenizer = _Tokenizer()
        self.sent: list[SamplingParams] = []

    async def chat_prompt(self, messages, template, add_generation_prompt, tools=None):
        return {"prompt_token_ids": [5, 6]}

    async def complete(self, prompt, params, request_id="", traceparent="", data_parallel_rank=None, timeout=None):
        self.sent.append(params)
        out = CompletionOutput(0, "A", [0], None, None, "length")
        return RequestOutput("r", None, [5, 6], [out], True)

    async def generate(self, prompt, params, request_id="", traceparent="", data_parallel_rank=None, timeout=None):
        self.sent.append(params)
        yield StreamChunk("r", [SampleDelta(0, "A", [0], finish_reason="length")], 2)


def _sent(defaults: dict, route: str, body: dict) -> SamplingParams:
    service = _RecordingService(defaults)
    routes = OpenAIRoutes(service, "m", sampling_defaults=defaults)
    response = asyncio.run(getattr(routes, route)(json.dumps(body).encode()))
    assert response.status == 200, b"".join(response.chunks)
    return service.sent[-1]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_request_that_leaves_the_fields_out_gets_the_models_defaults():
    params = _sent(DEFAULTS, "chat_completions", CHAT)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == (
        0.0, 0.9, 5, 1.1, 7)
    assert params.min_p == 0.0  # the file does not set it: SamplingParams' own


def test_fields_a_request_sets_keep_their_values():
    params = _sent(DEFAULTS, "chat_completions", {**CHAT, "temperature": 0.8, "top_k": -1, "max_tokens": 3,
                                                  "repetition_penalty": 1.0})
    assert (params.temperature, params.top_k, params.max_tokens, params.repetition_penalty) == (0.8, 0, 3, 1.0)
    assert params.top_p == 0.9  # left out: the model's


def test_a_completion_keeps_openais_16_tokens_unless_it_sends_null():
    params = _sent(DEFAULTS, "completions", {"prompt": "hi"})
    assert params.temperature == 0.0 and params.max_tokens == 16
    assert _sent(DEFAULTS, "completions", {"prompt": "hi", "max_tokens": None}).max_tokens == 7
    streamed = _sent(DEFAULTS, "completions", {"prompt": "hi", "stream": True})
    assert streamed.temperature == 0.0 and streamed.top_k == 5


def test_without_defaults_requests_get_sampling_params_own():
    params = _sent({}, "chat_completions", CHAT)
    neutral = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        neutral.temperature, neutral.top_p, neutral.top_k, neutral.repetition_penalty)
    assert params.max_tokens is None  # a chat without max_tokens: what the prompt leaves (the processor)


def test_the_typed_grpc_api_fills_only_the_fields_the_request_left_unset():
    from gridserve.services.gateway.servicer import GatewayServicer

    servicer = GatewayServicer(_RecordingService(DEFAULTS))
    request = gateway_pb2.CompleteRequest(text="hi", sampling_params=common_pb2.SamplingParams(top_p=0.5, top_k=0))
    params = servicer._params(request, "hi")
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 0.5, 0, 7)
    plain = GatewayServicer(_RecordingService({}))._params(request, "hi")
    assert (plain.temperature, plain.max_tokens) == (1.0, 16)


def test_the_models_route_is_unchanged_by_the_defaults():
    routes = OpenAIRoutes(_RecordingService(DEFAULTS), "m", sampling_defaults=DEFAULTS)
    card = json.loads(b"".join(asyncio.run(routes.models()).chunks))["data"][0]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
