"""What ``gridserve bench peer`` runs and reports: its variants, the ratio per precision pair, the
tables, the JSON and the plot. Pure logic (no servers), so it is tested on its own.

A variant is one server setting measured on workload W:

``gridserve-fp32``            gridserve, fp32 weights and KV cache
``gridserve-bf16``            gridserve, ``--dtype bfloat16`` (bf16 weights and KV cache)
``gridserve-int8``            gridserve, ``--quantization int8 --kv-cache-dtype bfloat16``
``gridserve-int8-g32``        gridserve-int8 with int8 activations, one scale per 32 columns
                              (``INT8_G32``; ``bench quantization``'s mode ``int8-g32+kv-bf16``)
``gridserve-fp32-ngram``      gridserve-fp32 with n-gram speculation (``NGRAM_SPEC``; its
                              ``disable_by_batch_size`` default): W's check that speculation costs
                              nothing at a large batch (not a pair's ratio: the pair takes the
                              first gridserve variant listed)
``vllm-bf16``, ``vllm-fp32``  vLLM's CPU build (``vllm serve --dtype bfloat16|float32``)
``lcpp-<weights>-np<N>``      llama.cpp's ``llama-server`` with ``<weights>`` (f32, f16, q8_0) GGUF
                              weights, its default f16 KV cache and ``-np N`` slots
``lcpp-<weights>-kv<T>-np<N>`` the same with a ``T`` (f32, f16, q8_0) KV cache

Variants form precision pairs: ``fp32`` (gridserve-fp32 against vllm-fp32 and llama.cpp's f32
weights), ``bf16`` (gridserve-bf16 against vllm-bf16; llama.cpp has no bf16 CPU path here) and
``int8`` (gridserve-int8 against llama.cpp's q8_0 weights, and against vllm-bf16: vLLM's CPU build
has no int8 path for an unquantized checkpoint, bf16 is its fastest); llama.cpp's f16 weights have
no gridserve counterpart (pair ``f16``). A pair's ratios are gridserve's output throughput over the
best variant of each peer in it (llama.cpp's best ``-np`` setting; vLLM's variant).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from gridserve.shared.errors import GridserveError

GRIDSERVE = "gridserve"
LLAMA_CPP = "llama.cpp"
VLLM = "vllm"

#: gridserve-fp32-ngram's speculative config (the settings of ``bench spec-decode``).
NGRAM_SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'
#: gridserve-int8-g32's weights: int8, activations int8 per 32 columns (llama.cpp q8_0's scheme).
INT8_G32 = '{"method": "int8", "activation_group": 32}'
#: gridserve's variants: (pair, weights, KV cache dtype, extra engine flags).
GRIDSERVE_VARIANTS = {
    "gridserve-fp32": ("fp32", "fp32", "fp32", ()),
    "gridserve-fp32-ngram": ("fp32", "fp32", "fp32", ("--speculative-config", NGRAM_SPEC)),
    "gridserve-bf16": ("bf16", "bf16", "bfloat16", ("--dtype", "bfloat16")),
    "gridserve-int8": ("int8", "int8", "bfloat16", ("--quantization", "int8", "--kv-cache-dtype", "bfloat16")),
    "gridserve-int8-g32": ("int8", "int8", "bfloat16", ("--quantization-config", INT8_G32,
                                                        "--kv-cache-dtype", "bfloat16")),
}
#: llama.cpp's GGUF weight types and the pair each belongs to.
LLAMA_CPP_WEIGHTS = {"f32": "fp32", "f16": "f16", "q8_0": "int8"}
LLAMA_CPP_KV = ("f32", "f16", "q8_0")
#: vLLM's variants: (pair, weights and KV cache dtype).
VLLM_VARIANTS = {"vllm-bf16": ("bf16", "bf16"), "vllm-fp32": ("fp32", "fp32")}
#: The vLLM variant's pair each gridserve pair is compared with (int8: vLLM's fastest, bf16).
VLLM_PEER_PAIR = {"fp32": "fp32", "bf16": "bf16", "int8": "bf16"}
_LCPP = re.compile(r"lcpp-(?P<weights>f32|f16|q8_0)(?:-kv(?P<kv>f32|f16|q8_0))?-np(?P<slots>[0-9]+)")

DEFAULT_VARIANTS = ("gridserve-fp32", "lcpp-f32-np64", "lcpp-f32-np256",
                    "gridserve-int8", "lcpp-q8_0-np64", "lcpp-q8_0-np256")
PAIRS = ("fp32", "bf16", "int8", "f16")


class VariantError(GridserveError, ValueError):
    """A ``--variants`` entry that names no variant."""


@dataclass(frozen=True)
class Variant:
    """One server setting: which server, its precision pair, weights, KV cache and slots."""

    name: str
    server: str  # GRIDSERVE, VLLM or LLAMA_CPP
    pair: str
    weights: str
    kv: str
    slots: Optional[int] = None  # llama.cpp's -np
    engine_args: tuple[str, ...] = ()  # gridserve's extra engine flags


def parse_variant(name: str) -> Variant:
    """The variant ``name`` stands for (module docstring); a clear error naming the choices."""
    name = name.strip()
    if name in GRIDSERVE_VARIANTS:
        pair, weights, kv, flags = GRIDSERVE_VARIANTS[name]
        return Variant(name, GRIDSERVE, pair, weights, kv, engine_args=flags)
    if name in VLLM_VARIANTS:
        pair, dtype = VLLM_VARIANTS[name]
        return Variant(name, VLLM, pair, dtype, dtype)
    match = _LCPP.fullmatch(name)
    if match and int(match["slots"]) >= 1:
        weights = match["weights"]
        return Variant(name, LLAMA_CPP, LLAMA_CPP_WEIGHTS[weights], weights, match["kv"] or "f16",
                       slots=int(match["slots"]))
    raise VariantError(f"--variants: unknown variant {name!r}; expected {', '.join([*GRIDSERVE_VARIANTS, *VLLM_VARIANTS])} "
                       "or lcpp-<f32|f16|q8_0>[-kv<f32|f16|q8_0>]-np<N> (e.g. lcpp-q8_0-np64)")


def parse_variants(text: str) -> list[Variant]:
    """A comma-separated ``--variants`` list, in order, without repeats."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise VariantError("--variants: expected at least one variant")
    if len(set(names)) != len(names):
        raise VariantError(f"--variants: a variant is named twice in {text!r}")
    return [parse_variant(n) for n in names]


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """``"LO-HI"`` (or one number) as an inclusive range of lengths >= 1."""
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        lo, hi = 0, 0
    if not 1 <= lo <= hi:
        raise ValueError(f"{flag}: expected MIN-MAX with 1 <= MIN <= MAX (e.g. 32-256), got {text!r}")
    return lo, hi


