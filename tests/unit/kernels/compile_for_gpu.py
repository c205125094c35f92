"""Compile every Triton kernel for an NVIDIA GPU on a machine without one (a CPU-only CI check).

The real wrappers run on CPU tensors while each kernel launch is recorded instead of executed;
each recorded launch (argument types, constexprs, ``num_warps``) is then compiled to a cubin by
Triton's own compiler and the ptxas it ships. This catches what the interpreter cannot: code the
GPU compiler rejects (non-constexpr globals, loop-carried type changes, bad dot shapes).

    python tests/unit/kernels/compile_for_gpu.py [--arch 90]

Must run without ``TRITON_INTERPRET`` (the interpreter replaces the compiled kernels). Prints one
line per kernel with its registers and spill stack when ``cuobjdump`` is available.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gridserve.kernels import triton_ops
from gridserve.kernels.triton_ops import activation, attention, cache, lora, mla, moe, norm, rotary

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.int32: "i32", torch.int64: "i64",
         torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
MODULES = (activation, attention, cache, lora, mla, moe, norm, rotary)
Launch = tuple[triton.runtime.jit.JITFunction, tuple, dict]


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **meta)`` records the launch."""

    def __init__(self, fn, launches: list[Launch]) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **meta: self.launches.append((self.fn, args, meta))


def record_launches() -> list[Launch]:
    """Run every wrapper on small CPU tensors, as it would on an H100-class GPU, and record launches."""
    launches: list[Launch] = []
    for module in MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, _Recorder(obj, launches))
    attention.compute_in_fp32 = lambda *ts: any(t.dtype == torch.float32 for t in ts)
    attention.num_sms = lambda device: 132
    mla.compute_in_fp32 = attention.compute_in_fp32
    moe.compute_in_fp32 = attention.compute_in_fp32
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _run_wrappers(dtype)
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):  # kv_cache_dtype
        _run_wrappers(torch.float32, cache_dtype, norms=False)
    for cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        _run_wrappers(torch.float16, cache_dtype, norms=False)
    return launches


def _run_wrappers(dtype: torch.dtype, cache_dtype: torch.dtype | None = None, norms: bool = True) -> None:
    if norms:  # multi-LoRA shrink / expand: a decode batch and a prefill, a small and a large rank
        for tokens, rank in ((4, 8), (300, 64)):
            slots = torch.zeros(tokens, dtype=torch.int64)
            lora.add_lora_triton(torch.zeros(tokens, 96, dtype=dtype), torch.zeros(tokens, 64, dtype=dtype),
                                 torch.zeros(2, rank, 64, dtype=dtype), torch.zeros(2, 96, rank, dtype=dtype), slots)
    if norms:  # the fused-MoE grouped GEMM: decode (16-row tiles) and prefill (64-row), bias off / on
        for rows, bias in ((4, None), (300, torch.zeros(8, 512, dtype=dtype))):
            counts = torch.zeros(8, dtype=torch.int64)
            counts[0] = rows
            moe.moe_grouped_gemm(torch.zeros(rows, 256, dtype=dtype), torch.zeros(8, 512, 256, dtype=dtype),
                                 counts, bias)
    for head_size, heads, kv_heads in ((128, 32, 8), (64, 12, 2)):
        kv = torch.zeros(2, 8, 16, kv_heads, head_size, dtype=cache_dtype or dtype)
        table = torch.zeros(2, 64, dtype=torch.int32)
        seq_lens = torch.tensor([5, 900], dtype=torch.int32)
        for q_lens in ((1, 1), (3, 7)):  # decode (split-K), then prefill
            loc = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
            q = torch.zeros(sum(q_lens), heads, head_size, dtype=dtype)
            triton_ops.paged_attention(q, kv, loc, seq_lens, table, 0.1, max(q_lens))
            for mods in ({"sliding_window": 64},  # the window alone, then every modifier
                         {"sliding_window": 64, "soft_cap": 30.0, "alibi_slopes": torch.zeros(heads)}):
                triton_ops.paged_attention(q, kv, loc, seq_lens, table, 0.1, max(q_lens), **mods)
            triton_ops.paged_attention(q, kv, loc, seq_lens, table, 0.1, max(q_lens), sliding_window=64,
                                       sinks=torch.zeros(heads))  # gpt-oss's attention sinks
        mla_q = torch.zeros(2, 16, 576, dtype=dtype)  # DeepSeek's 512 + 64, after absorption
        triton_ops.mla_decode(mla_q, torch.zeros(8, 16, 576, dtype=cache_dtype or dtype),
                              torch.tensor([0, 2], dtype=torch.int32), seq_lens[:1], table[:1], 0.1, 512)
        triton_ops.reshape_and_cache(q[:, :kv_heads], q[:, :kv_heads], kv, torch.arange(q.shape[0]))
        if norms:
            triton_ops.rotary_embedding(
                torch.arange(q.shape[0]), q, q[:, :kv_heads], torch.zeros(8, head_size // 2), False
            )
    if not norms:
        return
    x = torch.zeros(4, 4096, dtype=dtype)
    triton_ops.rms_norm(x, x[0], 1e-6)
    triton_ops.fused_add_rms_norm(x, x, x[0], 1e-6)
    triton_ops.silu_and_mul(x)
    for approximate in ("none", "tanh"):
        triton_ops.gelu_and_mul(x, approximate)
        triton_ops.gelu(x, approximate)


def compile_launch(launch: Launch, arch: int):
    """Compile one recorded launch for ``sm_<arch>`` and return Triton's compiled kernel."""
    fn, args, meta = launch
    meta = dict(meta)
    num_warps = meta.pop("num_warps", 4)
    signature: dict[str, str] = {}
    for name, value in zip(fn.arg_names, args, strict=False):  # constexprs come as meta
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    signature.update({name: "constexpr" for name in meta})
    target = GPUTarget("cuda", arch, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": num_warps})
    return triton.compile(ASTSource(fn, signature, meta), target=target, options=options.__dict__)


def resource_usage(kernel) -> str:
    """``REG:.. STACK:..`` from cuobjdump (shipped with Triton), or '' when it is missing."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    fields = [line.split() for line in out.splitlines() if "REG:" in line]
    return " ".join(fields[0][:2]) if fields else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels this compiles")
    for launch in record_launches():
        fn, call_args, meta = launch
        kernel = compile_launch(launch, args.arch)
        dtypes = sorted({TYPES[a.dtype] for a in call_args if isinstance(a, torch.Tensor)})
        shape = {k: v for k, v in meta.items()
                 if k in ("BLOCK_M", "TILE_N", "NUM_SPLITS", "HEAD_SIZE", "WINDOW", "SOFT_CAP", "ALIBI", "TANH",
                          "HAS_BIAS")}
        print(f"sm_{args.arch} {fn.__name__} {','.join(dtypes)} {shape} {resource_usage(kernel)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
