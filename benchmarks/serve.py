"""``gridserve bench serve``: an online load generator against any OpenAI-compatible server.

Requests (:mod:`gridserve.benchmarks.datasets`) go out as streaming ``/v1/completions`` or
``/v1/chat/completions`` calls with ``stream_options.include_usage``, at Poisson arrival times
(``--request-rate``; ``inf`` sends them all at once), at most ``--max-concurrency`` in flight. The
client notes when each content chunk arrives; :mod:`gridserve.benchmarks.metrics` turns those times
into TTFT, TPOT, ITL and end-to-end latency and the run's throughputs, as vLLM's serving benchmark
defines them. ``--sweep-concurrency 1,4,16`` repeats the same request set at each concurrency;
``--plot`` (or ``gridserve bench plot``) draws throughput and latency against concurrency.

``--probe-rate 1`` adds a latency probe (:mod:`gridserve.benchmarks.probe`): while the load runs,
one short request per second (its own client task and connections, a fresh random prompt each)
measures the TTFT an interactive user sharing the server with the batch traffic sees; reported as
``{median,p99,...}_probe_ttft_ms``. ``--probe-priority -1`` sends it ahead of the load on a server
that schedules by priority; ``0,-1`` measures both, one run each.

Every request has a deadline (``--timeout``) and so has the whole run (``--max-duration``): what
has not finished by then is cancelled and counted as failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import logging
import math
import os
import platform
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from gridserve.benchmarks.datasets import (
    BenchRequest,
    TokenizerVocabulary,
    Vocabulary,
    WordVocabulary,
    add_dataset_arguments,
    file_requests,
    find_tokenizer,
    prefix_repetition_from_args,
    random_requests,
)
from gridserve.benchmarks.metrics import (
    RequestResult,
    format_report,
    format_sweep_table,
    summarize,
    summarize_probes,
)
from gridserve.benchmarks.probe import (
    LatencyProbe,
    add_probe_arguments,
    format_probe_table,
    latency_probe,
    probe_priorities,
    run_probes,
)
from gridserve.shared.errors import GridserveError

logger = logging.getLogger(__name__)


class EndpointError(GridserveError, RuntimeError):
    """The server under test cannot be used: unreachable, no model, or the probe request failed."""


# --------------------------------------------------------------------------------------------
# One request


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible streaming route and the sampling settings every request uses."""

    base_url: str
    path: str = "/v1/completions"
    model: str = ""
    api_key: Optional[str] = None
    ignore_eos: bool = True
    temperature: float = 0.0
    ca_file: Optional[str] = None  # HTTPS: the CA that signed the server's certificate
    priority: int = 0  # vLLM's request priority (lower first); 0: the field is not sent

    def verify(self) -> Any:
        """httpx's ``verify``: the CA file's context for HTTPS, else the default."""
        return _verify(self.ca_file)

    @property
    def chat(self) -> bool:
        return self.path.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.path.lstrip("/")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        """The JSON body of ``request``: greedy unless ``temperature`` says otherwise, streamed,
        with usage in the last chunk; ``ignore_eos`` only when on (vLLM's extension)."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.output_len, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.chat:
            if not isinstance(request.prompt, str):
                raise ValueError("the chat endpoint takes text prompts, not token ids")
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.priority:
            body["priority"] = self.priority
        return body


def sse_data(line: str) -> Optional[str]:
    """The payload of an SSE ``data:`` line; ``None`` for any other line (comments, blanks)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def record_event(result: RequestResult, event: Any, t: float, chat: bool) -> None:
    """Fold one streamed JSON event, arrived ``t`` seconds after the request was sent, into
    ``result``: a content chunk's time, the end of generation, usage, or an in-band error.

    A completions chunk with a choice is a content chunk even when its text is empty (a token whose
    bytes do not yet make a character, a special token); a chat chunk is one when its delta has text."""
    if not isinstance(event, dict):
        result.error = f"unexpected event in the stream: {str(event)[:100]}"
        return
    if "error" in event:
        error = event["error"]
        result.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return
    choices = event.get("choices") or []
    if choices:
        result.latency = t
        if not chat or _has_content(choices[0]):
            result.chunk_times.append(t)
    usage = event.get("usage")
    if usage:
        result.usage_prompt_tokens = usage.get("prompt_tokens")
        result.usage_output_tokens = usage.get("completion_tokens")


