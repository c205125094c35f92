"""vLLM's ``priority`` request field at the gateway: an int32, 0 unless the gateway runs with
``--allow-client-priority`` (HTTP 400 / INVALID_ARGUMENT naming it otherwise), handed to the engine
with every engine request of the completions, chat and Responses routes and the typed gRPC API."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from gridserve.services.gateway.limits import RequestLimits, add_limit_arguments
from gridserve.services.gateway.protocol import check_priority
from gridserve.shared.errors import InvalidArgumentError
from tests.unit.gateway.scripted_engine import (
    body,
    call_route,
    recording_routes,
    run,
    tokenizer_folder,
)

ROUTES = ("completions", "chat", "responses")


@pytest.fixture(scope="module")
def folder(llama_tiny, tmp_path_factory):
    return tokenizer_folder(llama_tiny, tmp_path_factory.mktemp("tok"))


def _gateway(folder, allow: bool):
    """The routes of a gateway (``--allow-client-priority`` or not) and the priorities its engine got."""
    chat, seen = recording_routes(folder, "priority", 0)
    chat.service.limits = replace(chat.service.limits, allow_client_priority=allow)
    return chat, seen


@pytest.mark.parametrize("route", ROUTES)
def test_a_client_priority_is_400_naming_it_unless_the_gateway_allows_it(folder, route):
    async def go():
        chat, seen = _gateway(folder, allow=False)
        refused = await call_route(chat, route, priority=-1)
        zero = await call_route(chat, route, priority=0)
        return refused, zero, seen

    refused, zero, seen = run(go())
    assert refused.status == 400
    error = body(refused)["error"]
    assert error["param"] == "priority" and "--allow-client-priority" in error["message"]
    assert zero.status == 200 and seen == [0]  # 0 (the default) is always fine; nothing else reached the engine


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("stream", [False, True])
def test_an_allowed_priority_reaches_the_engine_with_the_request(folder, route, stream):
    async def go():
        chat, seen = _gateway(folder, allow=True)
        response = await call_route(chat, route, priority=-7, stream=stream)
        chunks = [c async for c in response.chunks] if stream else []
        return response, chunks, seen

    response, chunks, seen = run(go())
    assert response.status == 200 and seen == [-7]
    assert not stream or chunks


def test_every_sample_of_a_request_carries_its_priority(folder):
    async def go():
        chat, seen = _gateway(folder, allow=True)
        response = await call_route(chat, "completions", prompt=["Hi", "Ho"], n=2, priority=3, temperature=1.0)
        return response, seen

    response, seen = run(go())
    assert response.status == 200 and seen == [3, 3, 3, 3]


@pytest.mark.parametrize("value", [True, 1.5, 1.0, "1", None, [1], 2**31, -(2**31) - 1])
@pytest.mark.parametrize("route", ROUTES)
def test_priority_must_be_an_int32(folder, route, value):
    async def go():
        chat, seen = _gateway(folder, allow=True)
        return await call_route(chat, route, priority=value), seen

    response, seen = run(go())
    assert response.status == 400 and body(response)["error"]["param"] == "priority" and seen == []


def test_int32_bounds_are_accepted(folder):
    async def go():
        chat, seen = _gateway(folder, allow=True)
        statuses = [(await call_route(chat, "completions", priority=p)).status for p in (2**31 - 1, -(2**31))]
        return statuses, seen

    statuses, seen = run(go())
    assert statuses == [200, 200] and seen == [2**31 - 1, -(2**31)]


def test_the_typed_grpc_api_checks_priority_as_the_rest_routes_do():
    with pytest.raises(InvalidArgumentError) as refused:
        check_priority(-1, RequestLimits())
    assert refused.value.field == "priority" and "--allow-client-priority" in refused.value.message
    assert check_priority(0, RequestLimits()) == 0
    assert check_priority(-1, RequestLimits(allow_client_priority=True)) == -1


def test_allow_client_priority_is_a_gateway_flag_with_a_variable_that_serve_passes_on(monkeypatch):
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    assert not RequestLimits.from_args(parser.parse_args([])).allow_client_priority
    limits = RequestLimits.from_args(parser.parse_args(["--allow-client-priority"]))
    assert limits.allow_client_priority and limits.to_argv() == ["--allow-client-priority"]
    monkeypatch.setenv("GRIDSERVE_ALLOW_CLIENT_PRIORITY", "1")
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    assert RequestLimits.from_args(parser.parse_args([])).allow_client_priority
