"""A decoder layer's per-token ops on CPU: the torch reference against the C++ kernels (``cpu_ops``).

    gridserve bench layer-ops                       # 256 and 2,048 tokens, 1 and all threads
    gridserve bench layer-ops --tokens 256 --threads 1 --dtype bfloat16

Shapes of llama ``base``: hidden 768, 12 query heads and 12 (``--kv-heads``) KV heads of 64 (q and
k are strided views of a fused QKV output, as in the model), MLP 2,048 (SiLU-and-mul of a
2 x 2,048 gate/up), KV written into a scattered fp32 (``--cache-dtype``) cache. Each op's
reference and kernel run alternately, ``--repeats`` samples of ``--inner`` calls each; the medians
per call and their ratio are printed.
"""

from __future__ import annotations

import argparse
import statistics

from gridserve.benchmarks import harness


def cases(tokens: int, hidden: int, heads: int, kv_heads: int, head_size: int, mlp: int, dtype, cache_dtype,
          gen):
    """(name, reference call, kernel call) per op, on fresh inputs of the given shape."""
    import torch

    from gridserve.kernels import cpu_ops, reference

    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v = qkv[:, (heads + kv_heads) * head_size :].view(tokens, kv_heads, head_size)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos_sin = torch.randn(4096, head_size, generator=gen)
    gate_up = torch.randn(tokens, 2 * mlp, generator=gen).to(dtype)
    block_size = 16
    num_blocks = (tokens + block_size - 1) // block_size * 4 + 1
    cache_ref = torch.zeros(2, num_blocks, block_size, kv_heads, head_size, dtype=cache_dtype)
    cache_cpp = cache_ref.clone()
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:tokens] + block_size
    eps = 1e-6
    return [
        ("rms_norm", lambda: reference.rms_norm(x, weight, eps), lambda: cpu_ops.rms_norm(x, weight, eps)),
        ("fused_add_rms_norm", lambda: reference.fused_add_rms_norm(x, residual, weight, eps),
         lambda: cpu_ops.fused_add_rms_norm(x, residual, weight, eps)),
        ("rotary_embedding (neox)", lambda: reference.rotary_embedding(positions, q, k, cos_sin, True),
         lambda: cpu_ops.rotary_embedding(positions, q, k, cos_sin, True)),
        ("rotary_embedding (gpt-j)", lambda: reference.rotary_embedding(positions, q, k, cos_sin, False),
         lambda: cpu_ops.rotary_embedding(positions, q, k, cos_sin, False)),
        ("silu_and_mul", lambda: reference.silu_and_mul(gate_up), lambda: cpu_ops.silu_and_mul(gate_up)),
        ("reshape_and_cache", lambda: reference.reshape_and_cache(k, v, cache_ref, slots),
         lambda: cpu_ops.reshape_and_cache(k, v, cache_cpp, slots)),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="0 = torch's default")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--cache-dtype", default=None, help="default: --dtype; e.g. float8_e4m3fn")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=0, help="calls per sample (0: ~2 ms of reference work)")


def run(args: argparse.Namespace) -> int:
    import torch

    from gridserve.kernels import cpu_ops

    if cpu_ops.load_layer_ops() is None:
        raise SystemExit("the C++ layer ops did not build (see the log)")
    dtype = getattr(torch, args.dtype)
    cache_dtype = getattr(torch, args.cache_dtype) if args.cache_dtype else dtype
    default_threads = torch.get_num_threads()
    print(f"dtype {args.dtype}, cache {cache_dtype}, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} x "
          f"{args.head_size}, mlp {args.mlp}; median of {args.repeats} interleaved samples, ms per call")
    print(f"{'tokens':>6} {'threads':>7} {'op':<26} {'reference':>10} {'C++':>9} {'speed-up':>9}")
    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(tokens)
        for threads in args.threads:
            torch.set_num_threads(threads or default_threads)
            for name, ref, cpp in cases(tokens, args.hidden, args.heads, args.kv_heads, args.head_size, args.mlp,
                                        dtype, cache_dtype, gen):
                ref(), cpp()  # warm-up, before the sample size is taken from one reference call
                inner = args.inner or harness.calls_per_sample(ref, 2e-3)
                samples = harness.interleaved({"ref": ref, "cpp": cpp}, args.repeats, inner, warmup=False)
                r, c = statistics.median(samples["ref"]), statistics.median(samples["cpp"])
                print(f"{tokens:>6} {torch.get_num_threads():>7} {name:<26} {r * 1e3:>10.3f} {c * 1e3:>9.3f} "
                      f"{r / c:>8.2f}x", flush=True)
    torch.set_num_threads(default_threads)
    return 0


def main(argv: list[str] | None = None) -> int:
    return harness.standalone(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