# ---- ratios --------------------------------------------------------------------------------------


def _throughput(result: dict[str, Any]) -> float:
    run = result.get("run") or {}
    value = run.get("output_throughput")
    if value is None or (isinstance(value, float) and math.isnan(value)) or not run.get("completed"):
        return math.nan
    return value


def pair_ratios(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per precision pair with a gridserve variant in ``results`` (one dict per measured variant,
    ``variant`` its :class:`Variant` as a dict and ``run`` its ``bench serve`` summary): gridserve's
    output tok/s, llama.cpp's best variant of the pair and vLLM's variant for it (``VLLM_PEER_PAIR``),
    their tok/s, and gridserve's ratio over each (``ratio``: llama.cpp, ``vllm_ratio``: vLLM; ``None``
    when a side is missing or failed). A variant whose run failed entirely is nobody's best. A pair
    with peers but no gridserve variant (llama.cpp's f16) is listed with its best peer only."""
    rows = []
    for pair in PAIRS:
        ours = next((r for r in results if r["variant"]["pair"] == pair and r["variant"]["server"] == GRIDSERVE),
                    None)
        lcpp = _best(r for r in results if r["variant"]["pair"] == pair and r["variant"]["server"] == LLAMA_CPP)
        vllm = _best(r for r in results
                     if r["variant"]["server"] == VLLM and r["variant"]["pair"] == VLLM_PEER_PAIR.get(pair))
        if not any(r["variant"]["pair"] == pair for r in results):
            continue
        ours_tps = _throughput(ours) if ours else math.nan
        row: dict[str, Any] = {"pair": pair, "gridserve": ours["variant"]["name"] if ours else None,
                               "gridserve_tok_s": _or_none(ours_tps)}
        for key, ratio_key, best in (("llama_cpp", "ratio", lcpp), ("vllm", "vllm_ratio", vllm)):
            best_tps = _throughput(best) if best else math.nan
            row[f"{key}_best"] = best["variant"]["name"] if best else None
            row[f"{key}_tok_s"] = _or_none(best_tps)
            row[ratio_key] = None if math.isnan(ours_tps) or math.isnan(best_tps) else ours_tps / best_tps
        rows.append(row)
    return rows


def _best(results: Iterable[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The result with the highest output throughput, ignoring failed runs."""
    return max((r for r in results if not math.isnan(_throughput(r))), key=_throughput, default=None)


def _or_none(value: float) -> Optional[float]:
    return None if math.isnan(value) else value


def greedy_agreement(tokens: dict[str, list[list[int]]], reference: str = "gridserve-fp32",
                     compare: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """For every variant of ``compare`` (default: all) with greedy tokens, ``reference`` aside: how
    many of the prompts gave exactly ``reference``'s tokens, and where each other one first differs."""
    ref = tokens.get(reference)
    out: dict[str, Any] = {"reference": reference, "prompts": len(ref) if ref else 0, "variants": {}}
    if not ref:
        return out
    for name, theirs in tokens.items():
        if name == reference or (compare is not None and name not in compare):
            continue
        same = sum(a == b for a, b in zip(ref, theirs))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                      for a, b in zip(ref, theirs) if a != b]
        out["variants"][name] = {"identical": same, "of": len(ref), "first_difference_at": first_diff}
    return out


# ---- tables --------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = "{:.1f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return spec.format(value)


def variants_table(results: Sequence[dict[str, Any]]) -> str:
    """One Markdown row per measured variant."""
    lines = ["| variant | server | weights | KV | slots | completed / failed | output tok/s | TTFT median ms "
             "| TTFT p99 ms | probe TTFT median ms | probe TTFT p99 ms |", "|" + "---|" * 11]
    for r in results:
        v, run = r["variant"], r.get("run") or {}
        lines.append(
            f"| {v['name']} | {v['server']} | {v['weights']} | {v['kv']} | {v['slots'] or '-'} "
            f"| {run.get('completed', 0)} / {run.get('failed', '-')} | {_fmt(run.get('output_throughput'))} "
            f"| {_fmt(run.get('median_ttft_ms'), '{:.0f}')} | {_fmt(run.get('p99_ttft_ms'), '{:.0f}')} "
            f"| {_fmt(run.get('median_probe_ttft_ms'), '{:.0f}')} | {_fmt(run.get('p99_probe_ttft_ms'), '{:.0f}')} |")
    return "\n".join(lines)


def pairs_table(rows: Sequence[dict[str, Any]]) -> str:
    """One Markdown row per precision pair: gridserve against vLLM's and llama.cpp's best."""
    lines = ["| pair | gridserve | output tok/s | vLLM | output tok/s | gridserve / vLLM "
             "| llama.cpp best | output tok/s | gridserve / llama.cpp |", "|" + "---|" * 9]
    for p in rows:
        lines.append(f"| {p['pair']} | {p['gridserve'] or '-'} | {_fmt(p['gridserve_tok_s'])} "
                     f"| {p.get('vllm_best') or '-'} | {_fmt(p.get('vllm_tok_s'))} "
                     f"| {_fmt(p.get('vllm_ratio'), '**{:.2f}x**')} "
                     f"| {p['llama_cpp_best'] or '-'} | {_fmt(p['llama_cpp_tok_s'])} "
                     f"| {_fmt(p['ratio'], '**{:.2f}x**')} |")
    return "\n".join(lines)


CPU_ROLES = ("envoy", "gateway", "engine", "worker", "vllm", "llama-server", "client", "other")


def cpu_table(results: Sequence[dict[str, Any]]) -> str:
    """CPU seconds by process role during each variant's W run (share of the machine in brackets)."""
    lines = ["| variant | wall s | " + " | ".join(CPU_ROLES) + " |", "|" + "---|" * (len(CPU_ROLES) + 2)]
    for r in results:
        cpu = r.get("cpu")
        if not cpu:
            continue
        capacity = cpu["wall_s"] * cpu["cores"]
        cells = [f"{cpu['by_role'][k]:.1f} ({100 * cpu['by_role'][k] / capacity:.0f}%)" if k in cpu["by_role"]
                 else "-" for k in CPU_ROLES]
        lines.append(f"| {r['variant']['name']} | {cpu['wall_s']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def greedy_line(agreement: dict[str, Any]) -> str:
    """One line per compared variant: identical prompts out of all."""
    if not agreement["prompts"]:
        return f"greedy agreement: not checked ({agreement['reference']} not run)"
    parts = [f"{name} {a['identical']}/{a['of']}" for name, a in agreement["variants"].items()]
    return (f"greedy agreement with {agreement['reference']} (prompts with identical tokens): "
            + (", ".join(parts) if parts else "no other variant checked"))


def variant_dict(variant: Variant) -> dict[str, Any]:
    data = asdict(variant)
    data["engine_args"] = list(variant.engine_args)
    return data


# ---- plot ----------------------------------------------------------------------------------------


def plot_peer(report: dict[str, Any], output: str) -> Path:
    """Three bar panels per variant (grouped by pair): output tok/s (with each pair's ratio), TTFT
    median / p99 of W's requests, and the latency probe's TTFT median / p99."""
    from gridserve.benchmarks.plot import PlotDependencyError

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotDependencyError("the plot needs matplotlib: pip install 'gridserve[bench]'") from None
    results = report["variants"]
    names = [r["variant"]["name"] for r in results]
    palette = {GRIDSERVE: "C0", LLAMA_CPP: "C1", VLLM: "C2"}
    colors = [palette.get(r["variant"]["server"], "C7") for r in results]
    runs = [r.get("run") or {} for r in results]

    def values(key: str) -> list[float]:
        return [math.nan if run.get(key) is None else run[key] for run in runs]

    figure = Figure(figsize=(13, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    throughput, ttft, probe = figure.subplots(1, 3)
    xs = list(range(len(names)))
    throughput.bar(xs, values("output_throughput"), color=colors)
    ratios = "; ".join(
        f"{p['pair']}" + "".join(f" {peer} {p[key]:.2f}x" for peer, key in (("vLLM", "vllm_ratio"), ("llama.cpp", "ratio"))
                                 if p.get(key))
        for p in report.get("pairs", []) if p.get("ratio") or p.get("vllm_ratio"))
    throughput.set_title("output throughput (tok/s)" + (f"\ngridserve / peer: {ratios}" if ratios else ""))
    for ax, title, prefix in ((ttft, "W's TTFT (ms)", "ttft"), (probe, "latency probe's TTFT (ms)", "probe_ttft")):
        ax.bar([x - 0.2 for x in xs], values(f"median_{prefix}_ms"), width=0.4, color=colors, label="median")
        ax.bar([x + 0.2 for x in xs], values(f"p99_{prefix}_ms"), width=0.4, color=colors, alpha=0.5,
               hatch="//", label="p99")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    for ax in (throughput, ttft, probe):
        ax.set_xticks(xs, names, rotation=30, ha="right", fontsize="small")
        ax.grid(True, axis="y", alpha=0.3)
    w = report["workload"]
    figure.suptitle(f"{w['num_prompts']} requests at once, prompts {w['input_lens'][0]}-{w['input_lens'][1]} "
                    f"tokens, outputs {w['output_lens'][0]}-{w['output_lens'][1]} (ignore_eos); "
                    f"{Path(report['model']).name}; blue gridserve (Envoy), green vLLM, orange llama.cpp")
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
