"""The Triton kernels compile for an NVIDIA GPU (sm_90) on a machine without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    if not (Path(triton.__file__).parent / "backends" / "nvidia").is_dir():
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    script = Path(__file__).with_name("compile_for_gpu.py")
    result = subprocess.run(
        [sys.executable, str(script), "--arch", "90"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for kernel in ("_paged_attention_kernel", "_reduce_splits_kernel", "_rotary_kernel"):
        assert kernel in result.stdout
