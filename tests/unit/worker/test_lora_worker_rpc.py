"""The worker's LoRA methods over its gRPC servicer: ``add_lora`` reads an adapter, ``list_loras``
answers the ids held (least recently used first), ``remove_lora`` forgets one; a bad adapter comes
back as a typed error naming the field, and a worker without ``enable_lora`` refuses them."""

from __future__ import annotations

import functools

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from gridserve.api.worker.v1 import worker_pb2
from gridserve.services.worker.servicer import WorkerServicer
from gridserve.services.worker.worker import Worker
from gridserve.shared.config import GridserveConfig
from gridserve.shared.lora import LoRARequest
from gridserve.shared.rpc.convert import lora_request_to_pb
from tests.zoo import zoo_checkpoint

_BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512, "tie_word_embeddings": False}


@functools.cache
def _checkpoint() -> str:
    return str(zoo_checkpoint("lora-llama", "LlamaConfig", **_BASE))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("lora") / "adapter"
    model = AutoModelForCausalLM.from_pretrained(_checkpoint(), dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(folder)
    return str(folder)


def _servicer(**lora) -> WorkerServicer:
    config = GridserveConfig.from_kwargs(model=_checkpoint(), device="cpu", **lora).finalize()
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    servicer = WorkerServicer(on_ready=lambda ready: None)
    servicer.worker = worker
    return servicer


def _call(servicer: WorkerServicer, **method) -> worker_pb2.CollectiveRPCResponse:
    return servicer._call(worker_pb2.CollectiveRPCRequest(call_id=1, **method))


def _add(servicer: WorkerServicer, lora_id: int, path: str) -> worker_pb2.CollectiveRPCResponse:
    request = lora_request_to_pb(LoRARequest(f"a{lora_id}", lora_id, path))
    return _call(servicer, add_lora=worker_pb2.AddLoraArgs(lora_request=request))


def _ids(servicer: WorkerServicer) -> list[int]:
    return list(_call(servicer, list_loras=worker_pb2.ListLorasArgs()).lora_ids.ids)


def test_add_list_remove_over_the_servicer(adapter, tmp_path):
    servicer = _servicer(enable_lora=True, max_loras=1, max_cpu_loras=2)
    assert _ids(servicer) == []
    assert not _add(servicer, 3, adapter).HasField("error")
    assert not _add(servicer, 4, adapter).HasField("error")
    assert _ids(servicer) == [3, 4]
    bad = _add(servicer, 5, str(tmp_path / "nowhere"))
    assert bad.error.type == "InvalidArgumentError" and bad.error.message.startswith("lora_path:")
    assert _ids(servicer) == [3, 4]
    assert not _call(servicer, remove_lora=worker_pb2.RemoveLoraArgs(lora_int_id=3)).HasField("error")
    assert _ids(servicer) == [4]


def test_a_worker_without_enable_lora_refuses(adapter):
    servicer = _servicer()
    assert servicer.worker.runner.lora is None
    assert all(getattr(m, "lora", None) is None for m in servicer.worker.runner.model.modules())
    assert _add(servicer, 1, adapter).error.type == "InvalidArgumentError"
