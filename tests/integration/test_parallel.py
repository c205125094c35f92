"""Tensor and pipeline parallelism on CPU (gloo): sharded loading, same greedy outputs as one worker,
and a killed rank taking its group down cleanly."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from gridserve import LLM, SamplingParams
from gridserve.services.worker.loader import load_model, parameter_bytes
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.parallel import RankLayout
from gridserve.shared.rpc.client import health_status, make_channel

from .services import address, deployment, gateway_stub, greedy, token_prompt

SHARDED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "out_proj", "fc1", "fc2", "embed_tokens", "lm_head")
# Checkpoint tensors a TP rank must read only a slice of (Llama / Qwen2 and OPT names).
SHARDED_CHECKPOINT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj",
                      "fc1", "fc2", "embed_tokens", "lm_head")
PROMPTS = [[11, 12, 13, 14], [100, 200, 300], [5] * 20, list(range(40, 75))]
KV_BYTES = 8 << 20


@pytest.fixture
def rank_of(request):
    """Build a model as one rank of a group, without its peers (loading needs no collectives)."""

    def build(checkpoint, rank: int, tp: int = 1, pp: int = 1):
        config = GridserveConfig.from_kwargs(model=str(checkpoint), tensor_parallel_size=tp,
                                             pipeline_parallel_size=pp).finalize()
        set_parallel_state(ParallelState(RankLayout(rank, tp, pp)))
        return load_model(config, torch.device("cpu"))

    request.addfinalizer(lambda: set_parallel_state(ParallelState.single()))
    return build


def _sharded_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if any(s in n for s in SHARDED))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_each_tp_rank_holds_half_the_sharded_weights_and_reads_only_its_slices(arch, rank_of):
    from gridserve.demo.recipe import ensure_checkpoint

    checkpoint = ensure_checkpoint(arch, "tiny")
    whole = rank_of(checkpoint, 0)
    for rank in range(2):
        part = rank_of(checkpoint, rank, tp=2)
        assert _sharded_bytes(part) == pytest.approx(_sharded_bytes(whole) / 2, rel=0.01)
        assert parameter_bytes(part) < 0.55 * parameter_bytes(whole)
        # its KV cache holds only its heads
        assert [2 * a.num_kv_heads for a in part.attention_layers()] == [
            a.num_kv_heads for a in whole.attention_layers()]
        report = part.load_report
        sharded = [n for n in report.read if n.endswith(".weight") and any(s in n for s in SHARDED_CHECKPOINT)]
        assert len(sharded) >= 6 * 2 + 1
        assert report.max_fraction(sharded) <= 0.5, {n: report.fraction(n) for n in sharded}
        norms = [n for n in report.read if "norm" in n]
        assert norms and min(report.fraction(n) for n in norms) == 1.0  # replicated layers are read whole


def test_a_pipeline_stage_reads_only_its_own_layers(llama_tiny, rank_of):
    last = rank_of(llama_tiny, 1, pp=2)
    read = set(last.load_report.read)
    assert read and all(".layers.0." not in n for n in read) and "model.embed_tokens.weight" not in read
    assert {"lm_head.weight", "model.norm.weight"} <= read
    assert len(last.attention_layers()) == 1


def _generate(checkpoint, **kwargs) -> tuple[list, int]:
    """Greedy completions of PROMPTS and the number of preemptions it took."""
    llm = LLM(str(checkpoint), **({"kv_cache_memory_bytes": KV_BYTES} | kwargs))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return outputs, llm.stats().num_preemptions
    finally:
        llm.shutdown()


def _assert_close(ours, reference) -> None:
    """Same greedy tokens; where fp32 reduction order flips a near-tie, each side's token must be in
    the other's top-5 at the first difference (vLLM's check_logprobs_close), and the rest is skipped."""
    for a, b in zip(ours, reference):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert x in b.logprobs[i] and y in a.logprobs[i], (a.token_ids, b.token_ids)
                break


_REFERENCE: dict[str, list] = {}


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp", "pp", "extra"), [
    ("llama", 2, 1, {}), ("llama", 1, 2, {}), ("llama", 2, 2, {}), ("qwen2", 2, 1, {}), ("qwen2", 1, 2, {}),
    ("opt", 2, 1, {}),
    # chunked prefills flow through the pipeline while decodes wait for their samples
    ("llama", 1, 2, {"max_num_batched_tokens": 16}),
    # 8 blocks of 16 tokens for 4 requests that need 11: preemption and resume with batches in flight
    ("llama", 1, 2, {"kv_cache_memory_bytes": 8 * 4096, "max_model_len": 64}),
], ids=["llama-tp2", "llama-pp2", "llama-tp2-pp2", "qwen2-tp2", "qwen2-pp2", "opt-tp2", "llama-pp2-chunked",
        "llama-pp2-preempted"])
def test_parallel_layouts_give_the_single_worker_greedy_outputs(arch, tp, pp, extra):
    from gridserve.demo.recipe import ensure_checkpoint

    checkpoint = ensure_checkpoint(arch, "tiny")
    if arch not in _REFERENCE:
        _REFERENCE[arch] = _generate(checkpoint)[0]
    ours, preemptions = _generate(checkpoint, tensor_parallel_size=tp, pipeline_parallel_size=pp, **extra)
    assert preemptions > 0 or "max_model_len" not in extra
    _assert_close(ours, _REFERENCE[arch])
    assert sum(a.token_ids == b.token_ids for a, b in zip(ours, _REFERENCE[arch])) >= len(PROMPTS) - 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_killing_one_rank_of_a_tp_group_fails_in_flight_requests_within_5s(llama_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GRIDSERVE_FAILOVER_TIMEOUT_S", "0")  # unsupervised: no engine to continue on
    monkeypatch.setenv("GRIDSERVE_WORKER_RECOVERY_TIMEOUT", "0")  # fail-stop (recovery: test_worker_recovery.py)
    with deployment(llama_tiny, tmp_path, tensor_parallel_size=2) as services, \
            make_channel(address(services, "gateway")) as channel:
        assert "workers: N = DP x PP x TP = 1 x 1 x 2 = 2" in services.table()
        workers = [p for p in services.processes if p.role == "worker"]
        call = gateway_stub(channel).Generate(token_prompt([11, 12, 13], greedy(500, ignore_eos=True)),
                                               timeout=120)
        next(call)
        os.kill(workers[1].pid, signal.SIGKILL)  # not the output rank: the engine never waits on it
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert time.monotonic() - killed_at < 5
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "worker" in info.value.details()
        with make_channel(address(services, "engine")) as engine:
            assert health_status(engine) == health_pb2.HealthCheckResponse.ServingStatus.Name(
                health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + 10  # the surviving rank is told to exit, not left in a collective
        while _alive(workers[0].pid) and workers[0].process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers[0].process.poll() is not None


@pytest.mark.slow
def test_a_silent_rank_fails_its_group_after_the_collective_timeout(llama_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GRIDSERVE_DIST_TIMEOUT_S", "10")  # inherited by the worker processes
    monkeypatch.setenv("GRIDSERVE_FAILOVER_TIMEOUT_S", "0")  # unsupervised: no engine to continue on
    monkeypatch.setenv("GRIDSERVE_WORKER_RECOVERY_TIMEOUT", "0")  # fail-stop (recovery: test_worker_recovery.py)
    with deployment(llama_tiny, tmp_path, tensor_parallel_size=2) as services, \
            make_channel(address(services, "gateway")) as channel:
        workers = [p for p in services.processes if p.role == "worker"]
        call = gateway_stub(channel).Generate(token_prompt([11, 12, 13], greedy(500, ignore_eos=True)),
                                               timeout=120)
        next(call)
        os.kill(workers[1].pid, signal.SIGSTOP)  # alive but silent: rank 0 waits in an all-reduce
        stopped_at = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert time.monotonic() - stopped_at < 25
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            os.kill(workers[1].pid, signal.SIGCONT)
