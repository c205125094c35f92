"""``gridserve bench fused-moe``: the fused MoE layer against the per-expert loop it replaced.

    gridserve bench fused-moe                                   # fp32 and bf16, batch 1 / 16 / 64
    gridserve bench fused-moe --strategies --repeats 15         # + the other grouped-GEMM options
    gridserve bench fused-moe --int8 --dtypes float32           # + the fused layer with int8 experts

The shape is Qwen3-30B-A3B's scaled down (128 experts, top 8, hidden 2,048 -> 512, expert
intermediate 768 -> 256), one layer, routed by a random router through ``fused_moe.route``. Per
dtype and batch, every variant runs once per repeat, in turn (interleaved, so a busy neighbour
slows them alike), ``--inner`` calls a sample; the table gives each median in ms per layer and the
loop's time over the fused layer's. Every variant's output is checked against the fused layer's first.

Variants: ``loop``, the per-expert loop Mixtral ran before the fused layer (each expert gathers its
tokens, two ``F.linear``, and adds its weighted rows back); ``fused``, ``FusedMoE`` (sorted
assignments, ``torch.mm`` per expert into slices of one output); with ``--strategies`` the fused
layer's other grouped-GEMM options: ``grouped_mm`` (``torch._grouped_mm`` over the sorted rows with
group offsets), ``bmm`` (the active experts' groups padded to the largest, their weights gathered,
one ``torch.bmm``) and ``onednn_packed`` (fp32 only: each expert's weights packed once into oneDNN's
layout, as ``cpu_packed_linear`` holds the dense layers'). With ``--int8``: ``fused_int8``, a copy of
the same layer with its experts quantized as ``--quantization int8`` quantizes them
(``FusedMoE.quantize``: int8 per output channel, the C++ int8 x int16 GEMM per expert), checked
against the fused layer within 3% (relative norm: weight rounding), and its speed-up over the fused
float layer. One torch thread by default (``--threads``): the layer is bound by reading the active
experts' weights, and a second thread on a shared 2-core machine mostly waits.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import Any

from gridserve.benchmarks import harness


def per_expert_loop(layer: Any, x: Any, weights: Any, expert_ids: Any) -> Any:
    """The baseline: Mixtral's experts before the fused layer, one expert at a time."""
    import torch
    import torch.nn.functional as F

    from gridserve.kernels import silu_and_mul

    top_k = expert_ids.shape[1]
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    gates = weights.flatten()[order].unsqueeze(-1)
    counts = torch.bincount(flat, minlength=layer.num_experts).tolist()
    out = torch.zeros_like(x)
    for expert, (rows, gate) in enumerate(zip(tokens.split(counts), gates.split(counts))):
        if rows.numel() == 0:
            continue
        h = silu_and_mul(F.linear(x[rows], layer.gate_up_proj[expert]))
        out.index_add_(0, rows, (F.linear(h, layer.down_proj[expert]) * gate).to(out.dtype))
    return out


def _sorted(layer: Any, weights: Any, expert_ids: Any):
    import torch

    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=layer.num_experts)
    return order, order // expert_ids.shape[1], counts, weights.flatten()[order].unsqueeze(-1)


def grouped_mm(layer: Any, x: Any, weights: Any, expert_ids: Any) -> Any:
    """The fused layer's algorithm with ``torch._grouped_mm`` for each grouped GEMM."""
    import torch

    from gridserve.kernels import silu_and_mul

    order, tokens, counts, gates = _sorted(layer, weights, expert_ids)
    offsets = counts.cumsum(0).to(torch.int32)
    h = silu_and_mul(torch._grouped_mm(x[tokens], layer.gate_up_proj.transpose(1, 2), offs=offsets))
    y = torch._grouped_mm(h, layer.down_proj.transpose(1, 2), offs=offsets)
    return torch.zeros_like(x).index_add_(0, tokens, (y * gates).to(x.dtype))


def padded_bmm(layer: Any, x: Any, weights: Any, expert_ids: Any) -> Any:
    """The fused layer's algorithm with one ``torch.bmm`` over the active experts' padded groups."""
    import torch

    from gridserve.kernels import silu_and_mul

    order, tokens, counts, gates = _sorted(layer, weights, expert_ids)
    active = counts.nonzero().flatten()
    sizes = counts[active]
    groups, longest = active.numel(), int(sizes.max())
    group = torch.repeat_interleave(torch.arange(groups), sizes)
    slot = torch.arange(tokens.numel()) - (sizes.cumsum(0) - sizes)[group]
    padded = x.new_zeros(groups, longest, x.shape[1])
    padded[group, slot] = x[tokens]
    h = silu_and_mul(torch.bmm(padded, layer.gate_up_proj[active].transpose(1, 2)).flatten(0, 1))
    y = torch.bmm(h.view(groups, longest, -1), layer.down_proj[active].transpose(1, 2))[group, slot]
    return torch.zeros_like(x).index_add_(0, tokens, (y * gates).to(x.dtype))


