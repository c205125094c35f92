"""Micro-benchmark of gridserve's Triton kernels against the torch reference and a bandwidth roofline.

    gridserve bench kernels --peak-gbps 4800     # H200 HBM3e; H100 SXM: 3350
    gridserve bench kernels --only attention      # cases whose name contains the word
    gridserve bench kernels --interpret           # no GPU: tiny shapes, Triton interpreter

Each row: the Triton kernel's time, the torch reference's time, the speed-up, the bytes the
operation must move at the least (each input read once, each output written once), the roofline
time those bytes take at ``--peak-gbps``, the achieved GB/s and its fraction of the peak, and the
largest difference from the reference. The sampling rows time torch alone (see kernels/README.md).
Under ``--interpret`` the timings only show that the plumbing runs; they say nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `gridserve bench` lists this without it
    import torch

PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0}


@dataclass
class Case:
    """One benchmark row: the two implementations on the same inputs and the minimum bytes moved."""

    name: str
    shape: str
    triton: Callable[[], object] | None
    reference: Callable[[], object]
    bytes_moved: int


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def attention_case(name, contexts, q_lens, dtype, device, heads=32, kv_heads=8, head_size=128, page=16):
    """A paged-attention step; the KV of every context is read once (blocks scattered randomly)."""
    import torch

    ops, ref = _modules()
    pages = [(c + page - 1) // page for c in contexts]
    num_blocks = sum(pages) + 1
    ids = torch.randperm(num_blocks - 1, device=device).add(1).to(torch.int32)
    table = torch.zeros(len(contexts), max(pages), dtype=torch.int32, device=device)
    start = 0
    for seq, n in enumerate(pages):
        table[seq, :n] = ids[start : start + n]
        start += n
    kv = torch.randn(2, num_blocks, page, kv_heads, head_size, dtype=dtype, device=device)
    loc = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, head_size, dtype=dtype, device=device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    args = (q, kv, loc, lens, table, head_size**-0.5, max(q_lens))
    kv_bytes = sum(contexts) * 2 * kv_heads * head_size * kv.element_size()
    shape = f"seqs={len(contexts)} ctx={min(contexts)}..{max(contexts)} q={max(q_lens)} h={heads}/{kv_heads} d={head_size}"
    return Case(name, shape, lambda: ops.paged_attention(*args), lambda: ref.paged_attention(*args),
                kv_bytes + 2 * nbytes(q) + nbytes(table))


def cases(dtype: torch.dtype, device: str, tiny: bool) -> list[Case]:
    """The benchmark rows: decode-sized and prefill-sized shapes (``tiny`` for the interpreter)."""
    import torch

    ops, ref = _modules()
    t, hidden, inter = (8, 128, 96) if tiny else (4096, 4096, 14336)
    heads, kv_heads, d = (4, 2, 64) if tiny else (32, 8, 128)
    rows: list[Case] = []
    if tiny:
        rows.append(attention_case("attention decode", [1, 17, 40], [1, 1, 1], dtype, device, 4, 2, 64))
        rows.append(attention_case("attention prefill", [24, 40], [24, 8], dtype, device, 4, 2, 64))
    else:
        torch.manual_seed(0)
        mixed = torch.randint(16, 4096, (64,)).tolist()
        rows += [
            attention_case("attention decode", [2048] * 64, [1] * 64, dtype, device),
            attention_case("attention decode mixed", mixed, [1] * 64, dtype, device),
            attention_case("attention decode long (split-K)", [32768, 32768], [1, 1], dtype, device),
            attention_case("attention prefill", [1024] * 4, [1024] * 4, dtype, device),
            attention_case("attention chunked prefill", [2560] * 4, [512] * 4, dtype, device),
        ]
    key = torch.randn(t, kv_heads, d, dtype=dtype, device=device)
    value = torch.randn_like(key)
    caches = torch.zeros(2, 2, t // 16 + 1, 16, kv_heads, d, dtype=dtype, device=device)
    slots = torch.randperm(t, device=device)
    rows.append(Case("reshape_and_cache", f"tokens={t} kvh={kv_heads} d={d}",
                     lambda: ops.reshape_and_cache(key, value, caches[0], slots) or caches[0],
                     lambda: ref.reshape_and_cache(key, value, caches[1], slots) or caches[1],
                     2 * nbytes(key, value) + nbytes(slots)))
    x = torch.randn(t, hidden, dtype=dtype, device=device)
    res, w = torch.randn_like(x), torch.randn(hidden, dtype=dtype, device=device)
    rows.append(Case("rms_norm", f"{t}x{hidden}", lambda: ops.rms_norm(x, w, 1e-6),
                     lambda: ref.rms_norm(x, w, 1e-6), 2 * nbytes(x) + nbytes(w)))
    rows.append(Case("fused_add_rms_norm", f"{t}x{hidden}",
                     lambda: ops.fused_add_rms_norm(x, res, w, 1e-6),
                     lambda: ref.fused_add_rms_norm(x, res, w, 1e-6), 4 * nbytes(x) + nbytes(w)))
    q = torch.randn(t, heads, d, dtype=dtype, device=device)
    k = torch.randn(t, kv_heads, d, dtype=dtype, device=device)
    pos = torch.randint(0, 4096, (t,), device=device)
    cos_sin = torch.randn(4096, d, device=device)
    rows.append(Case("rotary_embedding (neox)", f"tokens={t} h={heads}/{kv_heads} d={d}",
                     lambda: ops.rotary_embedding(pos, q, k, cos_sin, True),
                     lambda: ref.rotary_embedding(pos, q, k, cos_sin, True),
                     2 * nbytes(q, k) + t * d * cos_sin.element_size() + nbytes(pos)))
    gate_up = torch.randn(t, 2 * inter, dtype=dtype, device=device)
    rows.append(Case("silu_and_mul", f"{t}x2*{inter}", lambda: ops.silu_and_mul(gate_up),
                     lambda: ref.silu_and_mul(gate_up), nbytes(gate_up) * 3 // 2))
    rows += sampling_cases(device, tiny)
    return rows


def sample_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p over the whole vocabulary with one full sort (vLLM's torch fallback)."""
    import torch

    sorted_logits, order = logits.sort(dim=-1)
    kth = sorted_logits.gather(-1, (logits.shape[-1] - top_k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    outside = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p.unsqueeze(1)
    outside[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    probs = torch.empty_like(logits).scatter_(-1, order, sorted_logits).softmax(-1)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)  # no host sync


def sample_top_k_first(logits: torch.Tensor, k: int, top_p: torch.Tensor) -> torch.Tensor:
    """The same draw when every row has ``top_k <= k``: top-p only sorts the k candidates."""
    import torch

    values, ids = logits.topk(k, dim=-1)  # sorted, descending
    probs = values.softmax(-1)
    outside = probs.cumsum(-1) - probs > top_p.unsqueeze(1)
    probs = probs.masked_fill(outside, 0.0)
    return ids.gather(-1, probs.div_(torch.empty_like(probs).exponential_()).argmax(-1, keepdim=True))


def sampling_cases(device: str, tiny: bool) -> list[Case]:
    import torch

    batch, vocab = (4, 1000) if tiny else (256, 128256)
    logits = torch.randn(batch, vocab, device=device)
    top_k = torch.full((batch,), 50, device=device)
    top_p = torch.full((batch,), 0.9, device=device)
    shape = f"batch={batch} vocab={vocab} k=50 p=0.9"
    return [
        Case("sampling: full sort (torch)", shape, None,
             lambda: sample_sorted(logits, top_k, top_p), nbytes(logits)),
        Case("sampling: topk first (torch)", shape, None,
             lambda: sample_top_k_first(logits, 50, top_p), nbytes(logits)),
    ]


def _modules():
    from gridserve.kernels import reference, triton_ops

    return triton_ops, reference


def time_ms(fn: Callable[[], object], on_gpu: bool) -> float:
    if on_gpu:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def max_error(a: object, b: object) -> float:
    if isinstance(a, tuple):
        return max(max_error(x, y) for x, y in zip(a, b, strict=True))
    return (a.float() - b.float()).abs().max().item()


def run_case(case: Case, on_gpu: bool, peak_gbps: float | None) -> str:
    """Time both implementations (torch alone for the sampling rows) and format one table row."""
    try:
        ref_ms: float | None = time_ms(case.reference, on_gpu)
    except Exception as exc:  # a reference that cannot run on this device still gets a row
        ref_ms = None
        print(f"  reference {case.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    ms = time_ms(case.triton, on_gpu) if case.triton is not None else ref_ms
    if ms is None:
        return f"{case.name:<34} failed"
    triton_ms, speedup, err = f"{'-':>9}", f"{'-':>7}", "-"
    if case.triton is not None:
        triton_ms = f"{ms:9.3f}"
        if ref_ms is not None:
            speedup = f"{ref_ms / ms:6.2f}x"
            err = f"{max_error(case.triton(), case.reference()):.2e}"
    torch_ms = f"{ref_ms:9.3f}" if ref_ms is not None else f"{'failed':>9}"
    gbps = case.bytes_moved / ms / 1e6
    roof = f"{case.bytes_moved / peak_gbps / 1e6:8.3f}" if peak_gbps else f"{'-':>8}"
    frac = f"{100 * gbps / peak_gbps:5.1f}%" if peak_gbps else f"{'-':>6}"
    return (f"{case.name:<34} {triton_ms} {torch_ms} {speedup} {case.bytes_moved / 1e6:9.1f} "
            f"{roof} {gbps:8.1f} {frac} {err:>9}  {case.shape}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peak-gbps", type=float, help="peak memory bandwidth (default: by GPU name)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--only", default="", help="run the cases whose name contains this text")
    parser.add_argument("--interpret", action="store_true",
                        help="no GPU: tiny shapes on CPU in the Triton interpreter (plumbing check)")


def run(args: argparse.Namespace) -> int:
    import torch

    on_gpu = torch.cuda.is_available() and not args.interpret
    if not on_gpu and not args.interpret:
        sys.exit("bench kernels: no CUDA device. Run it on a GPU, or pass --interpret to run tiny "
                 "shapes on CPU in the Triton interpreter (a plumbing check; timings mean nothing).")
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before gridserve.kernels.triton_ops is imported
    device = "cuda" if on_gpu else "cpu"
    peak = args.peak_gbps
    if peak is None and on_gpu:
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
        print(f"device: {name}; peak bandwidth {peak or 'unknown (pass --peak-gbps)'} GB/s")
    print(f"{'case':<34} {'triton ms':>9} {'torch ms':>9} {'speedup':>7} {'min MB':>9} "
          f"{'roof ms':>8} {'GB/s':>8} {'%peak':>6} {'max err':>9}  shape")
    dtype = getattr(torch, args.dtype)
    for case in cases(dtype, device, tiny=not on_gpu):
        if args.only in case.name:
            print(run_case(case, on_gpu, peak), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
