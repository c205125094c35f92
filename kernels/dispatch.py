"""Picks an implementation per call: Triton for CUDA tensors, the C++ kernels (``cpu_ops``) for CPU
tensors where one exists and builds, the torch reference otherwise.

``GRIDSERVE_KERNELS``: ``auto`` (default), ``reference`` (always torch), ``triton`` (always Triton),
``cpu`` (as ``auto``, but a CPU op with a C++ kernel raises instead of falling back when it
cannot be built).

Paged attention (the KV-cache write and attention over it) is one ``AttentionBackend`` per call,
picked by the same rules in ``attention_backend.select_attention_backend``; this module keeps the
per-token ops.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from gridserve.kernels import reference
from gridserve.shared import envs

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _triton_ops():
    """The Triton implementations, or None when Triton (or its kernels) cannot be imported."""
    try:
        from gridserve.kernels import triton_ops
    except ImportError as exc:
        logger.info("Triton kernels unavailable (%s); using torch reference kernels", exc)
        return None
    return triton_ops


def _cpu_kernel(name: str, mode: str):
    """The C++ kernel for ``name``, built on first use, or None for an op without one."""
    from gridserve.kernels import cpu_ops

    if name not in cpu_ops.KERNELS:
        return None
    if cpu_ops.loader(name)() is None:
        if mode == "cpu":
            raise RuntimeError(f"GRIDSERVE_KERNELS=cpu but the C++ kernel for {name!r} did not build")
        return None
    return getattr(cpu_ops, name)


# Ops that touch only O(tokens x hidden) elements: on CPU they run on one thread. Each is a few
# elementwise passes, and each pass on several threads is an OpenMP region that waits for its
# slowest thread: on a machine whose cores other processes share (the engine, gateway and Envoy
# beside the worker), a thread that is descheduled holds the region for a time slice. Measured in
# engine runs at batch 64, alternating steps, load ~7 on 2 cores: 5.5 s per step with these ops on
# 2 threads against 1.55 s on one in one run, 825 against 826 ms in another (a different mix of
# other processes). Results are the same bits (the reductions split over rows, not within one).
SERIAL_CPU_OPS = frozenset({"rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                            "gelu_and_mul", "gelu", "reshape_and_cache"})
# e.g. SiLU-and-mul of 256 tokens x 2 x 2,048; GRIDSERVE_SERIAL_MAX_ELEMENTS=0 turns this off
SERIAL_MAX_ELEMENTS = envs.GRIDSERVE_SERIAL_MAX_ELEMENTS  # read once, at import


@contextlib.contextmanager
def one_thread():
    """Run the block's torch CPU ops on one thread (small ops: see ``SERIAL_CPU_OPS``)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _one_thread(fn):
    @functools.wraps(fn)
    def serial(*args, **kwargs):
        with one_thread():
            return fn(*args, **kwargs)
    return serial


def _serial_impl(name: str, tensor: torch.Tensor):
    """``_impl``'s choice, on one thread for CPU tensors (``SERIAL_CPU_OPS``) of up to
    ``SERIAL_MAX_ELEMENTS`` (a decode step's; a long prefill chunk keeps every thread)."""
    fn = _impl(name, tensor)
    if tensor.device.type == "cpu" and name in SERIAL_CPU_OPS and tensor.numel() <= SERIAL_MAX_ELEMENTS:
        return _one_thread(fn)
    return fn


def _impl(name: str, tensor: torch.Tensor):
    mode = envs.GRIDSERVE_KERNELS
    if mode != "reference" and (tensor.is_cuda or mode == "triton"):
        ops = _triton_ops()
        fn = getattr(ops, name, None) if ops is not None else None
        if fn is not None:
            return fn
        if mode == "triton":
            raise RuntimeError(f"GRIDSERVE_KERNELS=triton but no Triton kernel for {name!r}")
    if mode in ("auto", "cpu") and tensor.device.type == "cpu":
        fn = _cpu_kernel(name, mode)
        if fn is not None:
            return fn
    return getattr(reference, name)


def prepare(device: torch.device) -> None:
    """Build (or load from the cache) what this device's kernels need now, not on the first request:
    the C++ CPU kernels take seconds to compile on a machine that has not built them yet."""
    mode = envs.GRIDSERVE_KERNELS
    if device.type == "cpu" and mode in ("auto", "cpu"):
        for name in ("paged_attention", "rms_norm"):  # rms_norm: the layer-ops library
            _cpu_kernel(name, mode)


def rms_norm(x, weight, eps):
    return _serial_impl("rms_norm", x)(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return _serial_impl("fused_add_rms_norm", x)(x, residual, weight, eps)


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox=True):
    return _serial_impl("rotary_embedding", query)(positions, query, key, cos_sin_cache, is_neox)


def silu_and_mul(x):
    return _serial_impl("silu_and_mul", x)(x)


def gelu_and_mul(x, approximate="none"):
    return _serial_impl("gelu_and_mul", x)(x, approximate)


def gelu(x, approximate="none"):
    return _serial_impl("gelu", x)(x, approximate)
