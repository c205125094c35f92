"""``gridserve bench serve``: the metric arithmetic from known timestamps, the datasets, Poisson
arrivals, and whole runs against a minimal fake OpenAI-compatible server that streams known
tokens at known times (so the measured TTFT / TPOT / ITL / E2E can be checked)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gridserve.benchmarks.datasets import (
    BenchRequest,
    TokenizerVocabulary,
    WordVocabulary,
    file_requests,
    length_range,
    random_requests,
)
from gridserve.benchmarks.metrics import (
    RequestResult,
    format_report,
    format_sweep_table,
    percentile,
    statistics,
    summarize,
)
from gridserve.benchmarks.serve import Endpoint, arrival_offsets, record_event, sse_data
from gridserve.cli import main

# ---- a fake OpenAI-compatible server ----------------------------------------------------------


class FakeOpenAIServer:
    """Streams ``min(tokens, max_tokens)`` content chunks per request on a loopback port: the first
    ``ttft_s`` after the request arrived, then one every ``gap_s`` (an absolute schedule, so delays
    do not add up), then a usage chunk (unless ``usage`` is false) and ``[DONE]``. ``plan(n, body)``
    says what request number ``n`` (from 1, the probe included) gets: ``"ok"``, ``"500"``,
    ``"stall"`` (headers, then nothing), ``"error"`` (an in-band error event) or ``"400"``;
    ``ttft_for(body)``, when given, is the TTFT of that request instead of ``ttft_s``."""

    def __init__(self, tokens: int = 6, ttft_s: float = 0.2, gap_s: float = 0.1, usage: bool = True,
                 plan: Callable[[int, dict], str] = lambda n, body: "ok",
                 ttft_for: Callable[[dict], float] | None = None) -> None:
        self.tokens, self.ttft_s, self.gap_s, self.usage, self.plan = tokens, ttft_s, gap_s, usage, plan
        self.ttft_for = ttft_for
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._handlers: set[asyncio.Task] = set()

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers.add(asyncio.current_task())
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path, _ = head.split("\r\n")[0].split(" ")
            headers = dict(line.lower().split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "GET" and path == "/v1/models":
                self._send_json(writer, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            else:
                await self._generate(writer, path, json.loads(body))
            await writer.drain()
        finally:
            writer.close()
            self._handlers.discard(asyncio.current_task())

    def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + data)

    async def _generate(self, writer: asyncio.StreamWriter, path: str, body: dict) -> None:
        arrived = self._loop.time()
        self.bodies.append(body)
        what = self.plan(len(self.bodies), body)
        if what in ("500", "400"):
            self._send_json(writer, int(what), {"error": {"message": f"fake {what}"}})
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            await writer.drain()
            if what == "stall":
                await asyncio.sleep(3600)
            chat = path.endswith("chat/completions")
            if chat:  # a role-only chunk right away: not a token
                self._event(writer, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            if what == "error":
                self._event(writer, {"error": {"message": "fake failure mid-stream"}})
            n = min(self.tokens, body["max_tokens"])
            ttft = self.ttft_for(body) if self.ttft_for else self.ttft_s
            for i in range(n if what == "ok" else 0):
                await asyncio.sleep(max(0.0, arrived + ttft + i * self.gap_s - self._loop.time()))
                piece = f"t{i} "
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                self._event(writer, {"choices": [choice]})
                await writer.drain()
            if self.usage and what == "ok":
                prompt = body.get("prompt") or body["messages"][0]["content"]
                prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                self._event(writer, {"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                              "completion_tokens": n}})
            self._chunk(writer, b"data: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
        finally:
            self.in_flight -= 1

    def _event(self, writer: asyncio.StreamWriter, obj: dict) -> None:
        self._chunk(writer, b"data: " + json.dumps(obj).encode() + b"\n\n")

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeOpenAIServer]]:
    servers: list[FakeOpenAIServer] = []

    def make(**kwargs) -> FakeOpenAIServer:
        servers.append(FakeOpenAIServer(**kwargs).start())
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def _bench(tmp_path: Path, server: FakeOpenAIServer, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--random-input-len", "8",
               "--random-output-len", "6", "--disable-tqdm", "--output-json", str(out), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else {}


# ---- metric arithmetic from known timestamps --------------------------------------------------


def test_request_metrics_from_known_chunk_times():
    r = RequestResult(prompt_len=10, output_len=4, chunk_times=[0.5, 0.6, 0.8, 1.1], latency=1.1,
                      usage_output_tokens=4)
    assert r.ttft == 0.5
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.success and r.input_tokens == 10


def test_output_tokens_come_from_usage_else_from_counted_chunks():
    times = [0.5, 0.6, 0.8, 1.1]
    with_usage = RequestResult(10, 8, chunk_times=times, latency=1.1, usage_output_tokens=7)
    assert with_usage.output_tokens == 7 and with_usage.tpot == pytest.approx(0.6 / 6)
    counted = RequestResult(10, 8, chunk_times=times, latency=1.1)
    assert counted.output_tokens == 4 and counted.tpot == pytest.approx(0.6 / 3)


def test_tpot_is_undefined_for_a_single_token():
    assert RequestResult(3, 1, chunk_times=[0.2], latency=0.2).tpot is None


def test_percentile_interpolates_linearly_like_numpy():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert (percentile([1, 2, 3, 4], 0), percentile([1, 2, 3, 4], 100)) == (1, 4)
    assert percentile([7.0], 99) == 7.0 and math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    np = pytest.importorskip("numpy")
    values = [random.Random(0).random() for _ in range(37)]
    for q in (1, 25, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_statistics_of_known_values():
    s = statistics([1.0, 2.0, 3.0, 6.0])
    assert s == pytest.approx({"mean": 3.0, "median": 2.5, "std": math.sqrt(3.5), "p99": 5.91})
    assert all(math.isnan(v) for v in statistics([]).values())


def test_summary_counts_failures_apart_and_flattens_itl():
    a = RequestResult(10, 3, chunk_times=[0.1, 0.3, 0.4], latency=0.4, usage_prompt_tokens=12,
                      usage_output_tokens=3)
    b = RequestResult(20, 2, chunk_times=[0.2, 0.6], latency=0.6)
    failed = RequestResult(30, 5, error="HTTP 500: boom")
    s = summarize([a, b, failed], duration_s=2.0)
    assert (s["completed"], s["failed"], s["duration"]) == (2, 1, 2.0)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (32, 5)
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 2.5 and s["total_token_throughput"] == 18.5
    assert s["mean_ttft_ms"] == pytest.approx(150) and s["median_ttft_ms"] == pytest.approx(150)
    assert s["mean_itl_ms"] == pytest.approx((200 + 100 + 400) / 3)  # all gaps of all requests
    assert s["median_itl_ms"] == pytest.approx(200)
    assert s["mean_tpot_ms"] == pytest.approx((150 + 400) / 2)
    assert s["mean_e2el_ms"] == pytest.approx(500) and s["p99_e2el_ms"] == pytest.approx(598)
    assert s["errors"] == {"HTTP 500: boom": 1}
    report = format_report(s)
    assert "Successful requests:" in report and "Failed requests:" in report
    assert "HTTP 500: boom" in report


def test_sweep_table_has_one_row_per_run():
    runs = [{"max_concurrency": c, **summarize([RequestResult(4, 2, chunk_times=[0.1, 0.2], latency=0.2)], 1.0)}
            for c in (1, None)]
    lines = format_sweep_table(runs).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 1 | 1 | 0 |") and "unlimited" in lines[3]


# ---- events, payloads, arrivals, datasets -----------------------------------------------------


def test_sse_lines_and_events_fold_into_a_result():
    assert sse_data("data: {\"a\": 1}") == "{\"a\": 1}" and sse_data(": keep-alive") is None
    r = RequestResult(5, 3)
    record_event(r, {"choices": [{"index": 0, "text": "ab"}]}, 0.25, chat=False)
    record_event(r, {"choices": [{"index": 0, "text": ""}]}, 0.30, chat=False)  # a token, no character yet
    record_event(r, {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]}, 0.40, chat=False)
    record_event(r, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}, 0.45, chat=False)
    assert r.chunk_times == [0.25, 0.30, 0.40] and r.latency == 0.40 and r.output_tokens == 3
    chat = RequestResult(5, 3)
    record_event(chat, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.01, chat=True)
    record_event(chat, {"choices": [{"index": 0, "delta": {"content": "x"}}]}, 0.2, chat=True)
    record_event(chat, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, 0.3, chat=True)
    assert chat.chunk_times == [0.2] and chat.latency == 0.3
    record_event(chat, {"error": {"message": "engine died"}}, 0.4, chat=True)
    assert chat.error == "engine died" and not chat.success
    odd = RequestResult(5, 3)
    record_event(odd, [1, 2], 0.1, chat=False)
    assert odd.error.startswith("unexpected event")


def test_payloads_for_completions_and_chat():
    completions = Endpoint("http://h:1/", "/v1/completions", "m", api_key="k", ignore_eos=True)
    body = completions.payload(BenchRequest([5, 6, 7], 3, 9))
    assert completions.url == "http://h:1/v1/completions"
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 9 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert completions.headers() == {"Authorization": "Bearer k"}
    chat = Endpoint("http://h:1", "/v1/chat/completions", "m", ignore_eos=False)
    body = chat.payload(BenchRequest("hi there", 2, 4))
    assert body["messages"] == [{"role": "user", "content": "hi there"}] and "ignore_eos" not in body
    assert chat.headers() == {}
    with pytest.raises(ValueError):
        chat.payload(BenchRequest([1, 2], 2, 4))


def test_poisson_arrivals_are_seeded_with_the_requested_mean_rate():
    offsets = arrival_offsets(4000, request_rate=20.0, seed=7)
    assert offsets == arrival_offsets(4000, 20.0, seed=7) != arrival_offsets(4000, 20.0, seed=8)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert mean == pytest.approx(1 / 20, rel=0.06)
    assert std / mean == pytest.approx(1.0, rel=0.1)  # exponential gaps: coefficient of variation 1
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_length_range_follows_the_range_ratio():
    assert length_range(160, 0.6) == (64, 256)
    assert length_range(144, 7 / 9) == (32, 256)
    assert length_range(10, 0.0) == (10, 10)
    with pytest.raises(ValueError):
        length_range(10, 1.0)


def test_random_requests_share_a_prefix_and_stay_in_range(llama_tiny):
    vocab = TokenizerVocabulary(llama_tiny)
    reqs = random_requests(50, vocab, input_len=20, output_len=10, range_ratio=0.5, prefix_len=6, seed=1)
    assert reqs == random_requests(50, vocab, 20, 10, 0.5, 6, seed=1)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(16 <= r.prompt_len <= 36 and 5 <= r.output_len <= 15 for r in reqs)
    assert len({tuple(r.prompt[:6]) for r in reqs}) == 1 and len({tuple(r.prompt) for r in reqs}) == 50
    assert all(t >= 6 for r in reqs for t in r.prompt)  # no special tokens
    text = random_requests(3, vocab, 20, 10, as_text=True)
    assert all(isinstance(r.prompt, str) for r in text)
    words = random_requests(3, WordVocabulary(), 12, 4)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == r.prompt_len == 12 for r in words)


def test_file_requests_take_strings_and_objects(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["one two three", {"prompt": [7, 8, 9, 10], "output_len": 5}, {"prompt": "x"}]))
    reqs = file_requests(path, WordVocabulary(), default_output_len=16)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("one two three", 3, 16), ([7, 8, 9, 10], 4, 5), ("x", 1, 16)]
    assert len(file_requests(path, WordVocabulary(), 16, num_prompts=2)) == 2
    path.write_text(json.dumps([{"prompt": "ok", "output_len": 0}]))
    with pytest.raises(ValueError, match="item 0"):
        file_requests(path, WordVocabulary(), 16)


# ---- whole runs against the fake server -------------------------------------------------------

TTFT_S, GAP_S, TOKENS = 0.2, 0.1, 6
SLACK_S = 0.25  # scheduling tolerance on a loaded 2-core machine


def test_bench_serve_measures_known_token_times(tmp_path, fake_server):
    server = fake_server(tokens=TOKENS, ttft_s=TTFT_S, gap_s=GAP_S)
    rc, report = _bench(tmp_path, server)
    assert rc == 0
    (run,) = report["runs"]
    assert (run["completed"], run["failed"]) == (4, 0)
    assert run["total_output_tokens"] == 4 * TOKENS
    assert run["total_input_tokens"] == 4 * 8  # the fake's usage: one token per word
    assert TTFT_S * 1000 <= run["median_ttft_ms"] <= run["p99_ttft_ms"] < (TTFT_S + SLACK_S) * 1000
    assert GAP_S * 1000 * 0.8 <= run["mean_tpot_ms"] < (GAP_S + SLACK_S / (TOKENS - 1)) * 1000
    assert GAP_S * 1000 * 0.8 <= run["median_itl_ms"] < (GAP_S + 0.05) * 1000
    e2e = TTFT_S + (TOKENS - 1) * GAP_S
    assert e2e * 1000 <= run["median_e2el_ms"] < (e2e + SLACK_S) * 1000
    assert e2e <= run["duration"] < e2e + 2 * SLACK_S  # all four at once
    assert run["output_throughput"] == pytest.approx(4 * TOKENS / run["duration"])
    assert server.max_in_flight == 4
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in server.bodies)
    assert report["model"] == "fake-model" and report["workload"]["token_id_prompts"] is False


def test_chat_role_chunk_is_not_the_first_token(tmp_path, fake_server):
    server = fake_server(tokens=TOKENS, ttft_s=TTFT_S, gap_s=GAP_S)
    rc, report = _bench(tmp_path, server, "--endpoint", "/v1/chat/completions", "--num-prompts", "2")
    (run,) = report["runs"]
    assert rc == 0 and run["completed"] == 2
    assert run["median_ttft_ms"] >= TTFT_S * 1000 and run["total_output_tokens"] == 2 * TOKENS
    assert all("messages" in b for b in server.bodies)


def test_without_usage_output_tokens_are_counted_chunks(tmp_path, fake_server):
    server = fake_server(tokens=3, ttft_s=0.05, gap_s=0.05, usage=False)
    rc, report = _bench(tmp_path, server, "--num-prompts", "2")
    (run,) = report["runs"]
    assert rc == 0 and run["total_output_tokens"] == 2 * 3
    assert run["total_input_tokens"] == 2 * 8  # the dataset's lengths (words)


def test_max_concurrency_bounds_requests_in_flight(tmp_path, fake_server):
    server = fake_server(tokens=2, ttft_s=0.15, gap_s=0.05)
    rc, report = _bench(tmp_path, server, "--num-prompts", "6", "--max-concurrency", "2")
    (run,) = report["runs"]
    assert rc == 0 and run["completed"] == 6 and server.max_in_flight == 2
    assert run["duration"] >= 3 * 0.2  # three waves of two


def test_poisson_requests_are_sent_on_schedule(tmp_path, fake_server):
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02)
    rc, report = _bench(tmp_path, server, "--num-prompts", "6", "--request-rate", "10", "--seed", "3",
                        "--save-detailed")
    (run,) = report["runs"]
    assert rc == 0 and run["completed"] == 6
    for sent, planned in zip(run["sent_at"], arrival_offsets(6, 10.0, seed=3)):
        assert planned <= sent + 1e-3 and sent < planned + 0.1


def test_failed_requests_are_counted(tmp_path, fake_server):
    # request 1 is the probe; of the six timed ones (#2..#7), #3 and #6 get HTTP 500
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02, plan=lambda n, body: "500" if n % 3 == 0 else "ok")
    rc, report = _bench(tmp_path, server, "--num-prompts", "6")
    (run,) = report["runs"]
    assert rc == 0 and (run["completed"], run["failed"]) == (4, 2)
    assert run["total_output_tokens"] == 4 * 2
    assert list(run["errors"]) == ["HTTP 500: {\"error\": {\"message\": \"fake 500\"}}"]


def test_in_band_errors_and_timeouts_fail_requests(tmp_path, fake_server):
    plans = {2: "error", 3: "stall"}
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02, plan=lambda n, body: plans.get(n, "ok"))
    rc, report = _bench(tmp_path, server, "--num-prompts", "3", "--timeout", "1")
    (run,) = report["runs"]
    assert rc == 0 and (run["completed"], run["failed"]) == (1, 2)
    assert set(run["errors"]) == {"fake failure mid-stream", "timeout: no end of stream within 1s"}


def test_the_run_stops_at_max_duration(tmp_path, fake_server):
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02, plan=lambda n, body: "ok" if n == 1 else "stall")
    t0 = time.perf_counter()
    rc, report = _bench(tmp_path, server, "--num-prompts", "2", "--max-duration", "0.5")
    (run,) = report["runs"]
    assert rc == 1 and run["failed"] == 2 and time.perf_counter() - t0 < 5
    assert list(run["errors"]) == ["not finished within --max-duration 0.5s"]


def test_an_unusable_endpoint_is_a_clear_error(tmp_path, fake_server, capsys):
    server = fake_server(plan=lambda n, body: "500")
    rc, report = _bench(tmp_path, server)
    assert rc == 2 and report == {}
    assert "probe request" in capsys.readouterr().err


def test_token_id_prompts_have_exact_lengths(tmp_path, fake_server, llama_tiny):
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02)
    rc, report = _bench(tmp_path, server, "--tokenizer", str(llama_tiny), "--random-prefix-len", "4")
    assert rc == 0 and report["workload"]["token_id_prompts"] is True
    assert [len(b["prompt"]) for b in server.bodies[1:]] == [12] * 4
    assert report["runs"][0]["total_input_tokens"] == 4 * 12


def test_refused_token_ids_fall_back_to_text(tmp_path, fake_server, llama_tiny):
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02,
                         plan=lambda n, body: "400" if isinstance(body.get("prompt"), list) else "ok")
    rc, report = _bench(tmp_path, server, "--tokenizer", str(llama_tiny))
    assert rc == 0 and report["runs"][0]["completed"] == 4
    assert report["workload"]["token_id_prompts"] is False
    assert all(isinstance(b["prompt"], str) for b in server.bodies[1:])


@pytest.mark.slow  # a whole run (make test; not make test-fast)
def test_concurrency_sweep_writes_runs_and_a_plot(tmp_path, fake_server):
    pytest.importorskip("matplotlib")
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02)
    png = tmp_path / "serve.png"
    rc, report = _bench(tmp_path, server, "--sweep-concurrency", "1,2,4", "--prompts-per-concurrency", "2",
                        "--plot", str(png), "--label", "fake")
    assert rc == 0 and [r["max_concurrency"] for r in report["runs"]] == [1, 2, 4]
    assert [r["completed"] for r in report["runs"]] == [2, 4, 4]  # at most 2 x concurrency of the 4
    prompts = [b["prompt"] for b in server.bodies]  # the probe's and each point's are drawn apart
    assert len(prompts) == 1 + 2 + 4 + 4 and len(set(prompts)) == len(prompts)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"
    assert main(["bench", "plot", str(tmp_path / "serve.json"), "-o", str(again)]) == 0
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_reads_sweeps_and_flat_vllm_results(tmp_path):
    from gridserve.benchmarks.plot import load_reports, series

    sweep = tmp_path / "ours.json"
    sweep.write_text(json.dumps({"label": "gridserve", "runs": [
        {"max_concurrency": 8, "output_throughput": 80.0}, {"max_concurrency": 1, "output_throughput": 20.0},
        {"max_concurrency": None, "num_prompts": 32, "output_throughput": 90.0}]}))
    flat = tmp_path / "vllm.json"
    flat.write_text(json.dumps({"max_concurrency": 4, "output_throughput": 50.0, "median_ttft_ms": float("nan")}))
    ours, theirs = load_reports([str(sweep), str(flat)])
    assert series(ours, "output_throughput") == ([1, 8, 32], [20.0, 80.0, 90.0])
    assert theirs["label"] == "vllm" and series(theirs, "output_throughput") == ([4], [50.0])
    assert series(theirs, "median_ttft_ms") == ([], [])
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a results file"):
        load_reports([str(tmp_path / "bad.json")])


# ---- the latency probe ------------------------------------------------------------------------

PROBE_TOKENS = 2  # --probe-output-len: how the fake tells a probe from a load request


def _is_probe(body: dict) -> bool:
    return body["max_tokens"] == PROBE_TOKENS


@pytest.mark.slow  # a whole run (make test; not make test-fast)
def test_latency_probe_sends_one_request_per_period_and_reports_its_ttft_apart(tmp_path, fake_server):
    # The load: 4 requests of 6 tokens, 0.2 s apart after a 0.2 s TTFT (about 1.2 s in all); the
    # probe: 5 per second, each answered after 0.05 s.
    server = fake_server(tokens=6, ttft_s=0.2, gap_s=0.2, ttft_for=lambda b: 0.05 if _is_probe(b) else 0.2)
    rc, report = _bench(tmp_path, server, "--probe-rate", "5", "--probe-input-len", "5",
                        "--probe-output-len", str(PROBE_TOKENS), "--save-detailed")
    (run,) = report["runs"]
    assert rc == 0 and (run["completed"], run["failed"]) == (4, 0)
    assert run["total_output_tokens"] == 4 * 6  # the probes' tokens are not the load's
    assert run["median_ttft_ms"] >= 200
    probes = [b for b in server.bodies if _is_probe(b)]
    expected = math.ceil(run["duration"] * 5)  # one at 0, 0.2, ... until the load ended
    assert len(probes) == run["probe_sent"] and expected - 1 <= run["probe_sent"] <= expected + 1
    assert run["probe_completed"] == run["probe_sent"] and run["probe_failed"] == 0
    assert 50 <= run["median_probe_ttft_ms"] <= run["p99_probe_ttft_ms"] < (0.05 + SLACK_S) * 1000
    assert all(len(b["prompt"].split()) == 5 for b in probes)
    assert len({b["prompt"] for b in probes}) == len(probes)  # a fresh prompt each: no cache hits
    for i, sent in enumerate(run["probe_sent_at"]):  # on schedule, whatever the others are doing
        assert i / 5 - 1e-3 <= sent < i / 5 + 0.1
    assert len(run["probe_ttfts"]) == run["probe_completed"]


def test_failed_probes_are_counted_without_failing_the_run(tmp_path, fake_server):
    server = fake_server(tokens=3, ttft_s=0.1, gap_s=0.1,
                         plan=lambda n, body: "500" if _is_probe(body) else "ok")
    rc, report = _bench(tmp_path, server, "--probe-rate", "10", "--probe-output-len", str(PROBE_TOKENS))
    (run,) = report["runs"]
    assert rc == 0 and run["completed"] == 4
    assert run["probe_sent"] >= 2 and run["probe_failed"] == run["probe_sent"] and run["probe_completed"] == 0
    assert math.isnan(run["median_probe_ttft_ms"])
    assert list(run["probe_errors"]) == ["HTTP 500: {\"error\": {\"message\": \"fake 500\"}}"]


def test_no_probe_unless_asked(tmp_path, fake_server):
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02)
    rc, report = _bench(tmp_path, server)
    assert rc == 0 and "probe_sent" not in report["runs"][0]
    assert len(server.bodies) == 1 + 4


@pytest.mark.parametrize("flags", [("--probe-rate", "-1"), ("--probe-rate", "inf"),
                                   ("--probe-rate", "1", "--probe-output-len", "0")])
def test_bad_probe_settings_are_clear_errors(tmp_path, fake_server, capsys, flags):
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02)
    rc, report = _bench(tmp_path, server, *flags)
    assert rc == 2 and report == {}
    assert flags[-2] in capsys.readouterr().err


def test_probes_still_stalled_after_the_load_fail_after_the_drain(fake_server):
    from gridserve.benchmarks.serve import LatencyProbe, LoadSpec, run_load

    server = fake_server(tokens=2, ttft_s=0.1, gap_s=0.1, plan=lambda n, body: "stall" if _is_probe(body) else "ok")
    probe = LatencyProbe(10.0, lambda i: BenchRequest(f"probe {i}", 2, PROBE_TOKENS), drain_s=0.3)
    load = LoadSpec(timeout_s=30, progress=False, probe=probe)
    requests = [BenchRequest("a b c", 3, 3)] * 2
    t0 = time.perf_counter()
    results, duration, probes = asyncio.run(run_load(Endpoint(server.url, model="m"), requests, load))
    assert all(r.success for r in results) and 0.2 <= duration < 0.2 + SLACK_S  # two tokens, 0.1 s apart
    assert len(probes) >= 2 and time.perf_counter() - t0 < duration + 0.3 + SLACK_S
    assert {r.error for r in probes} == {"not finished within 0.3s after the load ended"}
    assert [r.sent_at for r in probes] == sorted(r.sent_at for r in probes)


def test_probe_priorities_run_the_load_once_each_and_only_the_probes_carry_theirs(tmp_path, fake_server, capsys):
    server = fake_server(tokens=3, ttft_s=0.05, gap_s=0.05, ttft_for=lambda b: 0.01 if _is_probe(b) else 0.05)
    rc, report = _bench(tmp_path, server, "--probe-rate", "10", "--probe-max-tokens", str(PROBE_TOKENS),
                        "--probe-priority", "0,-1")
    assert rc == 0 and [r["probe_priority"] for r in report["runs"]] == [0, -1]
    assert all(r["probe_completed"] == r["probe_sent"] > 0 for r in report["runs"])
    probes = [b for b in server.bodies if _is_probe(b)]
    assert {b.get("priority") for b in probes} == {None, -1}  # 0 is not sent
    assert all("priority" not in b for b in server.bodies if not _is_probe(b))
    loads = [b["prompt"] for b in server.bodies if not _is_probe(b)][1:]  # after the check request
    assert not set(loads[:4]) & set(loads[4:])  # each run its own prompts: no prefix-cache help
    assert "| probe priority |" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["x", "", "2147483648"])
def test_a_bad_probe_priority_is_a_clear_error(tmp_path, fake_server, capsys, value):
    server = fake_server(tokens=2, ttft_s=0.02, gap_s=0.02)
    rc, report = _bench(tmp_path, server, "--probe-rate", "1", "--probe-priority", value)
    assert rc == 2 and report == {} and "--probe-priority" in capsys.readouterr().err
