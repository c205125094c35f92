"""The Triton kernels compile for an NVIDIA GPU (sm_90) on a machine without one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Only locate triton here: importing it in this process before test_triton_kernels.py sets
# TRITON_INTERPRET=1 would bind triton.language to the compiler and break the interpreter tests.
TRITON = importlib.util.find_spec("triton")


@pytest.mark.slow
@pytest.mark.skipif(TRITON is None, reason="triton is not installed")
def test_every_kernel_compiles_for_sm90():
    if not (Path(TRITON.origin).parent / "backends" / "nvidia").is_dir():
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
