"""The latency probe of ``gridserve bench serve``: what an interactive user sees beside the load.

While the load (workload W, say) runs, one short streaming request goes out every ``1 /
--probe-rate`` seconds, each on schedule whatever the earlier ones are doing, on a client of its own
(never queued behind the load's connection limit), with a fresh random prompt each (no prefix-cache
hits). Its TTFT is reported apart from the load's (``{median,p99,...}_probe_ttft_ms``).

``--probe-priority P`` sends the probes with vLLM's ``priority`` field (lower runs first on a server
with ``--scheduling-policy priority``; gridserve's gateway accepts it with
``--allow-client-priority``); the load's requests carry none (0). A list (``0,-1``) runs the load
once per value, so the probe at the load's own priority and the probe ahead of it are measured in
one invocation, against one server, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from gridserve.benchmarks.datasets import BenchRequest, Vocabulary, uniform_requests
from gridserve.benchmarks.metrics import RequestResult

PROBE_SEED = 7_000_000_000  # probe prompts' seeds start here: far from any load's seed
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # a priority travels as a protobuf int32


@dataclass(frozen=True)
class LatencyProbe:
    """One short request every ``1 / rate`` seconds from the start of the load until its end, each
    sent on time whatever the earlier ones are doing (an interactive user sharing the server).
    ``request(i)`` is the ``i``-th probe's request (a fresh prompt each: no prefix-cache hits);
    ``priority`` the ``priority`` field it carries (0: none)."""

    rate: float
    request: Callable[[int], BenchRequest]
    drain_s: float = 60.0  # how long probes still in flight when the load ends may take to finish
    priority: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"--probe-rate must be a positive number of requests per second, got {self.rate}")


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The probe's options, in a group of their own."""
    group = parser.add_argument_group("latency probe", "short streaming requests on a schedule of their own "
                                      "while the load runs; their TTFT is reported apart")
    group.add_argument("--probe-rate", type=float, default=0.0, metavar="PER_S",
                       help="probe requests per second (default 0: no probe)")
    group.add_argument("--probe-input-len", type=int, default=32, help="prompt tokens of each probe request")
    group.add_argument("--probe-output-len", "--probe-max-tokens", dest="probe_output_len", type=int, default=4,
                       help="output tokens of each probe request (its max_tokens)")
    group.add_argument("--probe-priority", default="0", metavar="P[,P...]",
                       help="the probes' priority field (lower runs first on a server with --scheduling-policy "
                            "priority; 0: not sent); a list such as 0,-1 runs the load once per value")


def probe_priorities(text: str) -> list[int]:
    """``--probe-priority``'s values, each an int32."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--probe-priority: expected integers like -1 or 0,-1, got {text!r}") from None
    if not values or any(not INT32_MIN <= v <= INT32_MAX for v in values):
        raise ValueError(f"--probe-priority: expected integers in [{INT32_MIN}, {INT32_MAX}], got {text!r}")
    return values


def latency_probe(rate: float, vocabulary: Vocabulary, input_len: int, output_len: int, seed: int,
                  as_text: bool, priority: int = 0) -> Optional[LatencyProbe]:
    """The probe of ``--probe-rate`` (``None`` when it is 0): probe ``i`` gets a random prompt of
    ``input_len`` ids of its own (seeded apart from the load's prompts) and ``output_len`` tokens."""
    if rate == 0:
        return None
    for flag, value in (("--probe-input-len", input_len), ("--probe-output-len", output_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")

    def request(i: int) -> BenchRequest:
        return uniform_requests(1, vocabulary, (input_len, input_len), (output_len, output_len),
                                seed=PROBE_SEED + seed * 1_000_003 + i, as_text=as_text)[0]

    return LatencyProbe(rate, request, priority=priority)


async def run_probes(probe: LatencyProbe, send: Callable[[BenchRequest], Awaitable[RequestResult]],
                     load_done: asyncio.Event) -> list[RequestResult]:
    """Send ``probe``'s requests with ``send`` on schedule until ``load_done`` is set; then give those
    still in flight ``probe.drain_s`` to finish (the rest fail). Results in sending order,
    ``sent_at`` from the start."""
    sent: list[tuple[float, asyncio.Task]] = []
    start = time.perf_counter()
    while not load_done.is_set():
        due = start + len(sent) / probe.rate
        try:
            await asyncio.wait_for(load_done.wait(), max(0.0, due - time.perf_counter()))
            break
        except asyncio.TimeoutError:
            pass
        sent.append((time.perf_counter() - start, asyncio.create_task(send(probe.request(len(sent))))))
    tasks = [task for _, task in sent]
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=probe.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    unfinished = f"not finished within {probe.drain_s:g}s after the load ended"
    return [replace(task.result() if not task.cancelled() else
                    RequestResult(0, 0, error=unfinished), sent_at=at) for at, task in sent]


def format_probe_table(runs: Sequence[dict[str, Any]]) -> str:
    """One Markdown row per run with a probe: the probes' priority and TTFT beside the load's throughput."""
    lines = ["| probe priority | output tok/s | TTFT median ms | probe TTFT median ms | probe TTFT p99 ms | "
             "probes completed |", "|---|---|---|---|---|---|"]
    for run in runs:
        if "probe_sent" in run:
            lines.append(f"| {run.get('probe_priority', 0)} | {run['output_throughput']:.1f} | "
                         f"{run['median_ttft_ms']:.0f} | {run['median_probe_ttft_ms']:.0f} | "
                         f"{run['p99_probe_ttft_ms']:.0f} | {run['probe_completed']} / {run['probe_sent']} |")
    return "\n".join(lines)
