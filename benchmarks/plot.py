"""``gridserve bench plot``: throughput and latency against concurrency, from ``bench serve`` JSON.

Each results file is one series (its ``label``); each of its runs is one point at its
``max_concurrency`` (a run without a limit sits at its number of prompts: all at once). A file
holding a single flat result (vLLM's ``benchmark_serving`` JSON) is read as one run.
matplotlib is imported only here, and only when a plot is drawn (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gridserve.shared.errors import GridserveError

logger = logging.getLogger(__name__)

#: (panel title, [(summary key, line style, legend suffix)]) in reading order.
PANELS = (
    ("output throughput (tok/s)", [("output_throughput", "-", "")]),
    ("time to first token (ms)", [("median_ttft_ms", "-", " median"), ("p99_ttft_ms", "--", " p99")]),
    ("time per output token (ms)", [("median_tpot_ms", "-", " median"), ("p99_tpot_ms", "--", " p99")]),
    ("end-to-end latency (ms)", [("median_e2el_ms", "-", " median"), ("p99_e2el_ms", "--", " p99")]),
)


class PlotDependencyError(GridserveError, ImportError):
    """matplotlib is not installed."""


def load_reports(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The results files as ``bench serve`` reports (a flat vLLM result becomes one run)."""
    reports = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a results file ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a results file (expected a JSON object)")
        if "runs" not in data:
            data = {"label": Path(path).stem, "runs": [data]}
        data.setdefault("label", Path(path).stem)
        reports.append(data)
    return reports


def series(report: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    """``key`` against concurrency over a report's runs, sorted by concurrency, missing values out."""
    points = []
    for run in report["runs"]:
        value = run.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        points.append((run.get("max_concurrency") or run.get("num_prompts") or 0, value))
    points.sort()
    return [x for x, _ in points], [y for _, y in points]


def plot_reports(reports: Sequence[dict[str, Any]], output: str) -> Path:
    """Draw the four panels of :data:`PANELS` for every report into a PNG at ``output``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotDependencyError("the plot needs matplotlib: pip install 'gridserve[bench]'") from None
    figure = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2).flatten()
    xs_all: set[int] = set()
    for ax, (title, lines) in zip(axes, PANELS):
        for i, report in enumerate(reports):
            color = f"C{i}"
            for key, style, suffix in lines:
                xs, ys = series(report, key)
                xs_all.update(xs)
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{report['label']}{suffix}")
        ax.set_title(title)
        ax.set_xlabel("max concurrency (requests in flight)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes:
        ax.set_xticks(sorted(xs_all), [str(x) for x in sorted(xs_all)])
    figure.suptitle(_title(reports[0]))
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def _title(report: dict[str, Any]) -> str:
    w = report.get("workload")
    if not w:
        return "gridserve bench serve"
    per_point = (report.get("config") or {}).get("prompts_per_concurrency")
    count = (f"up to {w['num_prompts']} requests ({per_point} x concurrency per point)" if per_point
             else f"{w['num_prompts']} requests")
    return (f"{count}, prompts {w['prompt_len_min']}-{w['prompt_len_max']} tokens, "
            f"outputs {w['output_len_min']}-{w['output_len_max']} tokens"
            f"{' (ignore_eos)' if w.get('ignore_eos') else ''}, {report.get('endpoint', '')}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``gridserve bench plot``."""
    parser.add_argument("results", nargs="+", help="bench serve --output-json files (one series each)")
    parser.add_argument("-o", "--output", default="benchmarks/results/serve.png", help="PNG to write")


def run(args: argparse.Namespace) -> int:
    path = plot_reports(load_reports(args.results), args.output)
    logger.info("wrote %s", path)
    return 0
