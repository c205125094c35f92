"""The gRPC contracts and role boundaries: buf lint, torch-free roles, fail-fast CLI, status codes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from gridserve.api.common.v1 import common_pb2
from gridserve.shared.errors import EngineDeadError, FailedPreconditionError, InvalidArgumentError
from gridserve.shared.rpc.errors import status_for
from gridserve.shared.rpc.tensors import pack, unpack
from tests.missing_tool import require

ROOT = Path(__file__).resolve().parents[3]


def _buf() -> str | None:
    found = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    return found if os.access(found, os.X_OK) else None


def test_protos_pass_buf_lint():
    require(_buf() is not None, "the buf binary is not installed (pip install buf-bin)")
    result = subprocess.run([_buf(), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gateway_engine_and_rpc_modules_do_not_import_torch():
    modules = [
        "gridserve.services.gateway.main", "gridserve.services.gateway.servicer",
        "gridserve.services.engine.main", "gridserve.services.engine.servicer",
        "gridserve.services.engine.executor.grpc_executor", "gridserve.shared.rpc.server",
        "gridserve.shared.rpc.worker_convert", "gridserve.launcher", "gridserve.cli",
    ]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("argv", "env_vars", "message"),
    [
        (["engine", "--model", "m"], {}, "--workers or set GRIDSERVE_WORKERS"),
        (["engine", "--workers", "127.0.0.1:1"], {}, "--model or set GRIDSERVE_MODEL"),
        (["gateway"], {}, "--engines or set GRIDSERVE_ENGINES"),
        (["gateway", "--engines", "nohost"], {}, "bad engine address 'nohost'"),
        (["gateway"], {"GRIDSERVE_ENGINES": "envhost"}, "bad engine address 'envhost'"),
        (["serve", "m", "-tp", "0"], {}, "parallel.tensor_parallel_size: must be a positive integer"),
        (["serve", "m", "--pipeline-parallel-size", "-1"], {}, "parallel.pipeline_parallel_size: must be"),
    ],
)
def test_role_without_required_settings_fails_fast_with_a_clear_message(argv, env_vars, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRIDSERVE_")} | env_vars
    result = subprocess.run([sys.executable, "-m", "gridserve.cli", *argv], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 2
    assert message in result.stderr


def test_typed_errors_map_to_status_codes():
    code, message = status_for(InvalidArgumentError("sampling_params.top_p", "must be in (0, 1]"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("sampling_params.top_p")
    assert status_for(EngineDeadError("worker died"))[0] == grpc.StatusCode.UNAVAILABLE
    assert status_for(FailedPreconditionError("sleeping"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(KeyError("x"))[0] == grpc.StatusCode.INTERNAL


def test_tensors_pack_to_raw_bytes_and_back():
    tensor = pack([1.5, -2.25, 3.0], common_pb2.DTYPE_FLOAT32)
    assert len(tensor.data) == 12 and list(tensor.shape) == [3]
    assert unpack(tensor) == [1.5, -2.25, 3.0]
    assert unpack(pack([2**40, -1], common_pb2.DTYPE_INT64)) == [2**40, -1]
