"""Micro-benchmark of the int8-weight CPU GEMM against fp32 ``F.linear`` and the torch int8 paths.

    gridserve bench int8-gemm                      # llama-base shapes, M 1..256
    gridserve bench int8-gemm --rows 64 --repeats 9 --threads 1

Per (M, N, K): median (or with ``--best`` fastest) milliseconds of fp32 ``F.linear``, the C++ kernel
with int16 activations per row ("int16") and with int8 activations per 32 columns ("group32"),
the int16 mode's digit planes through oneDNN's int8 matmul ("onednn": AMX where the CPU has it),
activation quantization included, and ``torch._int_mm`` with one int8 row per activation and with
two (the torch fallback of ``Int8Weight``); and both kernel modes' speed-up over fp32.
The calls are interleaved round by round so that load on a shared machine hits them alike.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import TYPE_CHECKING

from gridserve.benchmarks import harness

if TYPE_CHECKING:  # torch is imported where it is used: `gridserve bench` lists this without it
    import torch

# llama-base (hidden 768, MLP 2048, vocab 32000): fused QKV, o_proj, fused gate/up, down, LM head.
SHAPES = [(2304, 768), (768, 768), (4096, 768), (768, 2048), (32000, 768)]


def _int8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    scales = (rows.abs().amax(dim=1, keepdim=True) / 127.0).clamp_(min=1e-12)
    return torch.round(rows / scales).to(torch.int8), scales


def _int_mm(x: torch.Tensor, wt: torch.Tensor, sw: torch.Tensor, rows: int) -> torch.Tensor:
    import torch

    high, hs = _int8_rows(x)
    if rows == 1:
        return torch._int_mm(high, wt).float() * hs * sw
    low, ls = _int8_rows(x - high.float() * hs)
    n = x.shape[0]
    acc = torch._int_mm(torch.cat((high, low)), wt)
    return (acc[:n].float() * hs + acc[n:].float() * ls) * sw


def bench(rows: list[int], shapes: list[tuple[int, int]], repeats: int, best: bool = False,
          isa_cap: int = 2, torch_int_mm: bool = True) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from gridserve.kernels.cpu_ops import int8_gemm

    gen = torch.Generator().manual_seed(0)
    results = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        sw = w.abs().amax(1) / 127
        q = torch.round(w / sw[:, None]).to(torch.int8)
        packed, wt = int8_gemm.pack(q), q.t()
        onednn = int8_gemm.onednn_pack(q) if hasattr(torch.ops.onednn, "qlinear_pointwise") else None
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            calls = {
                "fp32": functools.partial(F.linear, x, w),
                "int16": functools.partial(int8_gemm.gemm, x, packed, sw, n, isa_cap=isa_cap),
                "group32": functools.partial(int8_gemm.gemm, x, packed, sw, n, isa_cap=isa_cap,
                                             activation_group=int8_gemm.ACTIVATION_GROUP),
            }
            if onednn is not None:  # the int16 mode's digit planes through oneDNN (AMX where present)
                calls["onednn"] = functools.partial(int8_gemm.onednn_gemm, x, onednn, sw, n)
            if m > 16 and torch_int_mm:  # torch._int_mm needs more than 16 rows
                calls["int_mm_1row"] = functools.partial(_int_mm, x, wt, sw, 1)
                calls["int_mm_2row"] = functools.partial(_int_mm, x, wt, sw, 2)
            inner = max(1, int(2e8 // (m * n * k)))  # ~0.1-10 ms per sample
            samples = harness.interleaved(calls, repeats, inner, warmup=True)
            row = {"m": m, "n": n, "k": k}
            pick = min if best else statistics.median
            row.update({name: pick(s) * 1e3 for name, s in samples.items()})
            row["speedup_int16"] = row["fp32"] / row["int16"]
            row["speedup_group32"] = row["fp32"] / row["group32"]
            results.append(row)
            print(_line(row), flush=True)
    return results


def _line(row: dict) -> str:
    def ms(key: str) -> str:
        return f"{row[key]:9.3f}" if key in row else f"{'-':>9}"

    return (f"{row['m']:5d} {row['n']:6d} {row['k']:5d} {ms('fp32')} {ms('int16')} {ms('group32')} "
            f"{ms('onednn')} {ms('int_mm_1row')} {ms('int_mm_2row')} {row['speedup_int16']:7.2f}x "
            f"{row['speedup_group32']:7.2f}x " + (f"{row['fp32'] / row['onednn']:7.2f}x" if "onednn" in row else ""))


# gridserve.kernels.cpu_ops.int8_gemm.ISA_NAMES (that module imports torch); a test keeps them equal
ISA_NAMES = ("scalar", "avx2", "avx512-vnni")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--best", action="store_true",
                        help="fastest sample instead of the median (a loaded machine's noise is one-sided)")
    parser.add_argument("--isa", choices=ISA_NAMES, default="avx512-vnni",
                        help="cap the kernel's instruction set (to time the AVX2 / scalar paths)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-int-mm", action="store_true", help="skip the torch._int_mm columns")
    parser.add_argument("--shapes", default="",
                        help="N:K pairs, comma-separated (default: llama-base's five linears)")


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from gridserve.kernels.cpu_ops import int8_gemm

    print(f"kernel ISA: {int8_gemm.isa()} (capped at {args.isa}), torch threads: {torch.get_num_threads()}")
    shapes = [tuple(int(v) for v in pair.split(":")) for pair in args.shapes.split(",")] if args.shapes else SHAPES
    print("    M      N     K   fp32 ms  int16 ms  grp32 ms onednn ms   1row ms   2row ms  int16/fp32 "
          "grp32/fp32 onednn/fp32")
    bench(args.rows, shapes, args.repeats, args.best, int8_gemm.ISA_NAMES.index(args.isa), not args.no_int_mm)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
