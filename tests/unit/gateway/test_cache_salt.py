"""vLLM's ``cache_salt`` request field: 1-256 characters (HTTP 400 / INVALID_ARGUMENT naming it
otherwise), handed to the engine with every engine request of the completions, chat and Responses
routes and the typed gRPC API, hashed into the first prefix block by the engine's KV-cache manager
and by the gateway's prefix router alike (a salted prompt shares no cached block with an unsalted
or differently salted one)."""

from __future__ import annotations

import pytest

from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.prefix_hash import prompt_block_hashes
from gridserve.shared.request_checks import MAX_CACHE_SALT_CHARS, check_cache_salt
from tests.unit.gateway.scripted_engine import (
    body,
    call_route,
    recording_routes,
    routes,
    run,
    tokenizer_folder,
)

ROUTES = ("completions", "chat", "responses")


@pytest.fixture(scope="module")
def folder(llama_tiny, tmp_path_factory):
    return tokenizer_folder(llama_tiny, tmp_path_factory.mktemp("tok"))


def _gateway(folder):
    """The routes of a gateway and the salts its engine got, one per engine request."""
    return recording_routes(folder, "cache_salt")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_salt_reaches_the_engine_with_every_engine_request(folder, route, stream):
    async def go():
        chat, seen = _gateway(folder)
        salted = await call_route(chat, route, cache_salt="tenant-a", stream=stream)
        chunks = [c async for c in salted.chunks] if stream else []
        plain = await call_route(chat, route)
        return salted, plain, chunks, seen

    salted, plain, chunks, seen = run(go())
    assert salted.status == 200 and plain.status == 200 and seen == ["tenant-a", None]
    assert not stream or chunks


def test_every_sample_of_a_request_carries_its_salt(folder):
    async def go():
        chat, seen = _gateway(folder)
        response = await call_route(chat, "completions", prompt=["Hi", "Ho"], n=2, cache_salt="s", temperature=1.0)
        return response, seen

    response, seen = run(go())
    assert response.status == 200 and seen == ["s"] * 4


@pytest.mark.parametrize("value", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, ["a"], {"a": 1}, True])
@pytest.mark.parametrize("route", ROUTES)
def test_a_bad_salt_is_400_naming_it_and_reaches_no_engine(folder, route, value):
    async def go():
        chat, seen = _gateway(folder)
        return await call_route(chat, route, cache_salt=value), seen

    response, seen = run(go())
    assert response.status == 400 and body(response)["error"]["param"] == "cache_salt" and seen == []


def test_the_longest_salt_is_accepted_and_the_engine_checks_salts_itself(folder):
    async def go():
        chat, seen = _gateway(folder)
        return await call_route(chat, "completions", cache_salt="x" * MAX_CACHE_SALT_CHARS), seen

    response, seen = run(go())
    assert response.status == 200 and seen == ["x" * MAX_CACHE_SALT_CHARS]
    for bad in ("", "x" * (MAX_CACHE_SALT_CHARS + 1)):  # the engine's own check (its gRPC callers)
        with pytest.raises(InvalidArgumentError) as refused:
            check_cache_salt(bad)
        assert refused.value.field == "cache_salt"


def test_a_salt_changes_every_block_hash_the_router_and_the_engine_compute():
    tokens = list(range(1, 65))
    plain = prompt_block_hashes(tokens, 16)
    a, a_again, b = (prompt_block_hashes(tokens, 16, salt) for salt in ("a", "a", "b"))
    assert len(plain) == len(a) == 4
    assert a == a_again  # the same salt shares its prefix
    assert not set(a) & set(plain) and not set(a) & set(b)  # the chain starts from the salted first block


def test_the_router_hashes_the_prompt_with_the_requests_salt(folder, monkeypatch):
    from gridserve.services.gateway.router import Router

    monkeypatch.setattr(Router, "block_size", 4)  # as when the engines' digests name their block size

    async def go():
        chat, _ = routes(folder, "fine")
        service = chat.service
        processed = type("Processed", (), {"prompt_token_ids": list(range(1, 17)), "mm_features": []})()
        return [service._prefix_keys(processed, None, salt) for salt in (None, "tenant-a", "tenant-a")]

    plain, salted, again = run(go())
    assert len(plain) == len(salted) == 4 and not set(plain) & set(salted) and salted == again
