"""Disaggregated prefill / decode with real processes: ``gridserve serve --disaggregated P:D`` of the
tiny Llama as the launcher runs it (P prefill engines, D decode engines, each with its worker, the
coordinator, a gateway and the Envoy edge).

- P=1/D=1: greedy outputs through the gateway's gRPC and the openai client through the edge
  (streamed and not) equal the offline ``LLM``'s; the KV bytes the prefill engine served and the
  decode engine pulled equal the prompts' blocks' size; nothing stays held; ``/v1/status`` shows
  each engine's role and transfers; a stop string met by the first token leaves nothing held on the
  prefill engine at once (the gateway's abort releases the transfer), not at its deadline.
- P=1/D=1 of a sliding-window model (Gemma 2's layout: window 16 on every other layer, two KV cache
  groups; one worker per engine, and -pp 2): greedy outputs equal the offline ``LLM``'s; every group's prompt blocks move except the
  window's blocks out of the decode engine's first window (the bytes count them out); nothing held.
- P=1/D=2 (batch-invariant engines, supervised: dead roles restart): greedy outputs equal the
  ``LLM``'s and both decode engines decode; the prefill engine SIGKILLed under 24 streams and a
  decode engine SIGKILLed mid-stream: every stream completes with the fault-free run's tokens (no
  chunk twice or lost), and afterwards no engine holds a KV block.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gridserve import LLM, SamplingParams
from gridserve import launcher as launcher_module
from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.benchmarks.chaos import Progress, make_requests, run_load, stream_faults
from gridserve.launcher import free_port
from gridserve.shared.kv_cache_spec import num_skipped_blocks
from gridserve.shared.rpc.client import wait_until_serving

from .services import (
    ENGINE_ARGS,
    KV_BYTES,
    deployment,
    engine_stub,
    gateway_stub,
    greedy,
    token_prompt,
)
from .test_kv_cache_groups import gemma2

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
LENGTHS = (3, 15, 16, 17, 40, 64, 100, 150)  # prompt tokens: partial, exact and several blocks
STREAMS = 24
STREAM_TOKENS = 60


def _prompt(i: int, length: int) -> list[int]:
    return [(7 + 31 * i + 13 * j) % 4000 + 10 for j in range(length)]


PROMPTS = [_prompt(i, n) for i, n in enumerate(LENGTHS * 2)]


@pytest.fixture(scope="module")
def reference(llama_tiny):
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        texts = llm.generate(["def fibonacci(n):\n", "import os\n\nclass Config:\n"],
                             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].text for o in texts]


def _supervised(launcher):
    thread = threading.Thread(target=launcher.supervise, kwargs={"poll_s": 0.05}, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def pd11(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(),
                    disaggregated=(1, 1)) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def pd12(llama_tiny, tmp_path_factory):
    saved, launcher_module.RESTART_BACKOFF_S = launcher_module.RESTART_BACKOFF_S, (0.2, 1.0)
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(), disaggregated=(1, 2),
                    engine_args=[*ENGINE_ARGS, "--batch-invariant"]) as launcher:
        thread = _supervised(launcher)
        yield launcher
    thread.join(timeout=30)
    launcher_module.RESTART_BACKOFF_S = saved


def _engines(launcher):
    """The engines in DP-rank order: the prefill engines (ranks below P), then the decode engines."""
    return sorted((p for p in launcher.processes if p.role == "engine"), key=lambda p: p.group)


def _generate(channel, prompt: list[int]) -> list[int]:
    request = token_prompt(prompt, greedy(MAX_TOKENS))
    return [t for r in gateway_stub(channel).Generate(request, timeout=120) for t in r.token_ids]


def _generate_all(launcher) -> list[list[int]]:
    with grpc.insecure_channel(launcher.gateway_addresses[0]) as channel, ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: _generate(channel, p), PROMPTS))


def _load(engine) -> engine_pb2.GetLoadResponse:
    with grpc.insecure_channel(engine.address) as channel:
        return engine_stub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)


def _idle(engines, timeout: float = 30.0) -> list[engine_pb2.GetLoadResponse]:
    """Every engine's load once none holds a KV block or runs anything (a producer's transfers
    are released a step after their pull)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [_load(e) for e in engines]
        if all(lo.kv_cache_usage == 0 and not lo.num_running and not lo.kv_transfers.held_blocks for lo in loads):
            return loads
        assert time.monotonic() < deadline, [(lo.kv_cache_usage, lo.num_running, lo.kv_transfers) for lo in loads]
        time.sleep(0.1)


