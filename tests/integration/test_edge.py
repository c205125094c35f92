"""The Envoy edge of ``gridserve serve``: REST (gRPC-JSON transcoding) and native gRPC on one port.

One deployment (worker, engine, gateway, real Envoy on a free loopback port) for the module.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from gridserve import LLM, SamplingParams
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.launcher import free_port

from .services import KV_BYTES, deployment, gateway_stub, greedy, token_prompt

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 300, 42, 901, 7]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def edge(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port()) as launcher:
        yield launcher


def _url(launcher, path: str) -> str:
    return f"http://{launcher.edge_address}{path}"


def _request(url: str, body=None) -> tuple[int, dict, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def test_edge_is_in_the_process_table_and_stops_with_the_rest(edge):
    assert [p.role for p in edge.processes][-1] == "edge"
    assert "edge" in edge.table()
    assert edge.edge_address.endswith(f":{edge.edge_port}")


def test_rest_through_envoy_reaches_the_gateway(edge):
    status, headers, body = _request(_url(edge, "/v1/gridserve/models"))
    assert status == 200, body
    assert headers["content-type"].startswith("application/json")
    models = json.loads(body)["models"]
    assert len(models) == 1 and models[0]["owned_by"] == "gridserve" and models[0]["max_model_len"] > 0


def test_rest_completion_equals_offline_llm(edge, llama_tiny):
    body = {"token_ids": {"ids": PROMPT},
            "sampling_params": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS}}
    status, _, text = _request(_url(edge, "/v1/gridserve/complete"), body)
    assert status == 200, text
    completion = json.loads(text)["completions"][0]
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        (ref,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert completion["token_ids"] == ref.outputs[0].token_ids
    assert completion["text"] == ref.outputs[0].text


def test_invalid_argument_becomes_http_400(edge):
    body = {"token_ids": {"ids": PROMPT}, "sampling_params": {"temperature": -1.0, "max_tokens": 4}}
    status, _, text = _request(_url(edge, "/v1/gridserve/complete"), body)
    assert status == 400, text
    assert "temperature" in text


def test_native_grpc_on_the_same_port(edge):
    with grpc.insecure_channel(edge.edge_address) as channel:
        stub = gateway_stub(channel)
        ids = []
        for response in stub.Generate(token_prompt(PROMPT, greedy(MAX_TOKENS)), timeout=60):
            ids += response.token_ids
        assert len(ids) == MAX_TOKENS
        models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
        assert models.models[0].max_model_len > 0


# ---- the OpenAI-compatible API, with the official openai client --------------------------------
@pytest.fixture(scope="module")
def client(edge):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{edge.edge_address}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(llama_tiny):
    return str(llama_tiny)  # --served-model-name defaults to the model argument


@pytest.fixture(scope="module")
def offline(llama_tiny):
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES)
    yield llm
    llm.shutdown()


def test_openai_models_list(client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]


def test_openai_completion_equals_offline_llm(client, model_name, offline):
    prompt = "def fibonacci(n):"
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    (ref,) = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert out.object == "text_completion" and out.model == model_name
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_openai_chat_completion(client, model_name, offline):
    messages = [{"role": "user", "content": "Say hello."}]
    out = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=MAX_TOKENS,
                                         temperature=0)
    (ref,) = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text


def test_openai_streaming_completion_ends_with_done(client, model_name, edge):
    prompt = "import os\n"
    full = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    body = {"model": model_name, "prompt": prompt, "max_tokens": 3, "stream": True}
    status, headers, raw = _request(_url(edge, "/v1/completions"), body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


def test_openai_streaming_chat_first_chunk_has_role(client, model_name):
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_openai_errors_are_openai_shaped(client, model_name, edge):
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model_name, prompt="x", max_tokens=4, temperature=-1.0)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == "temperature" and "temperature" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    assert missing.value.status_code == 404 and missing.value.body["param"] == "model"
    status, _, text = _request(_url(edge, "/v1/chat/completions"), {"model": model_name, "messages": []})
    assert status == 400 and json.loads(text)["error"]["param"] == "messages"


def test_an_image_part_for_this_text_only_model_is_400_naming_the_part(client, model_name):
    import openai

    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": png}}]}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=4)
    assert bad.value.body["param"] == "messages[0].content[1]" and "text only" in bad.value.body["message"]


def test_health_and_version(edge):
    status, _, _ = _request(_url(edge, "/health"))
    assert status == 200
    status, _, text = _request(_url(edge, "/version"))
    assert status == 200 and json.loads(text)["version"]


def test_openai_n_logprobs_stop_seed_and_length(client, model_name, offline):
    prompt = "class Foo:"
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, n=2,
                                    temperature=1.0, seed=7, logprobs=2)
    again = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, n=2,
                                      temperature=1.0, seed=7, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seed reproducibility
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    greedy_out = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert greedy_out.choices[0].finish_reason == "length"
    text = greedy_out.choices[0].text
    stop = text[len(text) // 2:][:2]
    if stop.strip():
        stopped = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, stop=[stop])
        (ref,) = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop]),
                                  use_tqdm=False)
        assert stopped.choices[0].text == ref.outputs[0].text
        assert stopped.choices[0].finish_reason == "stop"
    batch = client.completions.create(model=model_name, prompt=[PROMPT, PROMPT[:3]], max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]


def test_tokenize_and_detokenize_routes(edge, model_name):
    status, _, text = _request(_url(edge, "/tokenize"), {"model": model_name, "prompt": "def main():"})
    assert status == 200, text
    tokenized = json.loads(text)
    assert tokenized["count"] == len(tokenized["tokens"]) > 0 and tokenized["max_model_len"] > 0
    status, _, text = _request(_url(edge, "/detokenize"), {"model": model_name, "tokens": tokenized["tokens"]})
    assert status == 200 and json.loads(text)["prompt"].endswith("def main():")
    status, _, text = _request(_url(edge, "/tokenize"),
                               {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True})
    assert status == 200 and json.loads(text)["count"] > 2
    status, _, text = _request(_url(edge, "/detokenize"), {"tokens": [10**9]})
    assert status == 400 and json.loads(text)["error"]["param"] == "tokens"


def test_curl_n_shows_events_one_by_one_then_done(edge, model_name):
    """``curl -N`` (no buffering) prints each SSE event as its engine step finishes."""
    import shutil
    import subprocess
    import time

    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": model_name, "prompt": "x", "max_tokens": 48, "min_tokens": 48,
                       "temperature": 0, "stream": True})
    start = time.monotonic()
    proc = subprocess.Popen([curl, "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
                             _url(edge, "/v1/completions")], stdout=subprocess.PIPE, text=True)
    arrivals = []
    for line in proc.stdout:
        if line.startswith("data: "):
            arrivals.append((time.monotonic() - start, line.strip()))
    assert proc.wait(timeout=60) == 0
    assert arrivals[-1][1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0]["text"] for _, line in arrivals[:-1]]
    assert len(texts) >= 2 and sum(map(bool, texts)) >= 2
    first, done = arrivals[0][0], arrivals[-1][0]
    # Buffered to the end, every event would arrive with [DONE]: the first comes well before it.
    assert done - first > 0.25 * done, arrivals


def test_client_leaving_a_rest_stream_aborts_it_and_frees_its_kv_blocks(edge, model_name):
    """The streaming routes run on the gateway's asyncio loop: a client that hangs up mid-stream
    cancels the handler, which aborts the engine request (it does not run on to max_tokens)."""
    import socket
    import time

    from gridserve.api.engine.v1 import engine_pb2

    from .services import address, engine_stub

    engine = engine_stub(grpc.insecure_channel(address(edge, "engine")))
    idle = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
    # ~500 steps: long enough that it is still running when the client leaves.
    body = json.dumps({"model": model_name, "prompt": PROMPT, "max_tokens": 500, "min_tokens": 500,
                       "temperature": 0, "stream": True}).encode()
    host, port = edge.edge_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data: ") < 3:  # the stream is running
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise AssertionError(f"no stream: {received[:500]!r}") from None
            assert chunk, received
            received += chunk
        assert b"200 OK" in received.split(b"\r\n", 1)[0]
        first_event = received[received.index(b"data: ") + 6:].split(b"\n", 1)[0]
        request_id = json.loads(first_event)["id"].removeprefix("cmpl-")
        running = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        assert running.num_running == 1 and running.kv_free_blocks < idle.kv_free_blocks
    deadline = time.monotonic() + 15
    while True:  # the socket is closed: Envoy resets the gRPC stream, the gateway aborts
        load = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        if load.num_running == 0 and load.num_waiting == 0 and load.kv_free_blocks == idle.kv_free_blocks:
            break
        assert time.monotonic() < deadline, f"not aborted: {load}"
        time.sleep(0.1)
    # The engine's log line for it: finished by the abort, long before its 500 tokens.
    engine_log = (edge.log_dir / "engine-0.log").read_text()
    line = next(x for x in engine_log.splitlines() if f"request {request_id} finished" in x)
    assert "finished (abort)" in line, line
    assert int(line.split("generated ")[1].split(",")[0]) < 500, line


def test_openapi_json_through_the_edge_describes_the_rest_routes(edge):
    status, headers, text = _request(_url(edge, "/openapi.json"))
    assert status == 200 and headers["content-type"].startswith("application/json")
    document = json.loads(text)
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(document["paths"])
    fields = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["seed"]["anyOf"][0]["maximum"] == 2**63 - 1  # ranges are data in the models
