"""The worker extension mixed into ``Worker``: which methods are callable, and tensors on the wire."""

from __future__ import annotations

import pytest
import torch

from gridserve.services.worker.extension import call_extension, to_torch, to_wire, worker_class
from gridserve.services.worker.worker import Worker
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError, PermissionDeniedError
from gridserve.shared.rpc.values import TensorData, decode, encode


class Doubler:
    def double(self, tensor, factor=2):
        return {"out": tensor * factor, "rank": self.rank}

    def _hidden(self):
        return "secret"


class Clashing:
    def execute_model(self, plan):
        return None


def _config(target: str) -> GridserveConfig:
    return GridserveConfig.from_kwargs(worker_extension_cls=target)


def test_extension_public_methods_are_callable_with_tensors_round_tripping():
    cls = worker_class(_config(f"{__name__}:Doubler"))
    assert issubclass(cls, Worker) and issubclass(cls, Doubler)
    worker = cls(_config(f"{__name__}:Doubler"), rank=1)
    tensor = torch.tensor([[1.0, -2.0], [0.5, 4.0]], dtype=torch.bfloat16)
    wire_args = decode(encode(to_wire([tensor])))  # what the worker receives over gRPC
    result = decode(encode(call_extension(worker, "double", wire_args, {"factor": 3})))
    assert result["rank"] == 1 and isinstance(result["out"], TensorData)
    assert torch.equal(to_torch(result["out"]), tensor * 3)


@pytest.mark.parametrize("method", ["_hidden", "execute_model", "missing"])
def test_anything_but_an_extension_method_is_permission_denied(method):
    worker = worker_class(_config(f"{__name__}:Doubler"))(_config(f"{__name__}:Doubler"))
    with pytest.raises(PermissionDeniedError, match=method):
        call_extension(worker, method, [], {})


def test_without_an_extension_every_call_is_permission_denied():
    with pytest.raises(PermissionDeniedError, match="no extension"):
        call_extension(Worker(GridserveConfig()), "double", [], {})
    with pytest.raises(PermissionDeniedError, match="no extension"):
        Worker(GridserveConfig()).call_extension("double", [], {})  # the in-process executor's path


def test_the_worker_method_calls_the_extension():
    worker = worker_class(_config(f"{__name__}:Doubler"))(_config(f"{__name__}:Doubler"), rank=2)
    assert worker.call_extension("double", [torch.ones(2)], {})["rank"] == 2
    with pytest.raises(PermissionDeniedError, match="_hidden"):
        worker.call_extension("_hidden", [], {})


@pytest.mark.parametrize(("target", "message"), [
    (f"{__name__}:Clashing", "execute_model"),
    ("no_such_module_xyz:Cls", "cannot import"),
    ("not a target", "package.module:Class"),
])
def test_bad_extension_classes_name_the_field(target, message):
    with pytest.raises(ConfigError, match=message) as info:
        worker_class(_config(target))
    assert info.value.field == "parallel.worker_extension_cls"
