"""Paged-attention decode bandwidth on a CUDA GPU, as a share of the memory-bandwidth ceiling.

A decode step's attention must read every cached K/V byte of every sequence once, so its floor is
``KV bytes / bandwidth``. This times the Triton kernel (``gridserve.kernels.triton_ops``) on
Llama-3-8B's attention shape (32 query heads, 8 KV heads, head 128, 16-token pages, blocks
scattered over the cache) at several batch sizes and context lengths, and reports the achieved
bytes per second against (a) a device-to-device copy measured in the same run and (b) the
datasheet's HBM peak. Medians of CUDA-event timings.

    gridserve bench gpu-attention --output-json out.json [--peak-tbps 4.8]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `gridserve bench` lists this without it
    import torch


def _time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbps(size_bytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters=10)
    # (the tensors are freed when this function returns)
    return 2 * size_bytes / (ms * 1e-3) / 1e9


def decode_case(batch: int, context: int, dtype: torch.dtype, heads=32, kv_heads=8, head=128, page=16,
                plan=None):
    import torch

    from gridserve.kernels.triton_ops import attention

    pages_per_seq = (context + page - 1) // page
    num_blocks = batch * pages_per_seq + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_cache = torch.randn(2, num_blocks, page, kv_heads, head, device="cuda", dtype=dtype, generator=gen)
    order = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
    block_table = order[: batch * pages_per_seq].view(batch, pages_per_seq).to(torch.int32)
    query = torch.randn(batch, heads, head, device="cuda", dtype=dtype, generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    plan = plan or attention.plan_attention(query, kv_cache, block_table, batch, 1)
    ms = _time_ms(lambda: attention.run_paged_attention(query, kv_cache, qsl, seq_lens, block_table,
                                                        head**-0.5, plan))
    kv_bytes = batch * context * kv_heads * head * 2 * kv_cache.element_size()
    other = query.numel() * query.element_size() * 2 + block_table.numel() * 4
    kv_bytes = int(kv_bytes)
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."),
            "ms": round(ms, 4), "bytes": kv_bytes + other,
            "gbps": round((kv_bytes + other) / (ms * 1e-3) / 1e9, 1),
            "plan": {"block_m": plan.block_m, "tile_n": plan.tile_n, "num_splits": plan.num_splits,
                     "num_warps": plan.num_warps}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="datasheet HBM peak (H200: 4.8)")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--sweep-plans", action="store_true", help="also time alternative launch plans")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench gpu-attention: no CUDA device (run it on a GPU machine: benchmarks/gpu_check.sh)")
    copy = copy_bandwidth_gbps()
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                row = decode_case(batch, context, dtype)
                row["pct_of_copy"] = round(100 * row["gbps"] / copy, 1)
                row["pct_of_peak"] = round(100 * row["gbps"] / (args.peak_tbps * 1000), 1)
                rows.append(row)
                print(f"{row['dtype']:>8} batch {batch:4d} ctx {context:5d}: {row['ms']:8.3f} ms "
                      f"{row['gbps']:8.1f} GB/s  {row['pct_of_copy']:5.1f}% of copy  "
                      f"{row['pct_of_peak']:5.1f}% of peak  splits={row['plan']['num_splits']}", flush=True)
    sweep = []
    if args.sweep_plans:
        from gridserve.kernels.triton_ops.attention import AttentionPlan

        for dtype in (torch.float32, torch.float16):
            for batch, context, splits in ((256, 2048, (1,)), (1, 4096, (4, 8, 16, 32))):
                for tile_n in (16, 32, 64, 128):
                    for warps in (2, 4, 8):
                        for split in splits:
                            plan = AttentionPlan(block_m=16, tile_n=tile_n, num_splits=split, num_warps=warps)
                            try:
                                row = decode_case(batch, context, dtype, plan=plan)
                            except Exception as exc:  # a plan that does not compile: say so, go on
                                print(f"plan {plan} failed: {type(exc).__name__}: {str(exc)[:120]}")
                                continue
                            sweep.append(row)
                            print(f"sweep {row['dtype']:>8} b{batch} ctx{context} tile_n={tile_n} "
                                  f"warps={warps} splits={split}: {row['ms']:.4f} ms {row['gbps']:.0f} GB/s",
                                  flush=True)
    result = {"sweep": sweep, "device": torch.cuda.get_device_name(), "copy_gbps": round(copy, 1),
              "peak_gbps": args.peak_tbps * 1000, "torch": torch.__version__, "rows": rows}
    print(f"device-to-device copy: {copy:.1f} GB/s (read + write)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
