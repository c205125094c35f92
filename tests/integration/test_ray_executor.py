"""The Ray executor: workers placed as Ray actors (one placement group per engine), each running
the worker service; skipped without ``ray`` (an optional extra)."""

from __future__ import annotations

import os

import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.errors import EngineDeadError

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

KV_BYTES = 32 << 20
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 3]}, {"prompt_token_ids": [250, 7, 1000, 33, 8, 19]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)


@pytest.fixture(scope="module")
def local_ray():
    options = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False,
               "runtime_env": {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}}
    try:
        ray.init(**options)
    except Exception as exc:  # Ray gives its raylet a fixed 30 s to register: once more on a slow machine
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        ray.init(**options)
    # Ray's workers listen on the node's address: plaintext there only when the operator says so.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRIDSERVE_INSECURE_INTERNAL", "1")
        yield
    ray.shutdown()


def test_the_ray_executor_refuses_plaintext_workers_without_insecure_internal(monkeypatch, llama_tiny):
    from gridserve.shared.errors import ConfigError

    monkeypatch.delenv("GRIDSERVE_INSECURE_INTERNAL", raising=False)
    with pytest.raises(ConfigError, match="--insecure-internal"):
        LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu", tensor_parallel_size=2,
            distributed_executor_backend="ray")


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_tp2_through_ray_matches_tp1_and_a_killed_actor_is_a_worker_death_the_group_recovers_from(
        local_ray, llama_tiny):
    single = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu")
    try:
        expected = _greedy(single)
    finally:
        single.shutdown()
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu", tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        executor = llm.llm_engine.core.executor
        assert type(executor).__name__ == "RayExecutor" and len(executor.actors) == 2
        table = ray.util.placement_group_table(executor.placement_group)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        assert _greedy(llm) == expected
        old_addresses = list(executor.config.parallel.worker_addresses)
        ray.kill(executor.actors[1])  # its worker process dies with it
        with pytest.raises(EngineDeadError):  # the offline LLM has no recovery loop: the step fails
            _greedy(llm)
        # What the serving engine's recovery does next (EngineLoop._recover): requeue, rebuild.
        core = llm.llm_engine.core
        core.requeue_after_worker_loss()
        core.reinitialize_workers(120.0)
        assert len(executor.actors) == 2 and executor.config.parallel.worker_addresses != old_addresses
        assert executor.healthy
        assert _greedy(llm) == expected
    finally:
        llm.shutdown()


def test_serve_with_the_ray_backend_starts_no_worker_processes_of_its_own(local_ray, llama_tiny, tmp_path,
                                                                          monkeypatch):
    from gridserve.shared.rpc.client import make_channel

    from .hf_reference import hf_greedy
    from .services import (
        ENGINE_ARGS,
        address,
        deployment,
        gateway_stub,
        greedy,
        stream_tokens,
        token_prompt,
    )

    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)  # the engine joins this Ray
    args = ENGINE_ARGS + ["--distributed-executor-backend", "ray", "--device", "cpu"]
    with deployment(llama_tiny, tmp_path, engine_args=args, tensor_parallel_size=2) as services:
        assert not [p for p in services.processes if p.role == "worker"]
        with make_channel(address(services, "gateway")) as channel:
            prompt = PROMPTS[0]["prompt_token_ids"]
            tokens, _, _ = stream_tokens(gateway_stub(channel), token_prompt(prompt, greedy(10)))
    assert tokens == hf_greedy(str(llama_tiny), prompt, 10)
