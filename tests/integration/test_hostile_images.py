"""Hostile images end to end, and the edge under slowloris plus hostile images (issue 38).

One Llava deployment (worker, engine, gateway, real Envoy on loopback, a 2 s headers timeout) whose
gateway fetches image URLs from one host, ``localhost`` (``--allowed-media-domains localhost``,
``--media-fetch-timeout-s 1``). The image server (``MediaServer`` of benchmarks/fuzz.py: a small
PNG, a body trickled for seconds, redirects to 127.0.0.1 and to 169.254.169.254) is on loopback,
which a gateway never fetches from but with the test hook ``GRIDSERVE_TEST_MEDIA_LOOPBACK``
(loopback addresses pass the address check; every other private address stays refused). Through
the edge:

- a slow URL (its first hop allowed, its body trickled past the deadline) is a 400 at the
  deadline, and ten at once (more than the loader's 8 threads) do not stall the next image: each
  loader thread is freed at its deadline;
- a redirect to 127.0.0.1 is a 400 and its target is never fetched. Here the hop is refused by the
  re-check of the allowlist (127.0.0.1 is not ``localhost``): the address check itself cannot be
  shown end to end with a server on loopback, since the hook that lets the first hop reach it lets
  every loopback address through, and without it the first hop is refused before any fetch. So the
  first test shows the address check on the gateway's own routes in this process: a real
  ``MediaLoader`` with the production address policy and ``--allowed-media-domains '*'``, the
  image host resolved to a public address, and only connections to that address steered to the
  local server — the redirect to 127.0.0.1 is refused by the address check, never dialled;
- the fuzzer's image cases (``fuzz_images``) against a model that takes images;
- slowloris and hostile image requests at once: a normal client's probe answered throughout, its
  p99 reported (printed with ``-s`` and in the assertion messages; the bound is functional: every
  probe a 200 within 10 s; the 2x-of-idle bar is ``gridserve bench slowloris``'s).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from gridserve.benchmarks.fuzz import (
    Fuzzer,
    MediaServer,
    bomb_png,
    data_url,
    fuzz_images,
    media_problems,
    png,
    settled,
)
from gridserve.benchmarks.slowloris import SlowClients, probe
from gridserve.edge import EdgeLimits
from gridserve.launcher import free_port
from gridserve.services.gateway import url_fetcher
from gridserve.services.gateway.limits import RequestLimits
from gridserve.services.gateway.media_loader import MediaConfig, MediaLoader
from gridserve.services.gateway.multimodal import MultiModalProcessor
from gridserve.services.gateway.routes import OpenAIRoutes

from .services import address, deployment

pytestmark = pytest.mark.slow

DEADLINE_S = 1.0  # the gateway's --media-fetch-timeout-s
SLOW_BODY_S = 8.0  # the slow URL trickles this long: far past the deadline
HEADERS_TIMEOUT_S = 2.0
SLOW_CLIENTS = 48
TIMEOUT_S = 15
GENERIC = "cannot fetch the image URL"
FIELD = "messages[0].content[0]"


def _chat(*urls: str, max_tokens: int = 2) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}],
            "max_tokens": max_tokens, "temperature": 0.0}


def _hostile(media: MediaServer) -> list[tuple[str, dict]]:
    """The image cases of the issue, each a request that must be a 400."""
    return [("bomb", _chat(data_url(bomb_png()))), ("aspect 1x5000", _chat(data_url(png(1, 5000)))),
            ("100 images", _chat(*[data_url(png())] * 100)), ("slow URL", _chat(media.url("/slow.png"))),
            ("redirect to 127.0.0.1", _chat(media.url("/to-loopback"))),
            ("redirect to 169.254.169.254", _chat(media.url("/to-metadata")))]


# ---- in process: the gateway's routes, a real media loader, the production address policy -------
PUBLIC = "93.184.216.34"  # a public address; never dialled: its connections are steered to the local server
NAME = "images.example"


class _Service:
    """What the ``/tokenize`` route uses of ``GatewayService``: a real media loader and the Llava
    processor; the chat template stands in as one image placeholder between two tokens."""

    model_name = "llava"
    max_model_len = 512

    def __init__(self, media: MediaLoader, llava) -> None:
        self.limits = RequestLimits()
        self.media = media
        self.input_processor = SimpleNamespace(vocab_size=4097,
                                               multimodal=MultiModalProcessor.from_model_folder(str(llava)))
        self.tokenizer = SimpleNamespace(decode=lambda ids: "")

    async def chat_prompt(self, messages, chat_template, add_generation_prompt, tools=None, **extra) -> dict:
        return {"prompt_token_ids": [1, self.input_processor.multimodal.image_token_id, 5]}

    async def run_blocking(self, fn, *args):
        return fn(*args)


def test_in_process_a_slow_url_is_cut_at_the_deadline_and_a_redirect_to_loopback_never_dialled(
        llava_tiny, monkeypatch):
    monkeypatch.delenv("GRIDSERVE_TEST_MEDIA_LOOPBACK", raising=False)
    monkeypatch.delenv("GRIDSERVE_TEST_HOOKS", raising=False)
    real_connect = socket.create_connection
    dialled: list[str] = []

    def steered(address, *args, **kwargs):
        dialled.append(address[0])
        return real_connect(("127.0.0.1", address[1]) if address[0] == PUBLIC else address, *args, **kwargs)

    monkeypatch.setattr(url_fetcher.socket, "create_connection", steered)
    # One loader thread: if the slow URL held it past the deadline, the next image would wait.
    config = MediaConfig(allowed_media_domains=("*",), media_fetch_timeout_s=0.5, thread_count=1)
    loader = MediaLoader(config, resolver=lambda host, port: [PUBLIC] if host == NAME else [])
    assert loader.fetcher.address_allowed is url_fetcher.public_only  # the production policy
    routes = OpenAIRoutes(_Service(loader, llava_tiny), "llava")

    def tokenize(path: str) -> tuple[int, dict, float]:
        body = {"messages": _chat(f"http://{NAME}:{media.port}{path}")["messages"]}
        start = time.monotonic()
        response = asyncio.run(routes.tokenize(json.dumps(body).encode()))
        return response.status, json.loads(b"".join(response.chunks)), time.monotonic() - start

    with MediaServer(NAME, slow_body_s=SLOW_BODY_S) as media:
        try:
            status, answer, took = tokenize("/slow.png")
            assert status == 400 and answer["error"]["param"] == FIELD and GENERIC in answer["error"]["message"]
            assert 0.4 < took < 1.5, f"the slow URL took {took:.2f}s against a 0.5s deadline"
            status, answer, took = tokenize("/cat.png")  # the one loader thread is free again
            assert status == 200 and answer["count"] > 25 and took < 1.5, (status, answer, took)
            for path in ("/to-loopback", "/to-metadata"):
                status, answer, _ = tokenize(path)
                assert status == 400 and answer["error"]["param"] == FIELD and GENERIC in answer["error"]["message"]
        finally:
            loader.close()
        assert media.hits == ["/slow.png", "/cat.png", "/to-loopback", "/to-metadata"], media.hits
    assert set(dialled) == {PUBLIC}, dialled  # 127.0.0.1 and 169.254.169.254 were refused before a connect


# ---- through the edge ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def media():
    with MediaServer("localhost", slow_body_s=SLOW_BODY_S) as server:
        yield server


@pytest.fixture(scope="module")
def served(llava_tiny, tmp_path_factory, media):
    engine_args = ["--kv-cache-memory-bytes", str(16 << 20), "--max-num-seqs", "16"]
    gateway_args = ["--allowed-media-domains", "localhost", "--media-fetch-timeout-s", str(DEADLINE_S)]
    with pytest.MonkeyPatch.context() as patch:  # the gateway (a child process) reads the hooks when it starts
        patch.setenv("GRIDSERVE_TEST_HOOKS", "1")
        patch.setenv("GRIDSERVE_TEST_MEDIA_LOOPBACK", "1")
        stack = deployment(llava_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(),
                           engine_args=engine_args, gateway_args=gateway_args,
                           edge_limits=EdgeLimits(request_headers_timeout_s=HEADERS_TIMEOUT_S))
        launcher = stack.__enter__()
    try:
        yield launcher
    finally:
        stack.__exit__(None, None, None)


def _post(served, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict, float]:
    host, port = served.edge_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    start = time.monotonic()
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}"), time.monotonic() - start
    finally:
        conn.close()


def test_a_slow_url_is_cut_at_the_deadline_and_frees_its_loader_thread(served, media):
    media.hits.clear()
    status, answer, took = _post(served, _chat(media.url("/slow.png")))
    assert status == 400 and answer["error"]["param"] == FIELD and GENERIC in answer["error"]["message"], answer
    assert DEADLINE_S * 0.8 < took < DEADLINE_S + 3, f"{took:.2f}s for a {DEADLINE_S}s deadline"
    # Ten slow URLs at once (the loader has 8 threads), then a normal image: it waits at most for
    # the slow ones' deadlines, never for their trickle (SLOW_BODY_S).
    with ThreadPoolExecutor(10) as pool:
        slow = [pool.submit(_post, served, _chat(media.url("/slow.png"))) for _ in range(10)]
        time.sleep(0.3)
        status, answer, took = _post(served, _chat(media.url("/cat.png")))
        slow_answers = [f.result() for f in slow]
    assert status == 200 and answer["choices"][0]["message"]["content"] is not None, answer
    assert took < SLOW_BODY_S - 2, f"a normal image waited {took:.2f}s behind 10 slow URLs"
    assert all(s == 400 and GENERIC in a["error"]["message"] for s, a, _ in slow_answers), slow_answers
    assert max(t for _, _, t in slow_answers) < SLOW_BODY_S - 2, [round(t, 2) for _, _, t in slow_answers]
    assert media.hits.count("/slow.png") == 11 and "/cat.png" in media.hits


def test_a_redirect_to_127_0_0_1_is_refused_and_never_followed(served, media):
    media.hits.clear()
    messages = set()
    for path in ("/to-loopback", "/to-metadata"):
        status, answer, took = _post(served, _chat(media.url(path)))
        assert status == 400 and answer["error"]["param"] == FIELD, answer
        assert took < 5, took
        messages.add(answer["error"]["message"])
    assert len(messages) == 1 and GENERIC in messages.pop()  # one generic text: nothing about the inside
    assert media.hits == ["/to-loopback", "/to-metadata"], media.hits  # first hops fetched, targets not
    status, answer, _ = _post(served, _chat(media.url("/cat.png")))  # the allowed host itself serves
    assert status == 200, answer


def test_fuzzed_image_requests_on_a_vision_model_never_get_a_5xx_a_hang_or_a_leak(served, media, llava_tiny, capsys):
    media.hits.clear()
    fuzzer = Fuzzer(served.edge_address, str(llava_tiny))
    try:
        fuzz_images(fuzzer, 30, seed=38, media=media, takes_images=True)
    finally:
        fuzzer.close()
    problems = settled(served.edge_address, address(served, "engine"), address(served, "gateway"))
    problems += media_problems(media, fetches_from_it=True)
    with capsys.disabled():
        print(f"\nimage fuzz on a vision model (seed 38):\n{fuzzer.table()}")
    assert not fuzzer.failures, "\n".join(fuzzer.failures[:10])
    assert not problems, problems
    assert any(s == "200" for _, s in fuzzer.counts), fuzzer.counts  # valid images reached the engine
    assert "/slow.png" in media.hits and "/to-loopback" in media.hits


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


def test_a_probe_is_answered_while_slowloris_and_hostile_images_run_together(served, media, capsys):
    host, port = served.edge_address.rsplit(":", 1)
    idle, idle_statuses = probe(host, int(port), "/health", time.monotonic() + 1.5, interval_s=0.02)
    stop = threading.Event()
    hostile: list[tuple[str, int]] = []

    def attack(offset: int) -> None:
        cases = _hostile(media)
        i = offset
        while not stop.is_set():
            kind, body = cases[i % len(cases)]
            try:
                status = _post(served, body)[0]
            except (OSError, http.client.HTTPException) as exc:
                status = type(exc).__name__
            hostile.append((kind, status))
            i += 1

    normal: list[tuple[int, float]] = []
    with SlowClients(host, int(port), SLOW_CLIENTS, byte_interval_s=0.2) as slow:
        attackers = [threading.Thread(target=attack, args=(k,), daemon=True) for k in range(3)]
        for thread in attackers:
            thread.start()
        try:
            opened = slow.wait_open(30)
            latencies, statuses = probe(host, int(port), "/health", time.monotonic() + 3.0, interval_s=0.02)
            status, _, took = _post(served, _chat(data_url(png())))  # a normal client's image request
            normal.append((status, took))
        finally:
            stop.set()
            for thread in attackers:
                thread.join(TIMEOUT_S + 5)
        cuts = list(slow.cuts)
    report = (f"probe /health: idle p99 {_p99(idle):.1f} ms ({len(idle)} probes), under slowloris ({SLOW_CLIENTS} "
              f"connections) + hostile images p99 {_p99(latencies):.1f} ms, max {max(latencies) * 1e3:.1f} ms "
              f"({len(latencies)} probes, ratio {_p99(latencies) / _p99(idle):.2f}x); statuses {dict(statuses)}; "
              f"{len(hostile)} hostile image requests {sorted(set(hostile), key=str)}; "
              f"{len(cuts)} slow connections cut {sorted({how for _, how in cuts})}; "
              f"a normal image request: HTTP {normal[0][0]} in {normal[0][1]:.2f}s")
    with capsys.disabled():
        print(f"\n{report}")
    assert opened, f"{slow.open_now} of {SLOW_CLIENTS} slow connections open; {report}"
    assert set(idle_statuses) == {200} and statuses and set(statuses) == {200}, report
    assert max(latencies) < 10, report  # functional: every probe answered, none waited behind the attack
    assert hostile and {status for _, status in hostile} == {400}, report  # never a 5xx or a dropped answer
    assert {kind for kind, _ in hostile} == {kind for kind, _ in _hostile(media)}, report
    assert normal[0][0] == 200, report
    assert cuts and {how for _, how in cuts} == {"408"}, report  # the edge cut them at its headers timeout
