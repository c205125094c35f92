"""Worker extensions over CollectiveRpc, and sleep / wake-up by tag, on real processes.

The RLHF weight-sync loop: put the engine to sleep (level 1), wake the weights, send new weights
(typed tensors over gRPC) to ``WeightSyncExtension.update_weights`` on the worker, wake the KV
cache, and check generation matches transformers on the new weights.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from gridserve import LLM, SamplingParams
from gridserve.api.engine.v1 import engine_pb2
from gridserve.services.worker.extension import to_wire
from gridserve.shared.rpc.client import health_status, make_channel
from gridserve.shared.rpc.values import decode, encode

from .hf_reference import hf_greedy
from .services import (
    ENGINE_ARGS,
    KV_BYTES,
    address,
    deployment,
    engine_stub,
    gateway_stub,
    greedy,
    stream_tokens,
    token_prompt,
)

pytestmark = pytest.mark.slow

EXTENSION = "gridserve.services.worker.weight_sync:WeightSyncExtension"
PROMPT = [5, 17, 42, 99, 3, 250, 7]
TOKENS = 10


@pytest.fixture(scope="module")
def new_weights(llama_tiny, tmp_path_factory):
    """A trainer's next weights (every matrix perturbed), saved as a checkpoint for the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_tiny), dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(1 + 0.5 * torch.randn(param.shape, generator=generator))
    folder = tmp_path_factory.mktemp("updated")
    model.save_pretrained(folder, safe_serialization=True)
    for item in llama_tiny.iterdir():
        if "token" in item.name:
            (folder / item.name).symlink_to(item)
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return folder, weights


@pytest.fixture(scope="module")
def services(llama_tiny, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    with deployment(llama_tiny, log_dir, engine_args=ENGINE_ARGS + ["--worker-extension-cls", EXTENSION]) as launcher:
        yield launcher


def test_weight_sync_while_asleep_then_generation_matches_transformers(services, llama_tiny, new_weights):
    folder, weights = new_weights
    expected = hf_greedy(str(folder), PROMPT, TOKENS)
    assert expected != hf_greedy(str(llama_tiny), PROMPT, TOKENS)  # the update must show
    with make_channel(address(services, "engine")) as ec, make_channel(address(services, "gateway")) as gc:
        engine, gateway = engine_stub(ec), gateway_stub(gc)
        before = stream_tokens(gateway, token_prompt(PROMPT, greedy(TOKENS)))[0]
        slept = engine.Sleep(engine_pb2.SleepRequest(level=1), timeout=60)
        assert list(slept.sleeping_tags) == ["kv_cache", "weights"]
        assert len(slept.worker_memory) == 1 and "rss_before" in slept.worker_memory[0]
        assert health_status(ec) == "NOT_SERVING"
        woken = engine.WakeUp(engine_pb2.WakeUpRequest(tags=["weights"]), timeout=60)
        assert list(woken.sleeping_tags) == ["kv_cache"]
        assert health_status(ec) == "NOT_SERVING"  # no KV cache yet: no requests
        with pytest.raises(grpc.RpcError) as asleep:
            stream_tokens(gateway, token_prompt(PROMPT, greedy(TOKENS)))
        assert asleep.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        update = engine_pb2.CollectiveRpcRequest(method="update_weights", args=[encode(to_wire(weights))],
                                                 timeout_s=60)
        loaded = [decode(v) for v in engine.CollectiveRpc(update, timeout=120).results]
        names = engine.CollectiveRpc(engine_pb2.CollectiveRpcRequest(method="weight_names", unique_reply_rank=0),
                                     timeout=30).results
        assert len(names) == 1 and loaded == [len(decode(names[0]))]

        woken = engine.WakeUp(engine_pb2.WakeUpRequest(tags=["kv_cache"]), timeout=60)
        assert list(woken.sleeping_tags) == [] and health_status(ec) == "SERVING"
        after = stream_tokens(gateway, token_prompt(PROMPT, greedy(TOKENS)))[0]
    assert before == hf_greedy(str(llama_tiny), PROMPT, TOKENS)
    assert after == expected


@pytest.mark.parametrize("method", ["no_such_method", "execute_model", "_private"])
def test_collective_rpc_to_a_method_outside_the_extension_is_permission_denied(services, method):
    with make_channel(address(services, "engine")) as ec:
        with pytest.raises(grpc.RpcError) as info:
            engine_stub(ec).CollectiveRpc(engine_pb2.CollectiveRpcRequest(method=method), timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert method in info.value.details()


def test_collective_rpc_with_a_bad_rank_or_tensor_is_invalid_argument_naming_the_field(services):
    from gridserve.api.common.v1 import common_pb2

    bad_tensor = common_pb2.RpcValue(tensor=common_pb2.Tensor(data=b"abc", dtype=common_pb2.DTYPE_FLOAT32, shape=[2]))
    with make_channel(address(services, "engine")) as ec:
        engine = engine_stub(ec)
        for request, field in (
            (engine_pb2.CollectiveRpcRequest(method="weight_names", unique_reply_rank=3), "unique_reply_rank"),
            (engine_pb2.CollectiveRpcRequest(method="update_weights", args=[bad_tensor]), "tensor.data"),
            (engine_pb2.CollectiveRpcRequest(method="weight_names", timeout_s=-1), "timeout_s"),
            (engine_pb2.CollectiveRpcRequest(method="not a name"), "method"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                engine.CollectiveRpc(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in info.value.details()


def test_llm_collective_rpc_updates_weights_in_process(llama_tiny, new_weights):
    folder, weights = new_weights
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu", worker_extension_cls=EXTENSION)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS)
        llm.sleep(level=1)
        llm.wake_up(["weights"])
        assert llm.sleeping_tags == ["kv_cache"]
        loaded = llm.collective_rpc("update_weights", args=(weights,))
        assert loaded == [len(llm.collective_rpc("weight_names", unique_reply_rank=0))]
        llm.wake_up(["kv_cache"])
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(out[0].outputs[0].token_ids) == hf_greedy(str(folder), PROMPT, TOKENS)


def test_weight_sync_in_chunks_reaches_every_tensor_parallel_shard(llama_tiny, new_weights):
    folder, weights = new_weights
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, device="cpu", tensor_parallel_size=2,
              worker_extension_cls=EXTENSION)
    try:
        llm.sleep(level=1)
        llm.wake_up(["weights"])
        names = sorted(weights)
        half = len(names) // 2
        for chunk in (names[:half], names[half:]):  # a trainer sends big models in several messages
            per_rank = llm.collective_rpc("update_weights", args=({n: weights[n] for n in chunk},))
            assert len(per_rank) == 2 and all(n > 0 for n in per_rank)  # both shards took their part
        llm.wake_up(["kv_cache"])
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS)
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(out[0].outputs[0].token_ids) == hf_greedy(str(folder), PROMPT, TOKENS)
