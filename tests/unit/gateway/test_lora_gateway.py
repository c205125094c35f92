"""Multi-LoRA serving, the gateway's part (services/gateway/lora.py, routes.py): a request names an
adapter as its ``model`` and the engine gets ``lora_name``; the base model's name sends none; any
other name is OpenAI's 404. ``/v1/models`` lists the adapters after the base model. The runtime
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` routes: only with ``--api-key``, bodies
checked naming the field, every engine or none (a refusal after others loaded unloads it there),
engine refusals mapped to HTTP. Engines here are in-memory fakes with an adapter table."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Optional

import grpc
import pytest

from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.services.gateway.auth import ApiKeyInterceptor
from gridserve.services.gateway.lora import LoraAdapters
from gridserve.services.gateway.routes import RUNTIME_LORA_OFF, OpenAIRoutes
from gridserve.services.gateway.service import GatewayService
from gridserve.services.gateway.servicer import GatewayServicer
from gridserve.shared.errors import ModelNotFoundError
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.rpc.authz import RULES
from gridserve.shared.rpc.metadata import HTTP_STATUS_HEADER
from gridserve.shared.scheduler_output import TokenLogprobs
from tests.unit.gateway.fake_engine_client import FakeEngineClient
from tests.unit.gateway.test_gateway_admission import _Tokenizer

BASE_TOKEN, ADAPTER_TOKEN = 3, 7  # what the fake engines generate on the base model and on an adapter


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _ChatTokenizer(_Tokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None, tokenize=True,
                            tools=None, chat_template_kwargs=None):
        return self.encode(messages[-1]["content"])


class _LoraEngine(FakeEngineClient):
    """An engine with an adapter table, refusing as the real one does; ``refuse_load``: the error
    its next loads raise."""

    def __init__(self, name: str = "e0", adapters: Optional[dict[str, str]] = None) -> None:
        super().__init__(name)
        self.adapters: dict[str, engine_pb2.LoraAdapter] = {}
        self.next_id = 1
        self.list_calls = 0
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.refuse_load: Optional[grpc.aio.AioRpcError] = None
        self.started = 1600000000.0  # long before the adapters were created
        for adapter, path in (adapters or {}).items():
            self._add(adapter, path)

    def _add(self, name: str, path: str) -> None:
        self.adapters[name] = engine_pb2.LoraAdapter(lora_name=name, lora_int_id=self.next_id, lora_path=path,
                                                     created=1700000000.0 + self.next_id)
        self.next_id += 1

    async def list_lora_adapters(self):
        self.list_calls += 1
        await asyncio.sleep(0)
        return engine_pb2.ListLoraAdaptersResponse(adapters=list(self.adapters.values()), enable_lora=True,
                                                   max_loras=2, max_lora_rank=16, started=self.started)

    async def load_lora_adapter(self, name, path):
        self.loads.append(name)
        if self.refuse_load is not None:
            raise self.refuse_load
        if name in self.adapters:
            raise _rpc_error(grpc.StatusCode.ALREADY_EXISTS, f"lora_name: {name!r} is loaded already")
        self._add(name, path)
        return self.adapters[name]

    async def unload_lora_adapter(self, name):
        self.unloads.append(name)
        if name not in self.adapters:
            raise _rpc_error(grpc.StatusCode.NOT_FOUND, f"no adapter {name!r}")
        del self.adapters[name]

    async def add_request(self, request_id, token_ids, params, parent_request_id="", traceparent="",
                          mm_features=None, output_token_ids=None, continuation=False, **adapter):
        self.added.append((request_id, adapter.get("lora_name")))
        if adapter and adapter["lora_name"] not in self.adapters:
            raise _rpc_error(grpc.StatusCode.NOT_FOUND, f"lora_request.lora_name: no adapter {adapter['lora_name']!r}")
        token = ADAPTER_TOKEN if adapter else BASE_TOKEN
        logprobs = [TokenLogprobs(token_ids=[token], logprobs=[-0.5], sampled_rank=1)] if params.logprobs else []
        self.queues[request_id].put_nowait(EngineCoreOutput(request_id=request_id, new_token_ids=[token],
                                                            new_logprobs=logprobs, finish_reason=FinishReason.LENGTH))


def _service(*engines: _LoraEngine) -> GatewayService:
    return GatewayService(_ChatTokenizer(), list(engines), "base-path", 64, 100, 20)


def _routes(*engines: _LoraEngine, runtime: bool = True) -> OpenAIRoutes:
    return OpenAIRoutes(_service(*engines), "base", runtime_lora_updating=runtime)


def _json(response) -> dict:
    return json.loads(b"".join(response.chunks))


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


def _run(coro):
    return asyncio.run(coro)


# ---- naming an adapter as the model --------------------------------------------------------------
def test_an_adapter_named_as_model_reaches_the_engine_and_the_base_name_sends_none():
    async def go():
        engine = _LoraEngine(adapters={"sql": "/adapters/sql"})
        routes = _routes(engine)
        base = await routes.completions(_body(model="base", prompt="AB", max_tokens=1))
        assert base.status == 200 and _json(base)["model"] == "base"
        assert await routes.completions(_body(prompt="AB", max_tokens=1)) is not None  # no model: the base
        tuned = await routes.completions(_body(model="sql", prompt="AB", max_tokens=1))
        reply = _json(tuned)
        assert tuned.status == 200 and reply["model"] == "sql"  # vLLM answers with the adapter's name
        assert [lora for _, lora in engine.added] == [None, None, "sql"]
        chat = await routes.chat_completions(_body(model="sql", messages=[{"role": "user", "content": "AB"}],
                                                   max_tokens=1))
        assert chat.status == 200 and _json(chat)["model"] == "sql" and engine.added[-1][1] == "sql"
        stream = await routes.chat_completions(_body(model="sql", messages=[{"role": "user", "content": "AB"}],
                                                     max_tokens=1, stream=True))
        events = [c async for c in stream.chunks]
        assert json.loads(events[0].removeprefix(b"data: "))["model"] == "sql" and engine.added[-1][1] == "sql"

    _run(go())


def test_beam_search_and_the_responses_api_run_on_the_adapter_too():
    async def go():
        from gridserve.services.gateway.responses_api import ResponsesAPI

        engine = _LoraEngine(adapters={"sql": "/adapters/sql"})
        routes = _routes(engine)
        response = await ResponsesAPI(routes).create(_body(model="sql", input="AB", max_output_tokens=1))
        assert response.status == 200, _json(response)
        assert _json(response)["model"] == "sql" and engine.added[-1][1] == "sql"
        beam = await routes.completions(_body(model="sql", prompt="AB", max_tokens=1, use_beam_search=True, n=2))
        assert beam.status == 200, _json(beam)
        assert engine.added[-1][1] == "sql"

    _run(go())


def test_an_unknown_model_is_openais_404_and_reaches_no_engine():
    async def go():
        engine = _LoraEngine(adapters={"sql": "/adapters/sql"})
        routes = _routes(engine)
        for route, body in ((routes.completions, _body(model="nope", prompt="AB")),
                            (routes.chat_completions, _body(model="nope", messages=[{"role": "user", "content": "A"}])),
                            (routes.tokenize, _body(model="nope", prompt="AB"))):
            response = await route(body)
            assert response.status == 404
            assert _json(response) == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                                 "param": "model", "code": 404}}
        assert engine.added == []
        assert (await routes.tokenize(_body(model="sql", prompt="AB"))).status == 200  # the base model's tokenizer

    _run(go())


def test_an_adapter_unloaded_behind_the_gateways_copy_is_a_404_too():
    async def go():
        engine = _LoraEngine(adapters={"sql": "/adapters/sql"})
        routes = _routes(engine)
        assert (await routes.completions(_body(model="sql", prompt="AB", max_tokens=1))).status == 200
        del engine.adapters["sql"]  # another gateway replica unloaded it; this one's copy is still fresh
        response = await routes.completions(_body(model="sql", prompt="AB", max_tokens=1))
        assert response.status == 404 and _json(response)["error"]["param"] == "model"
        assert "`sql` does not exist" in _json(response)["error"]["message"]

    _run(go())


def test_the_adapter_table_is_cached_briefly_refreshed_on_a_miss_and_shared_by_concurrent_misses():
    async def go():
        now = [0.0]
        engines = [_LoraEngine("e0", {"a": "/a"}), _LoraEngine("e1", {"a": "/a"})]
        table = LoraAdapters(engines, ttl_s=2.0, clock=lambda: now[0])
        assert (await table.lookup("a")).path == "/a"
        assert (await table.lookup("a")).path == "/a"
        assert [e.list_calls for e in engines] == [1, 1]  # the second lookup was a hit
        engines[0]._add("b", "/b")  # loaded through another replica
        engines[1]._add("b", "/b")
        assert (await table.lookup("b")).path == "/b"  # a miss asks again
        assert [e.list_calls for e in engines] == [2, 2]
        now[0] = 5.0  # the copy is old: a hit asks again too
        assert await table.lookup("a") is not None and engines[0].list_calls == 3
        # Twenty clients naming unknown models at once: one listing in flight, then one more for them all.
        results = await asyncio.gather(*(table.lookup(f"unknown-{i}") for i in range(20)))
        assert results == [None] * 20 and engines[0].list_calls <= 5

    _run(go())


def test_without_enable_lora_unknown_names_ask_the_engines_once_per_ttl():
    async def go():
        now = [0.0]
        engine = _LoraEngine()
        plain = engine.list_lora_adapters

        async def no_lora():
            answer = await plain()
            answer.enable_lora = False
            return answer

        engine.list_lora_adapters = no_lora
        table = LoraAdapters([engine], ttl_s=2.0, clock=lambda: now[0])
        assert [await table.lookup(f"x{i}") for i in range(10)] == [None] * 10
        assert engine.list_calls == 1
        now[0] = 3.0
        assert await table.lookup("y") is None and engine.list_calls == 2

    _run(go())


def test_every_replica_sees_the_same_adapters_because_only_the_engines_keep_them():
    async def go():
        engine = _LoraEngine()
        first, second = _routes(engine), _routes(engine)
        assert (await first.load_lora_adapter(_body(lora_name="sql", lora_path="/a/sql"))).status == 200
        assert (await second.completions(_body(model="sql", prompt="AB", max_tokens=1))).status == 200
        assert [c["id"] for c in _json(await second.models())["data"]] == ["base", "sql"]

    _run(go())


# ---- /v1/models ----------------------------------------------------------------------------------
def test_models_lists_the_adapters_after_the_base_model_with_parent_and_root():
    async def go():
        engines = [_LoraEngine("e0", {"sql": "/adapters/sql", "chat": "/adapters/chat"}),
                   _LoraEngine("e1", {"sql": "/adapters/sql", "chat": "/adapters/chat"})]
        cards = _json(await _routes(*engines).models())["data"]
        assert [c["id"] for c in cards] == ["base", "sql", "chat"]
        assert cards[0]["parent"] is None and cards[0]["root"] == "base-path" and cards[0]["max_model_len"] == 64
        assert {k: cards[1][k] for k in ("id", "object", "owned_by", "parent", "root")} == {
            "id": "sql", "object": "model", "owned_by": "gridserve", "parent": "base", "root": "/adapters/sql"}
        assert cards[1]["created"] == 1700000001
        engines[0].ready.clear()
        engines[1].ready.clear()  # no engine to ask: the base model is still listed
        routes = _routes(*engines)
        assert [c["id"] for c in _json(await routes.models())["data"]] == ["base"]

    _run(go())


# ---- runtime loading -----------------------------------------------------------------------------
def test_without_an_api_key_the_load_routes_are_403_naming_both_switches():
    async def go():
        engine = _LoraEngine()
        routes = _routes(engine, runtime=False)
        for response in (await routes.load_lora_adapter(_body(lora_name="sql", lora_path="/a")),
                         await routes.unload_lora_adapter(_body(lora_name="sql"))):
            error = _json(response)["error"]
            assert response.status == 403 and error["type"] == "PermissionDeniedError" and error["code"] == 403
            assert "--api-key" in error["message"] and "--allow-runtime-lora-updating" in error["message"]
        assert RUNTIME_LORA_OFF in error["message"]
        assert engine.loads == engine.unloads == []

    _run(go())


def test_load_use_unload_then_the_name_is_404():
    async def go():
        engines = [_LoraEngine("e0"), _LoraEngine("e1")]
        routes = _routes(*engines)
        _ = _json(await routes.models())  # a copy of the (empty) table, fresh for a while
        loaded = await routes.load_lora_adapter(_body(lora_name="sql", lora_path="/adapters/sql"))
        assert loaded.status == 200 and loaded.content_type.startswith("text/plain")
        assert b"".join(loaded.chunks) == b"Success: LoRA adapter 'sql' added successfully."
        assert [list(e.adapters) for e in engines] == [["sql"], ["sql"]]  # every engine (data parallel)
        assert [c["id"] for c in _json(await routes.models())["data"]] == ["base", "sql"]  # not the stale copy
        used = await routes.completions(_body(model="sql", prompt="AB", max_tokens=1))
        assert used.status == 200 and _json(used)["choices"][0]["text"] != ""
        unloaded = await routes.unload_lora_adapter(_body(lora_name="sql", lora_int_id=1))
        assert unloaded.status == 200
        assert b"".join(unloaded.chunks) == b"Success: LoRA adapter 'sql' removed successfully."
        again = await routes.completions(_body(model="sql", prompt="AB", max_tokens=1))
        assert again.status == 404 and _json(again)["error"]["type"] == "NotFoundError"
        gone = await routes.unload_lora_adapter(_body(lora_name="sql"))
        assert gone.status == 404 and _json(gone)["error"]["message"] == "The lora adapter 'sql' cannot be found."

    _run(go())


@pytest.mark.parametrize("body, param", [
    (dict(lora_name="sql"), "lora_path"),
    (dict(lora_path="/a"), "lora_name"),
    (dict(lora_name="sql", lora_path=3), "lora_path"),
    (dict(lora_name=["sql"], lora_path="/a"), "lora_name"),
    (dict(lora_name="sql", lora_path="/a", lora_rank=8), "lora_rank"),
    (dict(lora_name="", lora_path="/a"), "lora_name"),
    (dict(lora_name="x" * 257, lora_path="/a"), "lora_name"),
    (dict(lora_name="sql", lora_path="/" + "a" * 5000), "lora_path"),
    (dict(lora_name=" sql", lora_path="/a"), "lora_name"),
    (dict(lora_name="base", lora_path="/a"), "lora_name"),  # the base model's own name
])
def test_a_bad_load_body_is_400_naming_the_field_and_reaches_no_engine(body, param):
    async def go():
        engine = _LoraEngine()
        response = await _routes(engine).load_lora_adapter(json.dumps(body).encode())
        error = _json(response)["error"]
        assert response.status == 400 and error["param"] == param, error
        assert engine.loads == []

    _run(go())


@pytest.mark.parametrize("body, param", [
    (dict(), "lora_name"),
    (dict(lora_name="sql", lora_int_id="1"), "lora_int_id"),
    (dict(lora_name="sql", lora_int_id=-1), "lora_int_id"),
    (dict(lora_name="sql", other=1), "other"),
])
def test_a_bad_unload_body_is_400_naming_the_field(body, param):
    async def go():
        engine = _LoraEngine(adapters={"sql": "/a"})
        response = await _routes(engine).unload_lora_adapter(json.dumps(body).encode())
        assert response.status == 400 and _json(response)["error"]["param"] == param
        assert engine.unloads == [] and "sql" in engine.adapters

    _run(go())


@pytest.mark.parametrize("code, details, status, param", [
    (grpc.StatusCode.INVALID_ARGUMENT, "lora_path: /etc/x is outside --lora-dir /adapters", 400, "lora_path"),
    (grpc.StatusCode.INVALID_ARGUMENT, "adapter_config.r: rank 64 is above --max-lora-rank 16", 400,
     "adapter_config.r"),
    (grpc.StatusCode.ALREADY_EXISTS, "sql is loaded already", 400, "lora_name"),
    (grpc.StatusCode.PERMISSION_DENIED, "start the engine with --allow-runtime-lora-updating", 403, "lora_name"),
    (grpc.StatusCode.FAILED_PRECONDITION, "this engine serves no LoRA adapters (--enable-lora)", 403, "lora_name"),
    (grpc.StatusCode.UNAVAILABLE, "connection refused", 503, None),
    (grpc.StatusCode.UNIMPLEMENTED, "unknown method", 501, None),
])
def test_engine_refusals_map_to_http(code, details, status, param):
    async def go():
        engine = _LoraEngine()
        engine.refuse_load = _rpc_error(code, details)
        response = await _routes(engine).load_lora_adapter(_body(lora_name="sql", lora_path="/a"))
        error = _json(response)["error"]
        assert (response.status, error["param"], error["code"]) == (status, param, status), error
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert error["message"] == details  # the engine's words, naming the field
        if code == grpc.StatusCode.ALREADY_EXISTS:
            assert error["message"] == "The lora adapter 'sql' has already been loaded."  # vLLM's words

    _run(go())


def test_a_refusal_after_other_engines_loaded_unloads_it_there_and_is_the_answer():
    async def go():
        engines = [_LoraEngine("e0"), _LoraEngine("e1"), _LoraEngine("e2")]
        engines[2].refuse_load = _rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                                            "adapter_config.target_modules: the model has no module 'c_attn'")
        routes = _routes(*engines)
        response = await routes.load_lora_adapter(_body(lora_name="sql", lora_path="/a"))
        assert response.status == 400 and _json(response)["error"]["param"] == "adapter_config.target_modules"
        assert [e.loads for e in engines] == [["sql"], ["sql"], ["sql"]]
        assert [e.unloads for e in engines] == [["sql"], ["sql"], []]  # rolled back where it had loaded
        assert all(not e.adapters for e in engines)  # no half-loaded state
        assert (await routes.completions(_body(model="sql", prompt="AB"))).status == 404

    _run(go())


def test_a_name_in_use_on_the_first_engine_touches_no_other():
    async def go():
        engines = [_LoraEngine("e0", {"sql": "/old"}), _LoraEngine("e1", {"sql": "/old"})]
        response = await _routes(*engines).load_lora_adapter(_body(lora_name="sql", lora_path="/new"))
        assert response.status == 400
        assert [e.loads for e in engines] == [["sql"], []] and [e.unloads for e in engines] == [[], []]
        assert [e.adapters["sql"].lora_path for e in engines] == ["/old", "/old"]

    _run(go())


def test_an_unreachable_engine_refuses_the_load_before_any_engine_loads():
    async def go():
        engines = [_LoraEngine("e0"), _LoraEngine("e1")]
        engines[1].ready.clear()
        response = await _routes(*engines).load_lora_adapter(_body(lora_name="sql", lora_path="/a"))
        assert response.status == 503 and "e1" in _json(response)["error"]["message"]
        assert [e.loads for e in engines] == [[], []]

    _run(go())


def test_unload_finishes_a_half_done_unload_and_a_client_leaving_does_not_stop_a_load():
    async def go():
        engines = [_LoraEngine("e0"), _LoraEngine("e1", {"sql": "/a"})]  # an earlier unload reached e0 only
        routes = _routes(*engines)
        assert (await routes.unload_lora_adapter(_body(lora_name="sql"))).status == 200
        assert not engines[1].adapters
        gate = asyncio.Event()
        slow = engines[1].load_lora_adapter

        async def held(name, path):
            await gate.wait()
            return await slow(name, path)

        engines[1].load_lora_adapter = held
        task = asyncio.ensure_future(routes.load_lora_adapter(_body(lora_name="sql", lora_path="/a")))
        await asyncio.sleep(0.01)
        task.cancel()  # the caller went away half-way
        gate.set()
        await asyncio.sleep(0.01)
        assert [list(e.adapters) for e in engines] == [["sql"], ["sql"]]  # all, not half

    _run(go())


# ---- the gRPC API and the key ------------------------------------------------------------------------
class _Context:
    def __init__(self) -> None:
        self.sent: list = []

    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()

    async def send_initial_metadata(self, metadata):
        self.sent.append(tuple(metadata))


def test_the_grpc_api_takes_a_model_name_and_lists_the_adapters():
    async def go():
        engine = _LoraEngine(adapters={"sql": "/adapters/sql"})
        servicer = GatewayServicer(_service(engine), "base", runtime_lora_updating=True)
        sampling = {"max_tokens": 1}
        reply = await servicer.Complete(gateway_pb2.CompleteRequest(text="AB", model="sql", sampling_params=sampling),
                                        _Context())
        assert reply.completions[0].token_ids == [ADAPTER_TOKEN] and engine.added[-1][1] == "sql"
        for named in ({}, {"model": "base"}, {"model": "base-path"}):  # no name, the served name, ListModels' id
            reply = await servicer.Complete(gateway_pb2.CompleteRequest(text="AB", sampling_params=sampling, **named),
                                            _Context())
            assert reply.completions[0].token_ids == [BASE_TOKEN] and engine.added[-1][1] is None
        with pytest.raises(ModelNotFoundError, match="`nope` does not exist"):  # NOT_FOUND over gRPC
            await servicer.Complete(gateway_pb2.CompleteRequest(text="AB", model="nope"), _Context())
        models = (await servicer.ListModels(gateway_pb2.ListModelsRequest(), _Context())).models
        assert [(m.id, m.parent, m.root) for m in models] == [("base-path", "", "base-path"),
                                                               ("sql", "base-path", "/adapters/sql")]
        context = _Context()
        body = await servicer.OpenAILoadLoraAdapter(SimpleNamespace(data=_body(lora_name="x", lora_path="/x")), context)
        assert body.data.startswith(b"Success") and context.sent == []
        context = _Context()
        await servicer.OpenAIUnloadLoraAdapter(SimpleNamespace(data=_body(lora_name="nope")), context)
        assert context.sent == [((HTTP_STATUS_HEADER, "404"),)]

    _run(go())


def test_with_an_api_key_the_load_routes_need_it_and_the_tables_have_their_rows():
    async def refused(method: str, metadata: tuple) -> bool:
        async def behavior(request, context):
            return b"reached"

        async def continuation(details):
            return grpc.unary_unary_rpc_method_handler(behavior)

        details = SimpleNamespace(method=method, invocation_metadata=metadata)
        handler = await ApiKeyInterceptor("s3cret").intercept_service(continuation, details)
        context = _Context()
        answer = await handler.unary_unary(None, context)
        return answer != b"reached" and context.sent == [((HTTP_STATUS_HEADER, "401"),)]

    async def go():
        for name in ("OpenAILoadLoraAdapter", "OpenAIUnloadLoraAdapter"):
            method = f"/gridserve.gateway.v1.Gateway/{name}"
            assert await refused(method, ())
            assert await refused(method, (("authorization", "Bearer wrong"),))
            assert not await refused(method, (("authorization", "Bearer s3cret"),))
            assert RULES[method] == {"edge", "admin"}

    _run(go())
    for name in ("LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters"):
        assert RULES[f"/gridserve.engine.v1.EngineCore/{name}"] == {"gateway", "admin"}


def test_the_openapi_document_lists_the_load_routes():
    async def go():
        doc = _json(await _routes(_LoraEngine()).openapi())
        for path, model in (("/v1/load_lora_adapter", "LoadLoraAdapterRequest"),
                            ("/v1/unload_lora_adapter", "UnloadLoraAdapterRequest")):
            operation = doc["paths"][path]["post"]
            assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
            assert "text/plain" in operation["responses"]["200"]["content"] and "403" in operation["responses"]
        assert set(doc["components"]["schemas"]["LoadLoraAdapterRequest"]["required"]) == {"lora_name", "lora_path"}

    _run(go())


def test_an_engine_that_restarted_gets_the_runtime_adapters_back_and_an_unload_is_not_undone():
    async def run():
        serving = _LoraEngine("e0", {"sql": "/adapters/sql"})
        restarted = _LoraEngine("e1")
        restarted.started = 1800000000.0  # after "sql" was created: it came back with --lora-modules only
        unloaded = _LoraEngine("e2")  # running all along: it lacks "sql" because an unload reached it first
        service = _service(serving, restarted, unloaded)
        await service.loras.refresh()
        await asyncio.gather(*service.loras._repairs)
        return serving, restarted, unloaded

    serving, restarted, unloaded = _run(run())
    assert restarted.loads == ["sql"] and restarted.adapters["sql"].lora_path == "/adapters/sql"
    assert unloaded.loads == [] and serving.loads == []
