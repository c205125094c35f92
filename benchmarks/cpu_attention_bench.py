"""CPU paged attention: the torch reference (gather + masked SDPA) against the C++ kernel.

    gridserve bench cpu-attention                      # batch 64, contexts 64..512
    gridserve bench cpu-attention --batch 16 --layers 4
    gridserve bench cpu-attention --batch 256 --against portable   # AVX-512 vs loops

One decode step's attention for every layer (`--layers` calls on separate caches), fp32, blocks
scattered over the cache as after a while of serving. ``--against portable`` compares the kernel's
AVX-512 path with its portable loops instead of the reference. The two run alternately, `--repeats` times,
and the medians are printed with the ratio and the KV bytes each step must read at the least.
"""

from __future__ import annotations

import argparse
import statistics
import time


def decode_batch(batch: int, ctx_min: int, ctx_max: int, heads: int, kv_heads: int, head_size: int,
                 block_size: int, gen, dtype=None):
    import torch

    dtype = dtype or torch.float32
    contexts = torch.randint(ctx_min, ctx_max + 1, (batch,), generator=gen).tolist()
    blocks = [(c + block_size - 1) // block_size for c in contexts]
    num_blocks = sum(blocks) + 1
    scattered = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(batch, max(blocks), dtype=torch.int32)
    for seq, n in enumerate(blocks):
        table[seq, :n] = torch.tensor(scattered[:n])
        scattered = scattered[n:]
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype)
    query = torch.randn(batch, heads, head_size, generator=gen)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    return query, kv_cache, qsl, torch.tensor(contexts, dtype=torch.int32), table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx-min", type=int, default=64)
    parser.add_argument("--ctx-max", type=int, default=512)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--against", default="reference", choices=("reference", "portable"))


def run(args: argparse.Namespace) -> int:
    import torch

    from gridserve.kernels import cpu_ops, reference

    if cpu_ops.load() is None:
        raise SystemExit("the C++ kernel did not build (see the log)")
    gen = torch.Generator().manual_seed(0)
    layers = [
        decode_batch(args.batch, args.ctx_min, args.ctx_max, args.heads, args.kv_heads,
                     args.head_size, args.block_size, gen, getattr(torch, args.kv_cache_dtype))
        for _ in range(args.layers)
    ]
    scale = args.head_size**-0.5
    impls = {"reference": reference.paged_attention, "cpp": cpu_ops.paged_attention}
    if args.against == "portable":
        isa = torch.ops.gridserve_cpu.paged_attention_isa

        def portable(*call):
            previous = isa(-1)
            isa(0)
            try:
                return cpu_ops.paged_attention(*call)
            finally:
                isa(previous)

        impls = {"portable": portable, "cpp": cpu_ops.paged_attention}
    base, cpp_impl = impls.values()
    for layer in layers:  # warm-up, and the check that both agree
        diff = (base(*layer, scale, 1).float() - cpp_impl(*layer, scale, 1).float()).abs().max()
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(args.repeats):
        for name, fn in impls.items():
            start = time.perf_counter()
            for layer in layers:
                fn(*layer, scale, 1)
            times[name].append((time.perf_counter() - start) * 1e3)
    element = layers[0][1].element_size()
    kv_bytes = sum(int(layer[3].sum()) for layer in layers) * 2 * args.kv_heads * args.head_size * element
    ref, cpp = (statistics.median(times[name]) for name in impls)
    print(f"batch {args.batch}, contexts {args.ctx_min}..{args.ctx_max}, {args.heads}/{args.kv_heads} "
          f"heads x {args.head_size}, {args.layers} layers, {torch.get_num_threads()} threads, "
          f"{kv_bytes / 1e6:.0f} MB of {args.kv_cache_dtype} K/V")
    print(f"{args.against} {ref:.1f} ms   cpp {cpp:.1f} ms   speed-up {ref / cpp:.2f}x   "
          f"cpp {kv_bytes / cpp / 1e6:.1f} GB/s   max diff {float(diff):.1e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
