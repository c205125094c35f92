"""Images through ``gridserve serve`` (worker, engine, gateway, Envoy) with the ``openai`` client:
``data:`` and ``http://127.0.0.1`` images (loopback allowed by a test-only hook) answer as the
offline ``LLM`` does, a ``data:`` image up to the size limit passes the edge, slow / disallowed /
oversized images are 400 naming the part, and the same image twice hits the prefix cache over its
tokens (engine metrics)."""

from __future__ import annotations

import base64
import io
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from gridserve import LLM, SamplingParams
from gridserve.launcher import free_port

from .services import deployment

pytestmark = pytest.mark.slow

MAX_IMAGE_BYTES = 3_000_000
MAX_TOKENS = 8


def _png(seed: int, height: int = 40, width: int = 52) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class _Images(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            time.sleep(3)
        body = _png(int(self.path.strip("/").split(".")[0])) if self.path[1:2].isdigit() else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def images():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def served(llava_tiny, tmp_path_factory):
    gateway_args = ["--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout-s", "1",
                    "--max-image-bytes", str(MAX_IMAGE_BYTES)]
    engine_args = ["--kv-cache-memory-bytes", str(16 << 20), "--max-num-seqs", "16"]
    # The image server is on loopback, which a gateway never fetches from but with this test hook.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRIDSERVE_TEST_HOOKS", "1")
        patch.setenv("GRIDSERVE_TEST_MEDIA_LOOPBACK", "1")
        with deployment(llava_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(),
                        engine_args=engine_args, gateway_args=gateway_args) as launcher:
            yield launcher


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{served.edge_address}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(llava_tiny):
    llm = LLM(model=str(llava_tiny), kv_cache_memory_bytes=16 << 20)
    yield llm
    llm.shutdown()


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this picture?"}]}]


def _chat(client, url: str) -> str:
    response = client.chat.completions.create(model=str(client.models.list().data[0].id), messages=_messages(url),
                                              max_tokens=MAX_TOKENS, temperature=0.0)
    return response.choices[0].message.content


def _offline_text(offline: LLM, seed: int) -> str:
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": Image.open(io.BytesIO(_png(seed)))},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return offline.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def _bad_request(client, url: str, match: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, url)
    assert "messages[0].content[0]" in str(err.value) and match in str(err.value), str(err.value)


def test_data_url_and_http_url_images_answer_as_offline(client, offline, images):
    expected = _offline_text(offline, 1)
    assert _chat(client, _data_url(_png(1))) == expected
    assert _chat(client, f"{images}/1.png") == expected
    assert _chat(client, f"{images}/2.png") == _offline_text(offline, 2) != expected


def test_a_data_image_up_to_the_size_limit_passes_the_edge(client):
    side = int((MAX_IMAGE_BYTES / 3) ** 0.5) - 8  # random pixels: PNG cannot compress them
    big = _png(3, side, side)
    assert MAX_IMAGE_BYTES * 0.9 < len(big) <= MAX_IMAGE_BYTES
    assert isinstance(_chat(client, _data_url(big)), str)
    _bad_request(client, _data_url(_png(3, side + 40, side + 40)), "larger than")


def test_slow_disallowed_and_undecodable_images_are_400_naming_the_part(client, images):
    start = time.monotonic()
    _bad_request(client, f"{images}/slow.png", "cannot fetch the image URL")  # one generic message
    assert time.monotonic() - start < 3
    _bad_request(client, images.replace("127.0.0.1", "localhost") + "/1.png", "not allowed")
    _bad_request(client, _data_url(b"not a png"), "cannot decode")
    _bad_request(client, f"{images}/missing.png", "cannot fetch the image URL")


def test_tokenize_counts_each_image_as_its_tokens(served):
    import json

    def count(content) -> int:
        body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
        request = urllib.request.Request(f"http://{served.edge_address}/tokenize", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.loads(resp.read())["count"]

    text = count([{"type": "text", "text": "What is in this picture?"}])
    one = count(_messages(_data_url(_png(1)))[0]["content"])
    assert one == text + 25


def _prefix_hits(served) -> float:
    engine = next(p for p in served.processes if p.role == "engine")
    with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    return sum(s.value for f in families for s in f.samples if s.name == "vllm:prefix_cache_hits_total")


def test_the_same_image_twice_hits_the_prefix_cache_over_its_tokens(client, served, images):
    _chat(client, f"{images}/4.png")
    before = _prefix_hits(served)
    _chat(client, f"{images}/4.png")
    after_same = _prefix_hits(served)
    _chat(client, f"{images}/5.png")
    after_other = _prefix_hits(served)
    image_end = 3 + 25  # "<|im_start|>user\n" then the image's 25 tokens
    assert after_same - before >= image_end
    assert after_other == after_same  # the first block already holds image tokens: no hit
