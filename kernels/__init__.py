"""gridserve's kernels: Triton on CUDA, C++ (``cpu_ops``) or torch reference code on CPU, chosen per call.

Models call the functions exported here and never choose an implementation themselves; paged
attention is an ``AttentionBackend`` (reference, C++ CPU or Triton) that ``select_attention_backend`` picks.
``GRIDSERVE_KERNELS=reference`` forces the torch code; ``GRIDSERVE_KERNELS=triton`` forces Triton
(on CPU that needs ``TRITON_INTERPRET=1``, for tests); ``GRIDSERVE_KERNELS=cpu`` requires the C++
kernels to build instead of falling back.
"""

from __future__ import annotations

import sys

_installed = None
if __name__ == "kernels":
    # This folder is ``gridserve.kernels``. It is importable as a top-level ``kernels`` only when a
    # process runs with the checkout's root on sys.path (``python -m`` or pytest from the root),
    # where it would shadow the distribution that owns that name (Hugging Face's ``kernels``, which
    # transformers imports): that one takes this module's place when installed (kernels/_top_level.py).
    from gridserve.kernels._top_level import installed_kernels

    _installed = installed_kernels(__file__)
if _installed is not None:
    sys.modules["kernels"] = _installed
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
