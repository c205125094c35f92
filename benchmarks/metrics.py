"""The arithmetic of ``gridserve bench serve``: per-request latencies and the run's summary.

Definitions (those of vLLM's serving benchmark), for one streamed request, with every time
measured by the client from the moment the request was sent:

``TTFT``  time to the first content chunk: a completions chunk with a choice (its text may be
          empty: a token that does not end a character yet), a chat chunk whose delta has text
          (not the role-only chunk a chat stream may open with).
``ITL``   the gaps between consecutive content chunks (inter-token latency); a run's ITL
          statistics are over all gaps of all successful requests together.
``E2E``   end-to-end latency: time to the end of the stream.
``TPOT``  time per output token after the first: ``(E2E - TTFT) / (output_tokens - 1)``, for
          requests with at least two output tokens.

``output_tokens`` is the ``usage.completion_tokens`` the server reports in its last chunk
(``stream_options.include_usage``), or else the number of content chunks. Throughputs divide by
the run's wall duration (first request sent to last stream ended): completed requests per
second, output tokens per second and (prompt + output) tokens per second. Only successful requests
count in the throughputs and latencies; failed ones are counted apart, with their errors.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

#: The latency metrics of a summary, each as ``{mean,median,std,p99}_<name>_ms`` (vLLM's keys).
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STATISTICS = ("mean", "median", "std", "p99")


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds; ``chunk_times`` and ``latency`` count
    from the moment the request was sent, ``sent_at`` from the start of the run."""

    prompt_len: int  # the dataset's prompt length (tokens, or an estimate for text prompts)
    output_len: int  # the wanted output length (``max_tokens``)
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    latency: float = 0.0
    usage_prompt_tokens: Optional[int] = None
    usage_output_tokens: Optional[int] = None
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float:
        return self.chunk_times[0]

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def output_tokens(self) -> int:
        return self.usage_output_tokens if self.usage_output_tokens is not None else len(self.chunk_times)

    @property
    def input_tokens(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_len

    @property
    def tpot(self) -> Optional[float]:
        """Seconds per output token after the first; ``None`` with fewer than two tokens."""
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between the two nearest ranks (numpy's default);
    ``nan`` for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def statistics(values: Sequence[float]) -> dict[str, float]:
    """Mean, median, population standard deviation and p99 of ``values`` (``nan`` when empty)."""
    if not values:
        return dict.fromkeys(STATISTICS, math.nan)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {"mean": mean, "median": percentile(values, 50), "std": std, "p99": percentile(values, 99)}


def latency_samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Each latency metric's samples (seconds) over the successful requests."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """The run's figures under vLLM's names: counts, token totals, throughputs (per second of
    ``duration_s``) and ``{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms``."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)

    def per_second(x: float) -> float:
        return x / duration_s if duration_s > 0 else math.nan

    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
    }
    for name, samples in latency_samples(results).items():
        for stat, value in statistics(samples).items():
            summary[f"{stat}_{name}_ms"] = value * 1000
    summary["errors"] = dict(Counter(r.error for r in results if not r.success).most_common(5))
    return summary


def summarize_probes(results: Sequence[RequestResult], rate: float) -> dict[str, Any]:
    """The latency probe's figures: short requests sent at ``rate`` per second while the load ran
    (``probe_sent``, ``probe_completed``, ``probe_failed``) and their TTFT as
    ``{mean,median,std,p99}_probe_ttft_ms`` and ``max_probe_ttft_ms`` (successful probes only)."""
    ttfts = [r.ttft for r in results if r.success]
    summary: dict[str, Any] = {"probe_rate": rate, "probe_sent": len(results), "probe_completed": len(ttfts),
                               "probe_failed": len(results) - len(ttfts)}
    for stat, value in statistics(ttfts).items():
        summary[f"{stat}_probe_ttft_ms"] = value * 1000
    summary["max_probe_ttft_ms"] = max(ttfts) * 1000 if ttfts else math.nan
    summary["probe_errors"] = dict(Counter(r.error for r in results if not r.success).most_common(5))
    return summary


_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def format_report(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The summary as a two-column text table (vLLM's layout)."""
    width = 50
    rows: list[str] = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{label:<{width - 12}}{text:>12}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for name in LATENCY_METRICS:
        rows.append(f" {_TITLES[name]} ".center(width, "-"))
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms):",
                summary[f"{stat}_{name}_ms"])
    for error, count in summary.get("errors", {}).items():
        rows.append(f"failed x{count}: {error}")
    if "probe_sent" in summary:
        rows.append(f" Latency probe ({summary['probe_rate']:g}/s) ".center(width, "-"))
        row("Probes sent / completed:", f"{summary['probe_sent']} / {summary['probe_completed']}")
        for stat in ("median", "p99", "max"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} probe TTFT (ms):",
                summary[f"{stat}_probe_ttft_ms"])
        for error, count in summary.get("probe_errors", {}).items():
            rows.append(f"probe failed x{count}: {error}")
    spec = summary.get("spec_decode")
    if spec is not None:
        rows.append(" Speculative decoding ".center(width, "-"))
        row("Drafts / draft tokens / accepted:", f"{spec['drafts']} / {spec['draft_tokens']} / {spec['accepted_tokens']}")
        row("Acceptance rate:", "-" if spec["acceptance_rate"] is None else spec["acceptance_rate"])
        row("Accepted per draft position:", " ".join(f"{v:.2f}" for v in spec["accepted_per_position"]) or "-")
    rows.append("=" * width)
    return "\n".join(rows)


_SWEEP_COLUMNS = (
    ("concurrency", "max_concurrency", "{}"), ("completed", "completed", "{}"), ("failed", "failed", "{}"),
    ("seconds", "duration", "{:.1f}"), ("req/s", "request_throughput", "{:.2f}"),
    ("output tok/s", "output_throughput", "{:.1f}"), ("total tok/s", "total_token_throughput", "{:.1f}"),
    ("TTFT median ms", "median_ttft_ms", "{:.0f}"), ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"),
    ("TPOT median ms", "median_tpot_ms", "{:.1f}"), ("TPOT p99 ms", "p99_tpot_ms", "{:.1f}"),
    ("ITL median ms", "median_itl_ms", "{:.1f}"), ("E2E median ms", "median_e2el_ms", "{:.0f}"),
)


def format_sweep_table(runs: Sequence[dict[str, Any]]) -> str:
    """One Markdown table row per run (a concurrency sweep), the columns the README shows."""
    lines = ["| " + " | ".join(title for title, _, _ in _SWEEP_COLUMNS) + " |",
             "|" + "---|" * len(_SWEEP_COLUMNS)]
    for run in runs:
        lines.append("| " + " | ".join(_cell(run, key, fmt) for _, key, fmt in _SWEEP_COLUMNS) + " |")
    return "\n".join(lines)


def _cell(run: dict[str, Any], key: str, fmt: str) -> str:
    value = run.get(key)
    if value is None:
        return "unlimited" if key == "max_concurrency" else "-"
    return fmt.format(value)
