"""A decode-step model of this machine: what one step must read and compute, and the floor that sets.

``probe`` measures, at the start of a run, the machine's streaming read bandwidth (a sum over a
buffer larger than a 260 MB L3) and its GEMM rate at the step's shapes (fp32, and int8 when the
weights are int8; the operands stay in cache, so this is the compute rate). ``step_costs``
counts, for one decode step of a Llama-shaped decoder, the bytes each component must read and the
FLOPs it must do:

- ``attention``: every sequence's K and V at its context length in the cache's dtype (read once,
  all layers), the step's new K/V written; FLOPs ``4 * ctx * heads * head_dim`` per layer.
- ``mlp_proj``: the decoder layers' weights (QKV, O, gate/up, down) as stored (fp32 / int8 /
  int4 with their scales); FLOPs ``2 * B * in * out`` per matrix. Norms, RoPE and activations are
  left out (kilobytes against hundreds of megabytes).
- ``lm_head``: the output embedding as stored, and the ``B x vocab`` logits written;
  FLOPs ``2 * B * hidden * vocab``.
- ``sampler``: the logits read once (greedy: one argmax pass).
- ``overhead``: nothing: any time here (input preparation, scheduling, detokenizing) is above the floor.

A component's floor is ``max(bytes / bandwidth, flops / gemm rate)``; the step's floor is the sum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

COMPONENTS = ("attention", "mlp_proj", "lm_head", "sampler", "overhead")


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Llama-shaped decoder that set a decode step's bytes and FLOPs."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf(cls, hf: Any) -> DecoderShape:
        heads = hf.num_attention_heads
        return cls(
            layers=hf.num_hidden_layers, hidden=hf.hidden_size, intermediate=hf.intermediate_size,
            heads=heads, kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, vocab=hf.vocab_size,
        )

    def layer_matrices(self) -> list[tuple[int, int]]:
        """(in, out) of each weight matrix of one decoder layer."""
        d, h = self.head_dim, self.hidden
        return [(h, (self.heads + 2 * self.kv_heads) * d), (self.heads * d, h),
                (h, 2 * self.intermediate), (self.intermediate, h)]

    def projection_params(self) -> int:
        return self.layers * sum(i * o for i, o in self.layer_matrices())

    def kv_elements_per_token(self) -> int:
        """K and V elements one token holds in the cache, all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Machine:
    """What the probe measured: streaming read bandwidth and GEMM rates (FLOP/s)."""

    bandwidth: float  # bytes/s
    gemm_fp32: float  # FLOP/s
    gemm_int8: Optional[float] = None  # FLOP/s (int8 x int8 -> int32), when probed

    def gemm_rate(self, weights: str) -> float:
        return self.gemm_int8 if weights == "int8" and self.gemm_int8 else self.gemm_fp32


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float

    def floor(self, bandwidth: float, gemm_rate: float) -> float:
        """Seconds: the slower of reading the bytes and doing the FLOPs."""
        return max(self.bytes / bandwidth, self.flops / gemm_rate)


def weight_bytes(shape: DecoderShape, bytes_per_weight: float) -> dict[str, float]:
    """Bytes of the decoder layers' matrices and of the LM head at ``bytes_per_weight`` (4 for fp32)."""
    return {"mlp_proj": shape.projection_params() * bytes_per_weight,
            "lm_head": shape.vocab * shape.hidden * bytes_per_weight}


def step_costs(shape: DecoderShape, contexts: list[int], weights: dict[str, float],
               kv_bytes_per_element: int, logits_bytes_per_element: int = 4) -> dict[str, Cost]:
    """Bytes and FLOPs of one decode step over sequences of ``contexts`` tokens (the new one included)."""
    batch = len(contexts)
    kv_token = shape.kv_elements_per_token() * kv_bytes_per_element
    logits = batch * shape.vocab * logits_bytes_per_element
    return {
        "attention": Cost(
            bytes=sum(contexts) * kv_token + batch * kv_token,  # read each context, write the new K/V
            flops=4.0 * sum(contexts) * shape.heads * shape.head_dim * shape.layers,
        ),
        "mlp_proj": Cost(bytes=weights["mlp_proj"], flops=2.0 * batch * shape.projection_params()),
        "lm_head": Cost(bytes=weights["lm_head"] + logits, flops=2.0 * batch * shape.hidden * shape.vocab),
        "sampler": Cost(bytes=logits, flops=0.0),
        "overhead": Cost(bytes=0.0, flops=0.0),
    }


def floors(costs: dict[str, Cost], machine: Machine, weights: str = "fp32") -> dict[str, float]:
    """Each component's floor in seconds, and ``total`` (their sum)."""
    out = {name: cost.floor(machine.bandwidth, machine.gemm_rate(weights)) for name, cost in costs.items()}
    out["total"] = sum(out.values())
    return out


