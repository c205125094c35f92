"""Expert parallelism across DP engines (``--enable-expert-parallel``): real engines, workers and
coordinator through the launcher, on tiny Qwen3-MoE and DeepSeek-V2 checkpoints.

DP=2 with expert parallelism gives the same greedy tokens as one engine holding every expert (8
prompts x 16 tokens, sent to both engines at once); each worker holds half of every MoE layer's
experts (the bytes its log reports, and the process table); a request on one engine completes while
the other, idle, runs zero-token steps whose MoE collectives pair with its peer's; a worker killed
mid-request ends the request (an error or its tokens) within a bound: never a hang.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gridserve import LLM
from gridserve.services.worker.fused_moe import expert_parameter_bytes

from . import test_zoo_deepseek, test_zoo_moe
from .services import ENGINE_ARGS, deployment, gateway_stub, greedy, token_prompt
from .test_llm_matches_hf import _generate_ids, _prompts
from .test_moe_waves import _counter

pytestmark = pytest.mark.slow

KV_BYTES = 32 << 20
TOKENS = 16
CHECKPOINTS = {"qwen3_moe": lambda: test_zoo_moe.checkpoint("qwen3_moe"),
               "deepseek_v2": lambda: test_zoo_deepseek.checkpoint("deepseek_v2")}
PROMPTS = _prompts(8, 3, 40, seed=5)


@functools.cache
def _single_engine(name: str) -> tuple[list[list[int]], int]:
    """Greedy tokens of one engine holding every expert (DP=1, no EP), and its expert bytes."""
    llm = LLM(model=CHECKPOINTS[name](), kv_cache_memory_bytes=KV_BYTES)
    try:
        tokens = _generate_ids(llm, PROMPTS, TOKENS)
    finally:
        llm.shutdown()
    return tokens, expert_parameter_bytes(test_zoo_moe._load(CHECKPOINTS[name]()))[0]


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def ep(request, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(f"ep-{request.param}")
    with pytest.MonkeyPatch.context() as env:
        # the killed-worker test's request ends once the gateway stops looking for a live engine
        env.setenv("GRIDSERVE_FAILOVER_TIMEOUT_S", "10")
        with deployment(CHECKPOINTS[request.param](), log_dir, data_parallel_size=2,
                        engine_args=[*ENGINE_ARGS, "--enable-expert-parallel"]) as launcher:
            yield request.param, launcher, log_dir


def _generate(launcher, prompt: list[int], rank: int, max_tokens: int = TOKENS, timeout: float = 120) -> list[int]:
    with grpc.insecure_channel(launcher.gateway_addresses[0]) as channel:
        request = token_prompt(prompt, greedy(max_tokens))
        request.data_parallel_rank = rank
        return [t for r in gateway_stub(channel).Generate(request, timeout=timeout) for t in r.token_ids]


def test_dp2_with_expert_parallelism_matches_one_engine_with_every_expert(ep):
    name, launcher, _ = ep
    expected, _ = _single_engine(name)
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        futures = [pool.submit(_generate, launcher, p, i % 2) for i, p in enumerate(PROMPTS)]
        got = [f.result(timeout=180) for f in futures]
    assert got == expected


def test_each_worker_holds_half_of_the_experts(ep):
    name, launcher, log_dir = ep
    _, full_bytes = _single_engine(name)
    held = {}
    for rank in range(2):
        text = (log_dir / f"worker-{rank}.log").read_text(errors="replace")
        match = re.search(r"experts \[(\d+), (\d+)\) of (\d+) per MoE layer, expert parameter bytes (\d+)", text)
        assert match, f"worker-{rank} did not report its experts"
        held[rank] = tuple(int(g) for g in match.groups())
    experts = held[0][2]
    assert [held[r][:2] for r in range(2)] == [(0, experts // 2), (experts // 2, experts)]
    assert held[0][3] == held[1][3] == full_bytes // 2
    assert f"experts [0, {experts // 2}) of {experts}" in launcher.table()


def test_one_engine_serves_while_the_idle_one_steps_with_zero_tokens(ep):
    _, launcher, _ = ep
    engines = [p for p in launcher.processes if p.role == "engine"]
    before = _counter(engines[1], "gridserve:wave_dummy_steps")
    expected, _ = _single_engine(ep[0])
    assert _generate(launcher, PROMPTS[0], rank=0) == expected[0]
    assert _counter(engines[1], "gridserve:wave_dummy_steps") - before >= TOKENS - 1


def test_a_killed_worker_ends_the_request_instead_of_hanging(ep):
    """Last in the module: it breaks the deployment. The request on engine 0 needs engine 1's
    worker for its experts; killed, the step fails (the collective's peer is gone) and the client
    gets an error or, after recovery, its tokens, within the bound."""
    name, launcher, _ = ep
    if name != "qwen3_moe":
        pytest.skip("once is enough")
    worker = [p for p in launcher.processes if p.role == "worker"][-1]  # DP rank 1's
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_generate, launcher, PROMPTS[1], 0, 400, 150)
        time.sleep(1.0)
        os.kill(worker.pid, signal.SIGKILL)
        try:
            tokens = future.result(timeout=170)
            assert len(tokens) == 400  # recovered and completed
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the request hung until its deadline"
    assert time.monotonic() - start < 150


def test_tensor_parallelism_inside_each_expert_parallel_rank_keeps_the_tokens(tmp_path):
    """DP=2 x TP=2 with expert parallelism (4 workers: each TP group splits its half of the experts
    by intermediate size): one engine's greedy tokens, up to a near-tie flipped by the TP all-reduce's
    summation order (as the TP tests allow)."""
    expected, _ = _single_engine("qwen3_moe")
    with deployment(CHECKPOINTS["qwen3_moe"](), tmp_path, data_parallel_size=2, tensor_parallel_size=2,
                    engine_args=[*ENGINE_ARGS, "--enable-expert-parallel"]) as launcher:
        with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
            futures = [pool.submit(_generate, launcher, p, i % 2) for i, p in enumerate(PROMPTS)]
            got = [f.result(timeout=300) for f in futures]
    assert sum(g == e for g, e in zip(got, expected)) >= len(PROMPTS) - 1, (got, expected)
    assert all(len(g) == TOKENS for g in got)
