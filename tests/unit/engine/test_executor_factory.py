"""Which executor the engine builds itself, and which one the code assembling both roles hands it."""

from __future__ import annotations

import pytest

from gridserve.services.engine.executor import Executor
from gridserve.services.engine.executor.grpc_executor import GrpcExecutor
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError


def test_the_engine_builds_the_grpc_executor_itself():
    config = GridserveConfig()
    config.parallel.executor_backend = "grpc"
    assert Executor.get_class(config) is GrpcExecutor


def test_the_engine_refuses_to_build_an_in_process_worker_itself():
    config = GridserveConfig()
    config.parallel.executor_backend = "uni"
    with pytest.raises(ConfigError, match="in_process_executor") as info:
        Executor.get_class(config)
    assert info.value.field == "parallel.executor_backend"


def test_only_the_uni_backend_gets_an_in_process_executor_from_llm_engine():
    from gridserve.llm_engine import in_process_executor

    config = GridserveConfig()
    config.parallel.executor_backend = "grpc"
    assert in_process_executor(config) is None