def model_weight_bytes(model: Any) -> dict[str, float]:
    """Bytes of the weights a step reads, as the loaded model stores them (quantized or not)."""
    from gridserve.services.worker.parallel_layers import QuantizableLinear, VocabParallelEmbedding

    def stored(layer: Any) -> int:
        if layer.qweight is not None:
            return layer.qweight.nbytes()
        return sum(p.numel() * p.element_size() for p in (layer.weight, getattr(layer, "bias", None))
                   if p is not None)

    head = model.logits_head
    projections = sum(stored(m) for m in model.modules()
                      if isinstance(m, QuantizableLinear) and not isinstance(m, VocabParallelEmbedding))
    return {"mlp_proj": float(projections), "lm_head": float(stored(head))}


def weights_kind(model: Any) -> str:
    """``fp32`` / ``bf16`` ... or the quantization method of the decoder's linear layers."""
    from gridserve.services.worker.parallel_layers import QuantizableLinear

    for m in model.modules():
        if isinstance(m, QuantizableLinear) and m.qweight is not None:
            return m.qweight.method
    return {4: "fp32", 2: "16-bit"}.get(next(model.parameters()).element_size(), "float")


def _seconds(fn: Any, repeats: int, clock: Any = time.perf_counter) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one warm-up call) by ``clock``."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def probe(batch: int, hidden: int, int8: bool = False, buffer_bytes: int = 512 << 20,
          repeats: int = 5) -> Machine:
    """Measure read bandwidth (``sum`` of a ``buffer_bytes`` fp32 tensor on every thread; the fastest
    of ``repeats``, wall time) and the GEMM rate at ``[batch, hidden] x [hidden, hidden]`` (operands
    in cache): one thread's rate by its CPU time, times the thread count, so that other processes
    taking turns on the cores (a shared machine) do not lower it."""
    import torch
    import torch.nn.functional as F

    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    bandwidth = buffer_bytes / _seconds(buffer.sum, repeats)
    del buffer
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(batch, 1), hidden, generator=gen)
    w = torch.randn(hidden, hidden, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gemm_fp32 = threads * 2.0 * x.shape[0] * hidden * hidden / _seconds(
            lambda: F.linear(x, w), 21, time.thread_time)
        gemm_int8 = None
        if int8:
            rows = max(32, (2 * batch + 7) // 8 * 8)  # torch._int_mm wants M > 16; the CPU int8 path uses 2B rows
            xi = torch.randint(-127, 128, (rows, hidden), dtype=torch.int8, generator=gen)
            wi = torch.randint(-127, 128, (hidden, hidden), dtype=torch.int8, generator=gen)
            gemm_int8 = threads * 2.0 * rows * hidden * hidden / _seconds(
                lambda: torch._int_mm(xi, wi), 21, time.thread_time)
    finally:
        torch.set_num_threads(threads)
    return Machine(bandwidth=bandwidth, gemm_fp32=gemm_fp32, gemm_int8=gemm_int8)


def report(achieved_ms: dict[str, float], costs: dict[str, Cost], machine: Machine,
           weights: str = "fp32") -> dict[str, Any]:
    """Per component (and ``total``): achieved ms, floor ms, achieved / floor, MB read, GFLOP."""
    floor_s = floors(costs, machine, weights)
    rows: dict[str, Any] = {}
    for name in (*COMPONENTS, "total"):
        achieved = achieved_ms["total"] if name == "total" else achieved_ms[name]
        cost = (Cost(sum(c.bytes for c in costs.values()), sum(c.flops for c in costs.values()))
                if name == "total" else costs[name])
        floor_ms = floor_s[name] * 1e3
        rows[name] = {
            "achieved_ms": achieved, "floor_ms": floor_ms,
            "achieved_over_floor": achieved / floor_ms if floor_ms > 0 else None,
            "floor_fraction": floor_ms / achieved if achieved > 0 else None,
            "mb_read": cost.bytes / 1e6, "gflop": cost.flops / 1e9,
            "bound": None if floor_ms == 0 else (
                "memory" if cost.bytes / machine.bandwidth >= cost.flops / machine.gemm_rate(weights) else "compute"),
        }
    return rows


def format_table(rows: dict[str, Any]) -> str:
    lines = [f"{'component':<12}{'achieved ms':>12}{'floor ms':>10}{'x floor':>9}{'MB read':>10}"
             f"{'GFLOP':>8}  bound"]
    for name, r in rows.items():
        ratio = f"{r['achieved_over_floor']:.2f}" if r["achieved_over_floor"] is not None else "-"
        lines.append(f"{name:<12}{r['achieved_ms']:>12.1f}{r['floor_ms']:>10.1f}{ratio:>9}"
                     f"{r['mb_read']:>10.1f}{r['gflop']:>8.2f}  {r['bound'] or '-'}")
    return "\n".join(lines)
