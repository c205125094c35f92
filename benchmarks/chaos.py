"""``gridserve bench chaos``: streams that survive SIGKILLed roles, measured.

Serves the model with DP = 2 through the launcher (which restarts dead roles, as ``gridserve serve``
does) and the Envoy edge, and sends the same bounded load of streaming completions (greedy and
seeded, fixed length: ``ignore_eos``, ``min_tokens``) three times: twice fault-free, once while a
``FaultInjector`` SIGKILLs a random engine, coordinator or (with ``--kill``) worker a few times,
spread over the load. Reports requests completed / failed, outputs that differ from the first
fault-free run (and, as the baseline, how many the second fault-free run differs in), streams
whose SSE chunks were duplicated or missing (token counts vs ``max_tokens`` and ``usage``), per
fault the time until every stream then in flight had its next token and until the role served
again, and the p50 / p99 latency the faults added per request; the JSON goes to
``benchmarks/results/``.

The engines serve with ``--batch-invariant`` (``--no-batch-invariant`` turns it off): a token's
logits are then bitwise the same in any batch mix and after a continuation's re-prefill, so every
output — greedy or seeded — must equal the fault-free run's, and any difference fails the run.
Without it only a greedy output that an engine / worker fault struck fails it (seeded draws near a
CDF step may flip with the batch mix; see docs/serving/limits.md).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import random
import shlex
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("engine", "coordinator", "worker")
RESTART_TIMEOUT_S = 180.0
PROMPTS = [
    "def fibonacci(n):\n", "import os\n\nclass Config:\n", "    for key, value in items:\n",
    "def parse_args(argv):\n    parser = ", "try:\n    import json\nexcept ImportError:\n",
    "class Node:\n    def __init__(self, ", "with open(path) as f:\n", "    return sorted(",
]


@dataclass
class ChaosRequest:
    index: int
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: Optional[int] = None

    def body(self, model: str) -> dict:
        body = {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "min_tokens": self.max_tokens, "ignore_eos": True, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclass
class StreamResult:
    """One streamed completion as the client saw it."""

    index: int
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # one per token (the chunks' logprobs.tokens)
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each text chunk
    usage: Optional[dict] = None
    finish_reason: Optional[str] = None
    done: bool = False  # [DONE] arrived
    error: Optional[str] = None
    start: float = 0.0
    end: float = 0.0

    @property
    def ok(self) -> bool:
        return self.done and self.error is None and self.finish_reason is not None

    @property
    def e2e(self) -> float:
        return self.end - self.start


def make_requests(count: int, max_tokens: int) -> list[ChaosRequest]:
    """Half greedy, half seeded sampling, over a fixed set of prompts."""
    return [ChaosRequest(i, PROMPTS[i % len(PROMPTS)], max_tokens,
                         temperature=0.0 if i % 2 == 0 else 0.9, seed=None if i % 2 == 0 else 1000 + i)
            for i in range(count)]


def stream_completion(address: str, model: str, request: ChaosRequest, timeout: float = 120.0,
                      on_chunk: Optional[Callable[[StreamResult], None]] = None) -> StreamResult:
    """POST ``/v1/completions`` with ``stream: true`` and read its SSE events to ``[DONE]``
    (``on_chunk`` is called after each event)."""
    host, port = address.rsplit(":", 1)
    result = StreamResult(request.index, start=time.monotonic())
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(request.body(model)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return result
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):]
            if payload == b"[DONE]":
                result.done = True
                break
            _on_event(result, json.loads(payload))
            if on_chunk is not None:
                on_chunk(result)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.monotonic()
        conn.close()
    return result


def _on_event(result: StreamResult, event: dict) -> None:
    if "error" in event:
        result.error = json.dumps(event["error"])[:300]
        return
    if event.get("usage"):
        result.usage = event["usage"]
    for choice in event.get("choices") or []:
        result.text += choice.get("text") or ""
        result.tokens += (choice.get("logprobs") or {}).get("tokens") or []
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        if choice.get("text") or (choice.get("logprobs") or {}).get("tokens"):
            result.chunk_times.append(time.monotonic())


class Progress:
    """Requests finished so far in a ``run_load`` (read by the fault thread)."""

    def __init__(self) -> None:
        self.finished = 0
        self.events = 0  # SSE events received, all streams together
        self.over = threading.Event()
        self._lock = threading.Lock()

    def one_more(self) -> None:
        with self._lock:
            self.finished += 1

    def on_chunk(self, result: StreamResult) -> None:
        with self._lock:
            self.events += 1


def run_load(address: str, model: str, requests: list[ChaosRequest], concurrency: int,
             progress: Optional[Progress] = None, timeout: float = 180.0) -> list[StreamResult]:
    """Every request streamed, ``concurrency`` at a time (a closed loop: one ends, the next starts)."""
    progress = progress or Progress()

    def one(request: ChaosRequest) -> StreamResult:
        try:
            return stream_completion(address, model, request, timeout, progress.on_chunk)
        finally:
            progress.one_more()

    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(one, requests))
    finally:
        progress.over.set()


def stream_faults(result: StreamResult, request: ChaosRequest) -> list[str]:
    """What is wrong with one stream on its own: missing / duplicated chunks, usage."""
    problems = []
    if len(result.tokens) != request.max_tokens:
        problems.append(f"{len(result.tokens)} tokens streamed, {request.max_tokens} expected")
    usage = result.usage or {}
    if usage.get("completion_tokens") != request.max_tokens:
        problems.append(f"usage.completion_tokens={usage.get('completion_tokens')}")
    return problems


def resumed_after(results: list[StreamResult], kill_time: float) -> Optional[float]:
    """Kill -> the moment every stream in flight then had received its next token (the slowest
    one: a stream of the killed engine, continued on the other)."""
    waits = []
    for r in results:
        if r.chunk_times and r.chunk_times[0] < kill_time < r.chunk_times[-1]:
            waits.append(next(t for t in r.chunk_times if t > kill_time) - kill_time)
    return max(waits) if waits else None


def longest_pause(results: list[StreamResult], kill_time: float, window_s: float = 5.0) -> Optional[float]:
    """The longest gap between two chunks of any stream that ended within ``window_s`` after the
    kill: the pause a client saw (an upper bound on the failover time: it includes the normal
    inter-token gap and a token already on its way when the engine died)."""
    gaps = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])
            if kill_time < b <= kill_time + window_s]
    return max(gaps) if gaps else None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class FaultInjector:
    """SIGKILLs a random role of ``kinds`` ``count`` times, the ``i``-th once ``(i + 1) / (count + 1)``
    of the requests have finished. An engine (or worker) is only killed while the other engine
    serves, so some engine can always take the streams over; roles that are still restarting are
    never chosen. Records kill time and restart time (kill -> the role serving again) per fault."""

    def __init__(self, launcher, kinds: list[str], count: int, total: int, progress: Progress,
                 rng: random.Random) -> None:
        self.launcher = launcher
        self.kinds = kinds
        self.count = count
        self.total = total
        self.progress = progress
        self.rng = rng
        self.faults: list[dict] = []
        self.skipped = 0
        self._restarts: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        for i in range(self.count):
            threshold = self.total * (i + 1) / (self.count + 1)
            victim = None
            while not self.progress.over.is_set():
                if self.progress.finished >= threshold:
                    victim = self._pick()
                    if victim is not None:
                        break
                time.sleep(0.01)
            if victim is None:
                self.skipped = self.count - i
                return
            self._kill(victim)

    def _serving(self, proc) -> bool:
        return proc.process.poll() is None and not any(f["address"] == proc.address or (
            f["group"] is not None and f["group"] == proc.group) for f in self._pending())

    def _pending(self) -> list[dict]:
        return [f for f in self.faults if "restart_s" not in f]

    def _pick(self):
        procs = self.launcher.processes
        candidates = []
        for proc in procs:
            if proc.role not in self.kinds or not self._serving(proc):
                continue
            if proc.role in ("engine", "worker"):
                others = [p for p in procs if p.role == "engine" and p.group != proc.group]
                if not any(self._serving(p) for p in others):
                    continue
            candidates.append(proc)
        return self.rng.choice(candidates) if candidates else None

    def _kill(self, proc) -> None:
        import os
        import signal

        old_pid, kill_time = proc.pid, time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        fault = {"role": proc.role, "address": proc.address, "pid": old_pid, "group": proc.group,
                 "kill_time": kill_time}
        self.faults.append(fault)
        logger.warning("chaos: SIGKILL %s (pid %d) on %s", proc.role, old_pid, proc.address)
        thread = threading.Thread(target=self._await_restart, args=(proc, fault), daemon=True)
        self._restarts.append(thread)
        thread.start()

    def _await_restart(self, proc, fault: dict) -> None:
        from gridserve.shared.rpc.client import wait_until_serving

        group = [p for p in self.launcher.processes if proc.group is not None and p.group == proc.group]
        deadline = fault["kill_time"] + RESTART_TIMEOUT_S
        for member in sorted(group or [proc], key=lambda p: p is not proc):  # the killed one first
            while time.monotonic() < deadline:
                if member.process.poll() is None and member.pid != fault["pid"]:
                    try:
                        wait_until_serving(member.address, timeout=1.0)
                        break
                    except TimeoutError:
                        continue
                time.sleep(0.05)
        if time.monotonic() < deadline:
            fault["restart_s"] = time.monotonic() - fault["kill_time"]

    def join(self) -> None:
        """Wait for the fault thread and every killed role to serve again (up to ``RESTART_TIMEOUT_S``)."""
        self.thread.join()
        for thread in self._restarts:
            thread.join(timeout=RESTART_TIMEOUT_S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the demo model, as gridserve serve)")
    parser.add_argument("--requests", type=int, default=256, help="streaming requests per run")
    parser.add_argument("--concurrency", type=int, default=32, help="streams in flight at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (fixed: ignore_eos)")
    parser.add_argument("--faults", type=int, default=3, help="SIGKILLs during the chaos run")
    parser.add_argument("--kill", default="engine,coordinator",
                        help=f"roles to kill, comma-separated, from {','.join(KINDS)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument("--engine-args", default="", help="more engine flags, e.g. '--no-prefix-caching'")
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="serve without --batch-invariant (then seeded outputs may differ with the batch "
                             "mix, and only greedy outputs struck by a fault are failures)")
    parser.add_argument("--output-json", default=None,
                        help="write the results here (default: benchmarks/results/chaos-<time>.json)")


def run(args: argparse.Namespace) -> int:
    from gridserve.launcher import Launcher, free_port

    kinds = [k.strip() for k in args.kill.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"--kill: {bad or 'nothing'} not in {KINDS}")
    model = args.model
    if model is None:
        from gridserve.demo.train import ensure_demo_model

        model = str(ensure_demo_model())
    requests = make_requests(args.requests, args.max_tokens)
    engine_args = ["--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "128", *shlex.split(args.engine_args)]
    if args.batch_invariant and "--batch-invariant" not in engine_args:
        engine_args.append("--batch-invariant")
    launcher = Launcher(model, engine_args,
                        data_parallel_size=2, api_server_count=1, edge_port=free_port(), grace_s=2.0)
    launcher.start()
    supervisor = threading.Thread(target=launcher.supervise, kwargs={"poll_s": 0.05}, daemon=True)
    supervisor.start()
    try:
        address = launcher.edge_address
        print(launcher.table())
        run_load(address, launcher.model, requests[:4], 4)  # warm-up
        start = time.monotonic()
        clean = run_load(address, launcher.model, requests, args.concurrency)
        clean_s = time.monotonic() - start
        # a second fault-free run: what differs here is the engines' numerics in another batch mix
        baseline = run_load(address, launcher.model, requests, args.concurrency)
        progress = Progress()
        injector = FaultInjector(launcher, kinds, args.faults, len(requests), progress, random.Random(args.seed))
        start = time.monotonic()
        injector.start()
        chaos = run_load(address, launcher.model, requests, args.concurrency, progress)
        chaos_s = time.monotonic() - start
        injector.join()
    finally:
        launcher.stop()
    report = summarize(requests, clean, chaos, injector.faults, clean_s, chaos_s)
    report["baseline_differing"] = _differing(clean, baseline, [])
    # what the faults could have caused: a fault struck the stream, and fault-free runs agree on it
    report.update(judge(requests, report["differing_details"], report["baseline_differing"]))
    report["faults_skipped"] = injector.skipped  # the load ended before a role could be killed
    report["batch_invariant"] = "--batch-invariant" in engine_args
    report["config"] = {"model": model, "requests": args.requests, "concurrency": args.concurrency,
                        "max_tokens": args.max_tokens, "faults": args.faults, "kill": kinds,
                        "seed": args.seed, "engine_args": engine_args, "data_parallel_size": 2}
    print(format_report(report))
    out = Path(args.output_json) if args.output_json else RESULTS / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if passed(report) else 1


def passed(report: dict) -> bool:
    """No lost request, no broken stream, and no differing output that counts: with batch-invariant
    engines every difference (greedy or seeded, chaos or the second fault-free run); without, only
    a greedy output that a fault struck while the fault-free runs agree (see docs/serving/limits.md)."""
    if report["failed"] or report["bad_streams"]:
        return False
    if report.get("batch_invariant"):
        return not (report["differing"] or report.get("baseline_differing"))
    return not report["greedy_differing_under_fault"]


def judge(requests: list[ChaosRequest], differing: dict, baseline: dict) -> dict:
    """Which differing outputs a fault could have caused. Only an engine's or a worker's death
    touches a stream's tokens (it continues elsewhere); without ``--batch-invariant`` seeded sampling
    also differs between two fault-free runs now and then (the engines' logits are not bit-identical across batch mixes, so
    a draw near a CDF step can flip), greedy outputs never did. A greedy stream that an engine or
    worker fault struck and that differs fails the run; seeded ones are reported."""
    struck = sorted(i for i, d in differing.items()
                    if {"engine", "worker"} & set(d["faults_in_flight"]) and i not in baseline)
    greedy = {r.index for r in requests if r.temperature == 0.0}
    return {"differing_greedy": sorted(i for i in differing if i in greedy),
            "differing_under_fault": struck,
            "greedy_differing_under_fault": [i for i in struck if i in greedy]}


def summarize(requests: list[ChaosRequest], clean: list[StreamResult], chaos: list[StreamResult],
              faults: list[dict], clean_s: float, chaos_s: float) -> dict:
    failed = [r for r in chaos if not r.ok]
    differing = _differing(clean, chaos, faults)
    bad = {r.index: stream_faults(r, q) for r, q in zip(chaos, requests) if r.ok and stream_faults(r, q)}
    clean_bad = {r.index: stream_faults(r, q) for r, q in zip(clean, requests) if not r.ok or stream_faults(r, q)}
    added = [f.e2e - c.e2e for c, f in zip(clean, chaos) if c.ok and f.ok]
    itl = [b - a for r in clean for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    fault_rows = []
    for fault in faults:
        resumed = resumed_after(chaos, fault["kill_time"])
        pause = longest_pause(chaos, fault["kill_time"])
        fault_rows.append({"role": fault["role"], "address": fault["address"],
                           "at_s": round(fault["kill_time"] - min(r.start for r in chaos), 2),
                           "streams_resumed_s": None if resumed is None else round(resumed, 3),
                           "longest_pause_s": None if pause is None else round(pause, 3),
                           "restart_s": round(fault["restart_s"], 2) if "restart_s" in fault else None})
    return {
        "completed": len(chaos) - len(failed), "failed": len(failed),
        "failures": {r.index: r.error or "ended without [DONE]" for r in failed},
        "differing": len(differing), "differing_details": differing,
        "bad_streams": len(bad), "bad_stream_details": bad, "fault_free_bad": clean_bad,
        "faults": fault_rows,
        "added_latency_p50_s": round(percentile(added, 50), 3), "added_latency_p99_s": round(percentile(added, 99), 3),
        "fault_free_e2e_p50_s": round(percentile([r.e2e for r in clean], 50), 3),
        "fault_free_itl_p99_s": round(percentile(itl, 99), 3),
        "fault_free_run_s": round(clean_s, 2), "chaos_run_s": round(chaos_s, 2),
    }


def _differing(clean: list[StreamResult], other: list[StreamResult], faults: list[dict]) -> dict:
    return {c.index: _first_difference(c, f, faults) for c, f in zip(clean, other)
            if f.ok and (c.text != f.text or c.tokens != f.tokens)}


def _first_difference(clean: StreamResult, chaos: StreamResult, faults: list[dict]) -> dict:
    """Where two runs of a stream part, and whether a fault struck while it was in flight."""
    at = next((i for i, (x, y) in enumerate(zip(clean.tokens, chaos.tokens)) if x != y),
              min(len(clean.tokens), len(chaos.tokens)))
    struck = [f["role"] for f in faults if chaos.start < f["kill_time"] < chaos.end]
    return {"token": at, "faults_in_flight": struck}


def format_report(report: dict) -> str:
    lines = [f"batch-invariant engines: {'yes: every differing output fails the run' if report.get('batch_invariant') else 'no'}",
             f"requests completed {report['completed']}, failed {report['failed']}; outputs differing from "
             f"the fault-free run: {report['differing']} (a second fault-free run: "
             f"{len(report.get('baseline_differing', {}))}; greedy: {len(report.get('differing_greedy', []))}; "
             f"struck by an engine / worker fault while the fault-free runs agree: "
             f"{len(report.get('differing_under_fault', []))}, greedy among them: "
             f"{len(report.get('greedy_differing_under_fault', []))}); streams with duplicated / missing "
             f"chunks or wrong usage: {report['bad_streams']}",
             f"added latency per request: p50 {report['added_latency_p50_s']} s, p99 {report['added_latency_p99_s']} s "
             f"(fault-free e2e p50 {report['fault_free_e2e_p50_s']} s, ITL p99 {report['fault_free_itl_p99_s']} s)",
             f"{'fault':<12}{'at (s)':>8}{'streams resumed (s)':>22}{'longest pause (s)':>19}"
             f"{'role restarted (s)':>21}"]
    for f in report["faults"]:
        lines.append(f"{f['role']:<12}{f['at_s']:>8}{str(f['streams_resumed_s']):>22}"
                     f"{str(f.get('longest_pause_s')):>19}{str(f['restart_s']):>21}")
    for index, error in list(report["failures"].items())[:5]:
        lines.append(f"failed request {index}: {error}")
    return "\n".join(lines)