def _bytes_per_block(model, block_size: int) -> int:
    config = json.loads((model / "config.json").read_text())
    per_token = 2 * config["num_key_value_heads"] * config["head_dim"] * 4  # K and V, float32
    return config["num_hidden_layers"] * per_token * block_size


def _assert_prompts_moved_once(model, producer, consumer, block_size: int) -> None:
    """Once both engines are idle: every prompt was pulled once, none failed or expired, the bytes
    sent = received = the prompts' blocks, and the prefill engine holds nothing."""
    blocks = sum(-(-len(p) // block_size) for p in PROMPTS)
    sent, received = (lo.kv_transfers for lo in _idle([producer, consumer]))
    assert sent.transfers_sent == received.transfers_received == len(PROMPTS)
    assert received.transfers_failed == 0 and sent.transfers_expired == 0
    assert sent.bytes_sent == received.bytes_received == blocks * _bytes_per_block(model, block_size)
    assert sent.held_blocks == sent.transfers_held == 0


def test_p1_d1_outputs_equal_a_single_engine_and_the_kv_moved_is_the_prompts_blocks(pd11, reference, llama_tiny):
    producer, consumer = _engines(pd11)
    assert [_load(e).kv_transfers.kv_role for e in (producer, consumer)] == ["kv_producer", "kv_consumer"]
    assert "dp 0, kv_producer" in pd11.table() and "dp 1, kv_consumer" in pd11.table()
    assert _generate_all(pd11) == reference[0]
    layouts = []
    for engine in (producer, consumer):
        with grpc.insecure_channel(engine.address) as channel:
            info = engine_stub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
        layouts.append(info.kv_layout)
    block_size = info.block_size
    assert layouts[0] == layouts[1] and layouts[0].block_size == block_size  # the gateway pairs them by it
    assert layouts[0].num_kv_cache_groups == 1 and layouts[0].world_size == 1
    _assert_prompts_moved_once(llama_tiny, producer, consumer, block_size)
    with grpc.insecure_channel(pd11.gateway_addresses[0]) as channel:
        status = gateway_stub(channel).GetStatus(gateway_pb2.GetStatusRequest(), timeout=10)
    assert [(e.kv_role, e.kv_transfers.transfers_sent, e.kv_transfers.transfers_received) for e in status.engines] \
        == [("kv_producer", len(PROMPTS), 0), ("kv_consumer", 0, len(PROMPTS))]


@pytest.mark.parametrize("shape", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_p1_d1_with_two_workers_per_engine_pairs_the_workers_rank_by_rank(llama_tiny, tmp_path, reference, shape):
    """-tp 2 (or -pp 2) on both sides: each decode worker pulls its shard (half the KV heads, or
    half the layers) from the prefill worker of its rank; outputs equal a single engine's, every
    rank's shard moved (together the prompts' blocks, once), and the prefill engine frees each
    transfer only once both ranks served."""
    with deployment(llama_tiny, tmp_path, disaggregated=(1, 1), **shape) as launcher:
        producer, consumer = _engines(launcher)
        assert sum(p.role == "worker" for p in launcher.processes) == 4
        assert _generate_all(launcher) == reference[0]
        with grpc.insecure_channel(producer.address) as channel:
            block_size = engine_stub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10).block_size
        _assert_prompts_moved_once(llama_tiny, producer, consumer, block_size)


def _window_bytes(model, block_size: int, length: int) -> int:
    """The KV bytes a transfer of a ``length``-token prompt moves: every block of each full layer,
    and of each window layer only the blocks the decode engine's first token's window reaches."""
    config = json.loads((model / "config.json").read_text())
    per_layer_block = 2 * config["num_key_value_heads"] * config["head_dim"] * 4 * block_size  # K and V, fp32
    blocks = -(-length // block_size)
    window = config["sliding_window"]
    return per_layer_block * sum(blocks - (num_skipped_blocks(window, length, block_size) if kind == "sliding_attention"
                                           else 0) for kind in config["layer_types"])


@pytest.fixture(scope="module")
def hybrid_reference():
    """Gemma 2's layout (window 16 on layers 0 and 2, full 1 and 3) and the offline ``LLM``'s outputs."""
    model = Path(gemma2())
    llm = LLM(model=str(model), kv_cache_memory_bytes=KV_BYTES)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return model, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("shape", [{}, {"pipeline_parallel_size": 2}], ids=["one-worker", "pp2"])
def test_p1_d1_of_a_sliding_window_model_moves_every_kv_cache_group(hybrid_reference, tmp_path, shape):
    """Two KV cache groups (window, full) sharing each KV tensor; with -pp 2 each rank's tensor
    holds one layer of each group."""
    model, expected = hybrid_reference
    with deployment(model, tmp_path, disaggregated=(1, 1), **shape) as launcher:
        producer, consumer = _engines(launcher)
        assert _generate_all(launcher) == expected
        with grpc.insecure_channel(producer.address) as channel:
            info = engine_stub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
        assert len(info.kv_cache_groups) == 2  # the hybrid plan: a window group and a full one
        sent, received = (lo.kv_transfers for lo in _idle([producer, consumer]))
        assert sent.transfers_sent == received.transfers_received == len(PROMPTS)  # pulled, not recomputed
        assert received.transfers_failed == 0 and sent.transfers_expired == 0
        moved = sum(_window_bytes(model, info.block_size, len(p)) for p in PROMPTS)
        assert moved < sum(-(-len(p) // info.block_size) for p in PROMPTS) * _bytes_per_block(model, info.block_size)
        assert sent.bytes_sent == received.bytes_received == moved
        assert sent.held_blocks == sent.transfers_held == 0


def test_p1_d1_openai_client_through_the_edge_sees_one_stream(pd11, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{pd11.edge_address}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts, expected = ["def fibonacci(n):\n", "import os\n\nclass Config:\n"], reference[1]
    for prompt, text in zip(prompts, expected):
        whole = client.completions.create(model=pd11.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert whole.choices[0].text == text
        chunks = list(client.completions.create(model=pd11.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_a_stop_string_on_the_first_token_frees_the_prefill_engine_s_blocks_before_the_deadline(pd11):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{pd11.edge_address}/v1", api_key="unused", max_retries=0, timeout=60)
    producer = _engines(pd11)[0]
    _idle(_engines(pd11))
    before = _load(producer).kv_transfers
    first = ""
    for prompt in ("def fibonacci(n):\n", "import os\n\nclass Config:\n", "The quick brown fox"):
        chunks = client.completions.create(model=pd11.model, prompt=prompt, max_tokens=4, temperature=0, stream=True)
        first = next(c.choices[0].text for c in chunks if c.choices)
        if first.strip():
            break
    assert first.strip(), "no prompt's first token has visible text"
    _idle(_engines(pd11))
    sent = _load(producer).kv_transfers.transfers_sent
    started = time.monotonic()
    done = client.completions.create(model=pd11.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     stop=[first])
    assert done.choices[0].finish_reason == "stop" and done.choices[0].text == ""
    # the gateway's abort released the transfer: no pull, no expiry, nothing held, long before 30 s
    loads = _idle(_engines(pd11), timeout=5.0)
    assert time.monotonic() - started < 10
    after = loads[0].kv_transfers
    assert after.transfers_sent == sent and after.transfers_expired == before.transfers_expired == 0
    assert after.held_blocks == after.transfers_held == 0


def test_p1_d2_outputs_equal_a_single_engine_on_both_decode_engines(pd12, reference):
    producer, *decoders = _engines(pd12)
    assert _generate_all(pd12) == reference[0]
    loads = _idle([producer, *decoders])
    assert loads[0].kv_transfers.transfers_sent == len(PROMPTS)
    assert all(lo.kv_transfers.transfers_received > 0 for lo in loads[1:]), [lo.kv_transfers for lo in loads]
    assert sum(lo.kv_transfers.transfers_received for lo in loads[1:]) == len(PROMPTS)


def _kill_under_load(launcher, victim, when, before_fault=None):
    """The chaos load twice: fault-free, then (after ``before_fault()``) with ``victim()`` SIGKILLed
    once ``when(progress)``."""
    requests = make_requests(STREAMS, STREAM_TOKENS)
    clean = run_load(launcher.edge_address, launcher.model, requests, STREAMS)
    if before_fault is not None:
        before_fault()
    progress, out = Progress(), {}
    thread = threading.Thread(target=lambda: out.update(
        results=run_load(launcher.edge_address, launcher.model, requests, STREAMS, progress)))
    thread.start()
    while not when(progress):
        assert thread.is_alive(), "the load ended before the fault"
        time.sleep(0.002)
    victim().process.kill()
    thread.join(timeout=180)
    assert not thread.is_alive()
    results = out["results"]
    assert all(r.ok for r in clean), [r.error for r in clean if not r.ok]
    assert not {r.index: r.error or "no [DONE]" for r in results if not r.ok}
    for request, before, after in zip(requests, clean, results):
        assert stream_faults(after, request) == [], request.index
        assert after.tokens == before.tokens, request.index
        assert after.text == before.text, request.index


def _failovers(launcher) -> dict[str, float]:
    """The gateway's ``gridserve:engine_failovers_total`` by engine (its index in --engines)."""
    gateway = next(p for p in launcher.processes if p.role == "gateway")
    with urllib.request.urlopen(f"http://{gateway.metrics_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "gridserve:engine_failovers_total"}


def _wait_restarted(engine, pid: int) -> None:
    deadline = time.monotonic() + 120
    while engine.pid == pid or engine.process.poll() is not None:
        assert time.monotonic() < deadline, "the launcher did not restart the engine"
        time.sleep(0.05)
    wait_until_serving(engine.address, timeout=120)


def test_prefill_engine_killed_under_load_every_stream_completes_unchanged(pd12):
    producer = _engines(pd12)[0]
    pid, before = producer.pid, _failovers(pd12).get("0", 0.0)
    # frozen (SIGSTOP) as the load starts, so that its requests are surely in flight on it, then
    # killed: they go on, whole, on a decode engine (a timed kill raced the fast prefill)
    started = {}

    def freeze() -> None:
        producer.process.send_signal(signal.SIGSTOP)
        started["at"] = time.monotonic()

    _kill_under_load(pd12, lambda: producer, lambda p: time.monotonic() - started["at"] > 0.5, freeze)
    assert _failovers(pd12).get("0", 0.0) > before, "no stream was prefilling when the prefill engine died"
    _wait_restarted(producer, pid)
    _idle(_engines(pd12))


def test_decode_engine_killed_mid_stream_every_stream_completes_unchanged(pd12):
    decoders = _engines(pd12)[1:]
    chosen = {}

    def busiest():  # the decode engine running the most streams when the fault comes
        chosen["engine"] = max(decoders, key=_busy)
        return chosen["engine"]

    before = _failovers(pd12)
    pids = {id(d): d.pid for d in decoders}
    _kill_under_load(pd12, busiest, lambda p: p.events >= STREAMS * STREAM_TOKENS // 3)
    victim = chosen["engine"]
    label = str(victim.group)  # its DP rank: its index in the gateway's --engines
    assert _failovers(pd12).get(label, 0.0) > before.get(label, 0.0), "no stream was decoding on the killed engine"
    _wait_restarted(victim, pids[id(victim)])
    _idle(_engines(pd12))


def _busy(engine) -> int:
    """Requests running or waiting on ``engine`` now."""
    load = _load(engine)
    return load.num_running + load.num_waiting
