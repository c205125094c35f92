"""``gridserve bench mla``: MLA decode with the latents expanded vs with the weights absorbed.

    gridserve bench mla                          # context 256 / 1024 / 4096, batch 8, fp32
    gridserve bench mla --contexts 1024 --batch 1 --repeats 21

The shape is DeepSeek-V2-Lite's attention scaled down (16 heads, kv_lora_rank 512 -> 256,
qk_nope 128 -> 64, qk_rope 64 -> 32, v 128 -> 64), one layer's ``MLAAttention`` on a decode step
(one new token per sequence) over a filled latent cache of 16-token blocks. Variants, run in turn
per repeat (interleaved, so a busy neighbour slows them alike): ``expand`` (every sequence's
latents gathered and expanded by ``kv_b_proj``, then SDPA: the path before absorption, and still
the prefill path), ``absorb-torch`` (absorbed query, ``mla_decode``'s torch reference) and
``absorb-cpu`` (absorbed query, the C++ kernel). The table gives each median in ms per layer and
``expand`` over it. Every variant's output is checked against ``expand``'s first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

VARIANTS = ("expand", "absorb-torch", "absorb-cpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096], help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences in the decode step")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-lora-rank", type=int, default=256)
    parser.add_argument("--qk-nope", type=int, default=64)
    parser.add_argument("--qk-rope", type=int, default=32)
    parser.add_argument("--v-head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=11, help="interleaved samples per variant")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)


def _setup(args: argparse.Namespace, context: int) -> dict[str, Any]:
    """A layer, its ``kv_b_proj``, a filled cache and one decode step of ``args.batch`` sequences."""
    import torch

    from gridserve.kernels.attention_backend import AttentionMetadata
    from gridserve.services.worker.mla_attention import MLAAttention

    gen = torch.Generator().manual_seed(args.seed + context)
    block = 16
    blocks_per_seq = (context + block - 1) // block
    num_blocks = args.batch * blocks_per_seq + 1
    layer = MLAAttention(args.heads, args.qk_nope, args.qk_rope, args.v_head_dim, args.kv_lora_rank,
                         (args.qk_nope + args.qk_rope) ** -0.5)
    layer.kv_cache = torch.randn(layer.kv_cache_shape(num_blocks, block), generator=gen)
    kv_b_proj = torch.nn.Linear(args.kv_lora_rank, args.heads * (args.qk_nope + args.v_head_dim), bias=False)
    torch.nn.init.normal_(kv_b_proj.weight, std=args.kv_lora_rank ** -0.5, generator=gen)
    kv_b_proj.requires_grad_(False)
    table = (torch.randperm(num_blocks - 1, generator=gen)[: args.batch * blocks_per_seq] + 1).view(args.batch, -1)
    seq_lens = torch.full((args.batch,), context, dtype=torch.int32)
    slots = table[:, (context - 1) // block].long() * block + (context - 1) % block
    meta = AttentionMetadata(torch.arange(args.batch + 1, dtype=torch.int32), seq_lens, table.to(torch.int32),
                             slots, 1)
    q = torch.randn(args.batch, args.heads * (args.qk_nope + args.qk_rope), generator=gen)
    latent, k_pe = torch.randn(args.batch, args.kv_lora_rank, generator=gen), torch.randn(args.batch, args.qk_rope,
                                                                                          generator=gen)
    return {"layer": layer, "kv_b_proj": kv_b_proj, "step": (q, latent, k_pe, meta)}


def _call(setup: dict[str, Any], variant: str):
    import os
    from unittest import mock

    layer = setup["layer"]
    layer.batch_invariant = variant == "expand"  # batch-invariant mode expands every row
    kernels = "reference" if variant == "absorb-torch" else "cpu"
    with mock.patch.dict(os.environ, {"GRIDSERVE_KERNELS": kernels}):  # restored after the call
        return layer(*setup["step"], setup["kv_b_proj"])


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with torch.inference_mode():
        for context in args.contexts:
            setup = _setup(args, context)
            expected = _call(setup, "expand")
            for variant in VARIANTS[1:]:
                torch.testing.assert_close(_call(setup, variant), expected, atol=1e-4, rtol=1e-4)
            samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(args.repeats):
                for variant in VARIANTS:
                    start = time.perf_counter()
                    _call(setup, variant)
                    samples[variant].append(time.perf_counter() - start)
            rows.append((context, {v: statistics.median(s) * 1e3 for v, s in samples.items()}))
    print(f"MLA decode, one layer: batch {args.batch}, {args.heads} heads, kv_lora_rank {args.kv_lora_rank}, "
          f"qk_nope {args.qk_nope}, qk_rope {args.qk_rope}, v {args.v_head_dim}, fp32, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} (ms)")
    print("| context | " + " | ".join(VARIANTS) + " | expand / absorb-cpu | expand / absorb-torch |")
    print("|---" * (len(VARIANTS) + 3) + "|")
    for context, ms in rows:
        cells = " | ".join(f"{ms[v]:.2f}" for v in VARIANTS)
        print(f"| {context} | {cells} | {ms['expand'] / ms['absorb-cpu']:.2f}x | "
              f"{ms['expand'] / ms['absorb-torch']:.2f}x |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