def _has_content(choice: dict[str, Any]) -> bool:
    """A chat chunk carries a token when its delta has text: the role-only chunk a chat stream may
    open with does not."""
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def send_request(client: Any, endpoint: Endpoint, request: BenchRequest, timeout_s: float) -> RequestResult:
    """Stream one request; every failure (HTTP status, transport, timeout, bad JSON, in-band error,
    no content) is recorded in ``RequestResult.error``, never raised."""
    import httpx2

    result = RequestResult(prompt_len=request.prompt_len, output_len=request.output_len)
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, endpoint, request, result, start), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timeout: no end of stream within {timeout_s:g}s"
    except httpx2.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except json.JSONDecodeError as exc:
        result.error = f"bad JSON in the stream: {exc}"
    if not result.error and not result.chunk_times:
        result.error = "the stream carried no content"
    return result


async def _stream(client: Any, endpoint: Endpoint, request: BenchRequest, result: RequestResult,
                  start: float) -> None:
    async with client.stream("POST", endpoint.url, json=endpoint.payload(request),
                             headers=endpoint.headers()) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {' '.join(body.split())[:200]}"
            return
        done = False
        async for line in response.aiter_lines():
            t = time.perf_counter() - start
            data = sse_data(line)
            if data is None or done:
                continue
            if data == "[DONE]":
                done = True  # read on to the end of the body so the connection can be reused
                continue
            record_event(result, json.loads(data), t, endpoint.chat)
            if result.error:
                return


# --------------------------------------------------------------------------------------------
# A run


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of ``request_rate`` per second:
    the first at 0, then exponential gaps of mean ``1 / request_rate``; all 0 when it is ``inf``."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


@dataclass(frozen=True)
class LoadSpec:
    """How requests are sent: arrival rate, in-flight limit and deadlines; optionally a latency probe."""

    request_rate: float = math.inf
    max_concurrency: Optional[int] = None  # None: no limit
    timeout_s: float = 600.0  # per request
    max_duration_s: float = 3600.0  # the whole run
    seed: int = 0
    progress: bool = True
    probe: Optional[LatencyProbe] = None


async def _probe_load(endpoint: Endpoint, load: LoadSpec, load_done: asyncio.Event) -> list[RequestResult]:
    """The latency probe's requests, on a client of their own, with the probe's priority."""
    import httpx2

    target = replace(endpoint, priority=load.probe.priority)
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(load.timeout_s), trust_env=False,
                                  verify=endpoint.verify()) as client:
        return await run_probes(load.probe, lambda r: send_request(client, target, r, load.timeout_s), load_done)


