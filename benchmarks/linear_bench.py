"""Micro-benchmark of fp32 ``F.linear`` against the prepacked-weight linears this torch offers.

    python -m gridserve.benchmarks.linear_bench                       # llama-base shapes, M 1..2048
    python -m gridserve.benchmarks.linear_bench --rows 256 --repeats 9 --output-json lin.json

Per (M, N, K), the median (``--stat min``: fastest) milliseconds of:

- ``F.linear``: MKL sgemm on the plain ``[N, K]`` weight (what the model runs today);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once by
  ``torch.ops.mkldnn._reorder_linear_weight`` (oneDNN's blocked layout; any M);
- ``onednn_m``: the same, reordered with M as the batch-size hint;
- ``mkl_packed``: ``torch.ops.mkl._mkl_linear`` on ``torch.ops.mkl._mkl_reorder_linear_weight``'s
  packed copy, packed for exactly this M (MKL's packed GEMM serves only the M it was packed for).

The calls are interleaved round by round, so load on a shared machine hits them alike; the load
average is printed before and after. Each packed form's largest difference from ``F.linear``
(relative to the output's largest magnitude) is reported too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

# llama-base (hidden 768, MLP 2048, vocab 32000): fused QKV, o_proj, fused gate/up, down, LM head.
SHAPES = {"qkv": (2304, 768), "o_proj": (768, 768), "gate_up": (4096, 768), "down": (768, 2048),
          "lm_head": (32000, 768)}
ROWS = [1, 16, 64, 256, 2048]


def _calls(x: torch.Tensor, w: torch.Tensor, m: int, methods: list[str]) -> dict:
    calls = {"F.linear": functools.partial(F.linear, x, w)}
    if "onednn" in methods:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        calls["onednn"] = functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")
    if "onednn_m" in methods:
        packed_m = torch.ops.mkldnn._reorder_linear_weight(w, m)
        calls["onednn_m"] = functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed_m, None, "none", [], "")
    if "mkl_packed" in methods:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        calls["mkl_packed"] = functools.partial(torch.ops.mkl._mkl_linear, x, mkl, w, None, m)
    return calls


def bench(rows: list[int], shapes: dict[str, tuple[int, int]], repeats: int, methods: list[str],
          stat: str = "median") -> list[dict]:
    pick = min if stat == "min" else statistics.median
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.02
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            calls = _calls(x, w, m, methods)
            ref = calls["F.linear"]()
            scale = ref.abs().max().item()
            err = {key: (fn() - ref).abs().max().item() / scale for key, fn in calls.items() if key != "F.linear"}
            for fn in calls.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {key: [] for key in calls}
            for _ in range(repeats):
                for key, fn in calls.items():
                    start = time.perf_counter()
                    fn()
                    times[key].append((time.perf_counter() - start) * 1e3)
            ms = {key: pick(t) for key, t in times.items()}
            results.append({"layer": name, "m": m, "n": n, "k": k, "ms": ms,
                            "speedup": {key: ms["F.linear"] / v for key, v in ms.items() if key != "F.linear"},
                            "max_rel_diff": err})
            del calls
    return results


def _print(results: list[dict], methods: list[str]) -> None:
    head = f"{'layer':8} {'M':>5} {'N':>6} {'K':>5} {'F.linear ms':>12}"
    for key in methods:
        head += f" {key + ' ms':>14} {'x':>5}"
    print(head)
    for r in results:
        line = f"{r['layer']:8} {r['m']:5d} {r['n']:6d} {r['k']:5d} {r['ms']['F.linear']:12.3f}"
        for key in methods:
            line += f" {r['ms'][key]:14.3f} {r['speedup'][key]:5.2f}"
        print(line)
    worst = {key: max(r["max_rel_diff"][key] for r in results) for key in methods}
    print("largest |packed - F.linear| / max|F.linear|:", {k: f"{v:.1e}" for k, v in worst.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="batch rows M")
    parser.add_argument("--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--methods", nargs="+", default=["onednn", "onednn_m", "mkl_packed"],
                        choices=["onednn", "onednn_m", "mkl_packed"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="min: the fastest call of each (the least disturbed by other load)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load_before[0]:.2f}")
    results = bench(args.rows, {k: SHAPES[k] for k in args.layers}, args.repeats, args.methods, args.stat)
    load_after = os.getloadavg()
    _print(results, args.methods)
    print(f"load average after: {load_after[0]:.2f}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "stat": args.stat,
                       "load_before": load_before[0], "load_after": load_after[0], "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
