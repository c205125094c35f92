"""gridserve's kernels: Triton on CUDA, C++ (``cpu_ops``) or torch reference code on CPU, chosen per call.

Models call the functions exported here and never choose an implementation themselves; paged
attention is an ``AttentionBackend`` (reference, C++ CPU or Triton) that ``select_attention_backend`` picks.
``GRIDSERVE_KERNELS=reference`` forces the torch code; ``GRIDSERVE_KERNELS=triton`` forces Triton
(on CPU that needs ``TRITON_INTERPRET=1``, for tests); ``GRIDSERVE_KERNELS=cpu`` requires the C++
kernels to build instead of falling back.
"""

from __future__ import annotations

import sys

if __name__ == "kernels":
    # This folder is ``gridserve.kernels``. It is importable as a top-level ``kernels`` only when a
    # process runs with the checkout's root on sys.path (``python -m`` or pytest from the root),
    # where it would shadow the distribution that owns that name (Hugging Face's ``kernels``, which
    # transformers imports): load that one in this module's place, or fail as a missing module would
    # (tests/unit/kernels/test_top_level_name.py).
    from gridserve.kernels._top_level import load_real_kernels

    sys.modules["kernels"] = load_real_kernels(__file__)
else:
    from gridserve.kernels.attention_backend import (
        AttentionBackend,
        AttentionMetadata,
        select_attention_backend,
    )
    from gridserve.kernels.dispatch import (
        fused_add_rms_norm,
        gelu,
        gelu_and_mul,
        rms_norm,
        rotary_embedding,
        silu_and_mul,
    )

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "select_attention_backend",
    "fused_add_rms_norm",
    "gelu",
    "gelu_and_mul",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