async def run_load(endpoint: Endpoint, requests: list[BenchRequest],
                   load: LoadSpec) -> tuple[list[RequestResult], float, list[RequestResult]]:
    """Send ``requests`` as ``load`` says; returns one result per request (in order), the run's
    wall seconds and the latency probe's results (empty without one). Requests unfinished at
    ``max_duration_s`` are cancelled and count as failed."""
    import httpx2
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), load.request_rate, load.seed)
    limit = load.max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    results: list[Optional[RequestResult]] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc="bench serve", unit="req", disable=not load.progress)
    timeout = httpx2.Timeout(load.timeout_s)
    limits = httpx2.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx2.AsyncClient(timeout=timeout, limits=limits, trust_env=False,
                                  verify=endpoint.verify()) as client:
        start = time.perf_counter()
        load_done = asyncio.Event()
        probes = asyncio.create_task(_probe_load(endpoint, load, load_done)) if load.probe else None

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with gate:
                sent_at = time.perf_counter() - start
                result = await send_request(client, endpoint, requests[i], load.timeout_s)
            results[i] = replace(result, sent_at=sent_at)
            bar.update(1)

        tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
        done, pending = await asyncio.wait(tasks, timeout=load.max_duration_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
        load_done.set()
        probe_results = await probes if probes else []
        for task in done:
            task.result()  # a bug in the client must not pass as a failed request
    bar.close()
    unfinished = f"not finished within --max-duration {load.max_duration_s:g}s"
    return [r if r is not None else RequestResult(q.prompt_len, q.output_len, error=unfinished)
            for r, q in zip(results, requests)], duration, probe_results


def probe(endpoint: Endpoint, request: BenchRequest, timeout_s: float) -> RequestResult:
    """One short request (at most 4 output tokens), before the timed runs."""
    import httpx2

    async def go() -> RequestResult:
        async with httpx2.AsyncClient(timeout=httpx2.Timeout(timeout_s), trust_env=False,
                                      verify=endpoint.verify()) as client:
            short = replace(request, output_len=min(request.output_len, 4))
            return await send_request(client, endpoint, short, timeout_s)

    return asyncio.run(go())


def _verify(ca_file: Optional[str]) -> Any:
    if not ca_file:
        return True
    import ssl

    return ssl.create_default_context(cafile=ca_file)


def model_card(base_url: str, api_key: Optional[str], timeout_s: float = 30.0,
               ca_file: Optional[str] = None) -> dict[str, Any]:
    """The first model of ``GET /v1/models``."""
    import httpx2

    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx2.get(url, headers=headers, timeout=timeout_s, trust_env=False, verify=_verify(ca_file))
        response.raise_for_status()
        return response.json()["data"][0]
    except (httpx2.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EndpointError(f"GET {url}: no model listed ({type(exc).__name__}: {exc})") from None


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``gridserve bench serve``."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    server.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions")
    server.add_argument("--ca-file", default=None,
                        help="HTTPS: the CA that signed the server's certificate (e.g. gridserve serve --tls's)")
    server.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY, if set)")
    server.add_argument("--tokenizer", default=None,
                        help="local folder or tokenizer.json for random prompts (default: the model "
                             "card's root or --model, if a local folder; else common words)")
    server.add_argument("--text-prompts", action="store_true",
                        help="send prompts as text even when token ids could be sent")
    data = parser.add_argument_group("requests")
    add_dataset_arguments(data)
    data.add_argument("--dataset-path", default=None,
                      help="JSON list of prompt strings or {\"prompt\": ..., \"output_len\"?: ...}")
    data.add_argument("--num-prompts", type=int, default=32)
    data.add_argument("--random-input-len", type=int, default=128)
    data.add_argument("--random-output-len", type=int, default=64,
                      help="also the output length of file prompts without one")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [L*(1-r), L*(1+r)]")
    data.add_argument("--random-output-range-ratio", type=float, default=None,
                      help="the range ratio of output lengths (default: --random-range-ratio)")
    data.add_argument("--random-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                      help="generate exactly the wanted output lengths (default: on for random)")
    data.add_argument("--temperature", type=float, default=0.0)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second, Poisson arrivals (default inf: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--sweep-concurrency", default=None, metavar="N,N,...",
                      help="run once per max concurrency, e.g. 1,4,16,64")
    load.add_argument("--prompts-per-concurrency", type=int, default=None, metavar="K",
                      help="in a sweep, send only the first K x concurrency prompts at each point "
                           "(keeps low-concurrency points short; default: all of them)")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    load.add_argument("--max-duration", type=float, default=3600.0, help="seconds per run, at most")
    add_probe_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--output-json", default=None, help="write the results here")
    out.add_argument("--save-detailed", action="store_true", help="per-request times in the JSON too")
    out.add_argument("--plot", default=None, metavar="PNG", help="plot throughput and latency vs concurrency")
    out.add_argument("--label", default=None, help="this server's name in tables and plots")
    out.add_argument("--engine-metrics-url", default=None, metavar="URL",
                     help="an engine's Prometheus /metrics (the process table's metrics column): its "
                          "speculative-decoding counters over each run are reported (drafts, acceptance)")
    out.add_argument("--disable-tqdm", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Run ``gridserve bench serve``: print a report per run (and a sweep table), write the JSON."""
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not one log line per request
    concurrencies = _concurrencies(args)
    card = _card_or_none(args)
    model = args.model or (card or {}).get("id")
    if not model:
        raise EndpointError(f"no --model given and {args.base_url}/v1/models lists none")
    endpoint = Endpoint(args.base_url, args.endpoint, model, args.api_key,
                        _ignore_eos(args), args.temperature, args.ca_file)
    vocabulary = _vocabulary(args, card)
    priorities = probe_priorities(args.probe_priority) if args.probe_rate else [0]  # one run per value
    points = [(c, p) for c in concurrencies for p in priorities]
    as_text = _probe(args, endpoint, vocabulary, args.text_prompts or endpoint.chat, len(points))
    workload = _requests(args, vocabulary, as_text, args.seed)
    runs = []
    for i, (concurrency, priority) in enumerate(points):
        # Random prompts are drawn afresh for each run (seed + i), so that a prefix cache cannot
        # serve one run the prompts of the one before; lengths follow the same ranges.
        requests = workload if i == 0 else _requests(args, vocabulary, as_text, args.seed + i)
        load = LoadSpec(args.request_rate, concurrency, args.timeout, args.max_duration, args.seed,
                        progress=not args.disable_tqdm,
                        probe=latency_probe(args.probe_rate, vocabulary, args.probe_input_len,
                                            args.probe_output_len, args.seed + i, as_text, priority))
        before = spec_decode_counters(args.engine_metrics_url) if args.engine_metrics_url else None
        runs.append(measure_run(endpoint, _head(requests, args.prompts_per_concurrency, concurrency), load,
                                args.save_detailed))
        if before is not None:
            runs[-1]["spec_decode"] = spec_decode_delta(before, spec_decode_counters(args.engine_metrics_url))
        title = f"max concurrency {concurrency or 'unlimited'}"
        print(format_report(runs[-1], title + (f", probe priority {priority}" if load.probe and priority else "")))
    label = args.label or f"{model} @ {args.base_url}"
    if len(runs) > 1:
        print(format_sweep_table(runs))
    if any("probe_sent" in r for r in runs):
        print(format_probe_table(runs))
    report = _report(args, endpoint, label, workload, runs)
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        logger.info("wrote %s", path)
    if args.plot:
        from gridserve.benchmarks.plot import plot_reports

        plot_reports([report], args.plot)
        logger.info("wrote %s", args.plot)
    return 0 if all(r["completed"] for r in runs) else 1


_SPEC_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts",
                  "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens"}


def spec_decode_counters(url: str) -> dict[str, Any]:
    """The speculative-decoding counters of the engine whose Prometheus ``/metrics`` is ``url``."""
    import httpx2

    return parse_spec_decode_counters(httpx2.get(url, timeout=10.0).text)


def parse_spec_decode_counters(text: str) -> dict[str, Any]:
    """Speculative-decoding counters from Prometheus text (zeros when there are none: speculation
    off), summed over the engines it may hold."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "per_position": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _SPEC_COUNTERS:
                counters[_SPEC_COUNTERS[sample.name]] += sample.value
            elif sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                position = int(sample.labels["position"])
                counters["per_position"][position] = counters["per_position"].get(position, 0.0) + sample.value
    return counters


def spec_decode_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One run's drafts, draft tokens, accepted tokens, acceptance rate and accepted per position."""
    delta = {k: int(after[k] - before[k]) for k in ("drafts", "draft_tokens", "accepted_tokens")}
    delta["acceptance_rate"] = round(delta["accepted_tokens"] / delta["draft_tokens"], 3) if delta["draft_tokens"] else None
    delta["accepted_per_position"] = [
        round((after["per_position"][i] - before["per_position"].get(i, 0.0)) / delta["drafts"], 3)
        if delta["drafts"] else 0.0 for i in sorted(after["per_position"])]
    return delta


def _concurrencies(args: argparse.Namespace) -> list[Optional[int]]:
    if not args.sweep_concurrency:
        return [args.max_concurrency]
    try:
        values = [int(v) for v in args.sweep_concurrency.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep-concurrency: expected integers like 1,4,16, got {args.sweep_concurrency!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--sweep-concurrency: expected integers >= 1, got {args.sweep_concurrency!r}")
    return values


def _head(requests: list[BenchRequest], per_concurrency: Optional[int],
          concurrency: Optional[int]) -> list[BenchRequest]:
    if per_concurrency is None or concurrency is None:
        return requests
    if per_concurrency < 1:
        raise ValueError(f"--prompts-per-concurrency must be >= 1, got {per_concurrency}")
    return requests[:per_concurrency * concurrency]


def _card_or_none(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    try:
        return model_card(args.base_url, args.api_key, ca_file=args.ca_file)
    except EndpointError:
        if args.model is None:
            raise
        logger.info("no model card from %s; using --model %s", args.base_url, args.model)
        return None


def _ignore_eos(args: argparse.Namespace) -> bool:
    return args.ignore_eos if args.ignore_eos is not None else _dataset(args) in ("random", "prefix-repetition")


def _dataset(args: argparse.Namespace) -> str:
    return "file" if args.dataset_path else args.dataset


def _vocabulary(args: argparse.Namespace, card: Optional[dict[str, Any]]) -> Vocabulary:
    path = find_tokenizer(args.tokenizer, (card or {}).get("root"), args.model)
    if args.tokenizer and path is None:
        raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    if path is None:
        logger.info("no local tokenizer: random prompts are common words (about one token each)")
        return WordVocabulary()
    logger.info("tokenizer: %s", path)
    return TokenizerVocabulary(path)


def _requests(args: argparse.Namespace, vocabulary: Vocabulary, as_text: bool, seed: int) -> list[BenchRequest]:
    if _dataset(args) == "file":
        if not args.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        return file_requests(args.dataset_path, vocabulary, args.random_output_len, args.num_prompts, as_text)
    if _dataset(args) == "prefix-repetition":
        return prefix_repetition_from_args(args, vocabulary, seed, as_text)
    return random_requests(args.num_prompts, vocabulary, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, args.random_prefix_len, seed,
                           args.random_output_range_ratio, as_text)


def _probe(args: argparse.Namespace, endpoint: Endpoint, vocabulary: Vocabulary, as_text: bool,
           seed_offset: int) -> bool:
    """Check the endpoint with one request (a random prompt no timed run sends); returns whether
    prompts go as text: a server that refuses token-id prompts gets them as text."""
    first = _requests(args, vocabulary, as_text, args.seed + seed_offset)[0]
    result = probe(endpoint, first, args.timeout)
    if result.success:
        return as_text
    if not isinstance(first.prompt, str) and result.error.startswith(("HTTP 400", "HTTP 422")):
        logger.warning("token-id prompts refused (%s); sending them as text", result.error)
        result = probe(endpoint, _requests(args, vocabulary, True, args.seed + seed_offset)[0], args.timeout)
        if result.success:
            return True
    raise EndpointError(f"the probe request to {endpoint.url} failed: {result.error}")


def measure_run(endpoint: Endpoint, requests: list[BenchRequest], load: LoadSpec,
                detailed: bool = False) -> dict[str, Any]:
    """One timed run of ``requests`` under ``load``: its summary (``metrics.summarize``, plus the
    probe's figures when ``load`` has one) with the run's settings and the load average."""
    started_at, load_before = _now(), _load_avg()
    results, duration, probe_results = asyncio.run(run_load(endpoint, requests, load))
    record = {"max_concurrency": load.max_concurrency, "request_rate": load.request_rate,
              "num_prompts": len(requests), "started_at": started_at, "finished_at": _now(),
              "load_avg": (load_before, _load_avg()), **summarize(results, duration)}
    if load.probe:
        record |= summarize_probes(probe_results, load.probe.rate) | {"probe_priority": load.probe.priority}
        if detailed:
            record |= {"probe_sent_at": [r.sent_at for r in probe_results],
                       "probe_ttfts": [r.ttft for r in probe_results if r.success]}
    if detailed:
        ok = [r for r in results if r.success]
        record |= {"input_lens": [r.input_tokens for r in ok], "output_lens": [r.output_tokens for r in ok],
                   "ttfts": [r.ttft for r in ok], "itls": [r.itl for r in ok], "e2els": [r.latency for r in ok],
                   "sent_at": [r.sent_at for r in results], "errors_per_request": [r.error for r in results]}
    return record


def _report(args: argparse.Namespace, endpoint: Endpoint, label: str, requests: list[BenchRequest],
            runs: list[dict[str, Any]]) -> dict[str, Any]:
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    return {
        "benchmark": "serve",
        "label": label,
        "base_url": endpoint.base_url,
        "endpoint": endpoint.path,
        "model": endpoint.model,
        "config": {k: v for k, v in vars(args).items() if not callable(v) and k != "api_key"},
        "workload": {
            "num_prompts": len(requests),
            "token_id_prompts": not isinstance(requests[0].prompt, str),
            "ignore_eos": endpoint.ignore_eos,
            "prompt_len_min": min(prompt_lens), "prompt_len_max": max(prompt_lens),
            "output_len_min": min(output_lens), "output_len_max": max(output_lens),
            "total_prompt_len": sum(prompt_lens), "total_output_len": sum(output_lens),
        },
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version()},
        "runs": runs,
    }


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not available on this platform
        return math.nan
