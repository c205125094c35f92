"""Shared pytest setup: offline Hugging Face libraries and the recipe's tiny checkpoints.

The ``*_tiny`` fixtures return folders built by :mod:`gridserve.demo.recipe` in the default model cache
(``$GRIDSERVE_MODEL_CACHE`` or ``~/.cache/gridserve/models``), so they are built once and reused
by later runs (and by CI when that folder is cached).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the hub: set before anything imports huggingface_hub / transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton kernels run in the CPU interpreter; it must be chosen before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The protobuf / gRPC code is generated, never committed: build it if a checkout lacks it.
from gridserve.protos_build import ensure_generated  # noqa: E402

ensure_generated()

try:
    import torch
except ImportError:  # the gateway / engine roles run without torch
    pass
else:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def llama_tiny() -> Path:
    from gridserve.demo.recipe import ensure_checkpoint

    return ensure_checkpoint("llama", "tiny")


@pytest.fixture(scope="session")
def opt_tiny() -> Path:
    from gridserve.demo.recipe import ensure_checkpoint

    return ensure_checkpoint("opt", "tiny")


@pytest.fixture(scope="session")
def qwen2_tiny() -> Path:
    from gridserve.demo.recipe import ensure_checkpoint

    return ensure_checkpoint("qwen2", "tiny")


@pytest.fixture(scope="session")
def mistral_tiny() -> Path:
    from gridserve.demo.recipe import ensure_checkpoint

    return ensure_checkpoint("mistral", "tiny")


@pytest.fixture(scope="session")
def mixtral_tiny() -> Path:
    from gridserve.demo.recipe import ensure_checkpoint

    return ensure_checkpoint("mixtral", "tiny")


@pytest.fixture(scope="session")
def llava_tiny() -> Path:
    from gridserve.demo.recipe import ensure_checkpoint

    return ensure_checkpoint("llava", "tiny")