def onednn_packed(layer: Any) -> Any:
    """The fused layer's algorithm with each expert's fp32 weights packed once into oneDNN's blocked
    layout (``cpu_packed_linear``, as the dense layers are); None where that cannot be done."""
    import torch

    from gridserve.kernels import silu_and_mul
    from gridserve.services.worker import cpu_packed_linear

    if not cpu_packed_linear.available() or layer.gate_up_proj.dtype != torch.float32:
        return None
    gate_up = [cpu_packed_linear.pack(w) for w in layer.gate_up_proj]
    down = [cpu_packed_linear.pack(w) for w in layer.down_proj]

    def grouped(rows: Any, packed: list, counts: list[int]) -> Any:
        parts, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                parts.append(cpu_packed_linear.linear(rows[start : start + count], packed[expert]))
                start += count
        return torch.cat(parts)

    def call(x: Any, weights: Any, expert_ids: Any) -> Any:
        order, tokens, counts, gates = _sorted(layer, weights, expert_ids)
        sizes = counts.tolist()
        y = grouped(silu_and_mul(grouped(x[tokens], gate_up, sizes)), down, sizes)
        return torch.zeros_like(x).index_add_(0, tokens, (y * gates).to(x.dtype))

    return call


def int8_experts(layer: Any) -> Any:
    """A copy of ``layer`` with int8 experts (what ``--quantization int8`` serves)."""
    import copy

    quantized = copy.deepcopy(layer)
    quantized.quantize("int8")
    return quantized


def _layer(args: argparse.Namespace, dtype: Any, gen: Any) -> Any:
    import torch

    from gridserve.services.worker.fused_moe import FusedMoE
    from gridserve.services.worker.parallel_state import ParallelState

    layer = FusedMoE(args.experts, args.hidden, args.intermediate, ParallelState.single())
    with torch.no_grad():
        layer.gate_up_proj.normal_(0.0, args.hidden**-0.5, generator=gen)
        layer.down_proj.normal_(0.0, args.intermediate**-0.5, generator=gen)
    return layer.to(dtype).requires_grad_(False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256, help="each expert's intermediate size")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64], help="tokens per call")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--strategies", action="store_true",
                        help="also time the other grouped-GEMM options (torch._grouped_mm, padded bmm)")
    parser.add_argument("--int8", action="store_true",
                        help="also time the fused layer with int8 experts (--quantization int8)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved samples per variant")
    parser.add_argument("--inner", type=int, default=0, help="calls per sample (0: ~20 ms of the loop's work)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch

    from gridserve.services.worker.fused_moe import route

    if args.threads:
        torch.set_num_threads(args.threads)
    # name -> (layer -> the variant's call, or None where it does not apply)
    variants = {"loop": lambda layer: lambda *routed: per_expert_loop(layer, *routed), "fused": lambda layer: layer}
    if args.strategies:
        variants |= {"grouped_mm": lambda layer: lambda *routed: grouped_mm(layer, *routed),
                     "bmm": lambda layer: lambda *routed: padded_bmm(layer, *routed),
                     "onednn_packed": onednn_packed}
    if args.int8:
        variants["fused_int8"] = int8_experts
    print(f"E={args.experts} experts, top {args.top_k}, hidden {args.hidden}, expert intermediate "
          f"{args.intermediate}; {torch.get_num_threads()} thread(s); ms per layer, median of {args.repeats} "
          "interleaved samples\n")
    ratios = ["loop / fused"] + (["fused / fused_int8"] if args.int8 else [])
    print("| dtype | batch | " + " | ".join([*variants, *ratios]) + " |")
    print("|---|---:|" + "---:|" * (len(variants) + len(ratios)))
    gen = torch.Generator().manual_seed(args.seed)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        layer = _layer(args, dtype, gen)
        made = {name: make(layer) for name, make in variants.items()}
        router = torch.randn(args.experts, args.hidden, generator=gen)
        for batch in args.batch_sizes:
            x = torch.randn(batch, args.hidden, generator=gen)
            weights, ids = route(x @ router.t(), args.top_k)
            x = x.to(dtype)
            calls = {name: functools.partial(fn, x, weights, ids) for name, fn in made.items() if fn is not None}
            with torch.inference_mode():
                expected = calls["fused"]().float()
                for name, call in calls.items():
                    got = call().float()
                    if name == "fused_int8":  # rounded weights: near the float layer, not equal
                        error = float((got - expected).norm() / expected.norm())
                        if error > 3e-2:
                            raise AssertionError(f"fused_int8 is {error:.3f} (relative) off the fused layer")
                    else:
                        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2, msg=name)
                inner = args.inner or harness.calls_per_sample(calls["loop"], 20e-3)
                # the checks above warmed every variant up
                samples = harness.interleaved(calls, args.repeats, inner, warmup=False)
            ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
            cells = " | ".join(f"{ms[name]:.3f}" if name in ms else "–" for name in variants)
            speedups = [f"{ms['loop'] / ms['fused']:.2f}x"]
            if args.int8:
                speedups.append(f"{ms['fused'] / ms['fused_int8']:.2f}x")
            print(f"| {dtype_name} | {batch} | {cells} | {' | '.join(speedups)} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return harness.standalone(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
