"""A C++ kernel build killed mid-way (its torch ``lock`` file left behind) does not hang the next one."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from gridserve.kernels import cpu_ops
from tests.missing_tool import missing

SOURCE = """#include <torch/library.h>
TORCH_LIBRARY(gridserve_test_build_lock, m) {}
"""


@pytest.mark.slow  # one real compile of a tiny library (tens of seconds)
def test_a_lock_left_by_a_dead_builder_is_removed_and_the_build_completes(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "tiny.cpp"
    source.write_text(SOURCE)
    name = f"gridserve_test_lock_{hashlib.sha256(source.read_bytes()).hexdigest()[:10]}"
    build_dir = cpp_extension._get_build_directory(name, False)
    (tmp_path / "extensions").mkdir(exist_ok=True)
    stale = Path(build_dir) / "lock"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("")  # what a builder SIGKILLed inside torch's FileBaton leaves
    result: list[object] = []

    def build() -> None:
        try:
            result.append(cpu_ops.build_extension(source, "gridserve_test_lock"))
        except Exception as exc:  # no compiler here: reported below
            result.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(timeout=600)
    assert not thread.is_alive(), "the build waited on the dead builder's lock"
    if isinstance(result[0], Exception):
        missing(f"the C++ toolchain cannot build a torch extension here: {result[0]}")
    assert result == [False] and not stale.exists()  # compiled now, the stale lock gone
    assert cpu_ops.build_extension(source, "gridserve_test_lock") is True  # then served cached
