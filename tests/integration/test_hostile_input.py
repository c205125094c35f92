"""Hostile input through the real Envoy edge of ``gridserve serve``-like deployments (issue 18):
each request that broke main (a hang, a 500, garbage accepted) is answered 400 in OpenAI's error
shape naming the field, within the client's timeout, and the gateway stays healthy.

Two deployments: the default one (a request's ``chat_template`` refused) and one started with
``--trust-request-chat-template`` (templates rendered, bounded in time and size).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from gridserve.api.engine.v1 import engine_pb2
from gridserve.launcher import free_port

from .services import address, deployment, engine_stub, gateway_stub, greedy, token_prompt

pytestmark = pytest.mark.slow

TIMEOUT_S = 15  # each of these used to hang for longer, or answer 500; now each is refused at once
BOMB = "{{ 'a' * 4000000000 }}"
RANGE_BOMB = "{% for i in range(999999999) %}x{% endfor %}"
NAN = float("nan")


@pytest.fixture(scope="module")
def edge(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port()) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def trusting_edge(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs-trust"), edge_port=free_port(),
                    gateway_args=["--trust-request-chat-template", "--template-render-timeout-s", "1"]) as launcher:
        yield launcher


def _post(launcher, path: str, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()  # NaN is written as the bare token NaN, as careless clients do
    request = urllib.request.Request(f"http://{launcher.edge_address}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _health(launcher) -> int:
    try:
        with urllib.request.urlopen(f"http://{launcher.edge_address}/health", timeout=TIMEOUT_S) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _assert_refused(status: int, body: dict, param: str) -> None:
    assert status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError", error
    assert error["message"].startswith(param), error


def _chat(template: str) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template": template}


def _idle(launcher) -> engine_pb2.GetLoadResponse:
    with grpc.insecure_channel(address(launcher, "engine")) as channel:
        return engine_stub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)


# ---- a request's chat template ----------------------------------------------------------------
def test_request_chat_template_is_refused_without_the_trust_flag(edge):
    _assert_refused(*_post(edge, "/v1/chat/completions", _chat(BOMB)), "chat_template")
    assert _health(edge) == 200


def test_request_chat_template_on_tokenize_is_refused_without_the_trust_flag(edge):
    _assert_refused(*_post(edge, "/tokenize", _chat(RANGE_BOMB)), "chat_template")


def test_string_repetition_bomb_is_bounded_with_the_trust_flag_and_health_stays_up(trusting_edge):
    status, body = _post(trusting_edge, "/v1/chat/completions", _chat(BOMB))
    _assert_refused(status, body, "chat_template")
    assert "bound" in body["error"]["message"]
    assert _health(trusting_edge) == 200
    # The gateway still serves: a trusted, ordinary template renders.
    status, body = _post(trusting_edge, "/tokenize", _chat("{{ messages[0]['content'] }}!"))
    assert status == 200 and body["count"] > 0, body


def test_huge_range_in_a_template_on_tokenize_is_refused_with_the_trust_flag(trusting_edge):
    _assert_refused(*_post(trusting_edge, "/tokenize", _chat(RANGE_BOMB)), "chat_template")


def test_endless_template_loop_ends_at_the_render_deadline(trusting_edge):
    loop = "{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}"
    status, body = _post(trusting_edge, "/tokenize", _chat(loop))
    _assert_refused(status, body, "chat_template")
    assert "longer than" in body["error"]["message"]
    assert _health(trusting_edge) == 200


# ---- numbers out of range, NaN, counts past the caps ------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("seed", 2**63),
    ("seed", 2**64),
    ("top_k", 2**40),
    ("n", 100_000_000),
    ("temperature", NAN),
    ("repetition_penalty", NAN),
    ("logit_bias", {"17": NAN}),
    ("stop", ["s"] * 10_000),
    ("prompt", ["hello"] * 20_000),
], ids=["seed-2^63", "seed-2^64", "top_k-2^40", "n-1e8", "nan-temperature", "nan-repetition_penalty",
        "nan-logit_bias", "10000-stop-strings", "20000-prompts"])
def test_completion_field_out_of_bounds_is_400_naming_it(edge, field, value):
    body = {"prompt": "hello", "max_tokens": 2, field: value}
    _assert_refused(*_post(edge, "/v1/completions", body), field)


@pytest.mark.parametrize("field, value", [("temperature", NAN), ("n", 100_000_000), ("seed", 2**64)])
def test_chat_field_out_of_bounds_is_400_naming_it(edge, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    _assert_refused(*_post(edge, "/v1/chat/completions", body), field)


def test_native_grpc_generate_goes_through_the_same_checks(edge):
    with grpc.insecure_channel(edge.edge_address) as channel:
        stub = gateway_stub(channel)
        for params, field in [(greedy(2, repetition_penalty=NAN), "repetition_penalty"),
                              (greedy(2, n=100_000_000), "n"),
                              (greedy(2, stop=["s"] * 10_000), "stop")]:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(token_prompt([5, 17, 300], params), timeout=TIMEOUT_S))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"sampling_params.{field}" in err.value.details(), err.value.details()


def test_nothing_is_left_running_after_the_refusals(edge):
    deadline = time.monotonic() + 10
    while (load := _idle(edge)).num_running or load.num_waiting:
        assert time.monotonic() < deadline, load
        time.sleep(0.1)
    assert _health(edge) == 200
