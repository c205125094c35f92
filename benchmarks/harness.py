"""What the micro-benchmark commands share: the interleaved timing loop and the standalone entry
point.

Timing: ``interleaved`` runs every call of a dict once per round, in turn, ``repeats`` rounds of
``inner`` calls a sample, so that load on a shared machine (a neighbour's work, a frequency step)
hits every call alike; the callers take the median (or the fastest) of each call's samples.
``per_call_s`` is one sample; ``calls_per_sample`` sizes ``inner`` from one timed call.

Served runs: ``post_completion`` sends one non-streamed ``/v1/completions`` body and
``metric_sums`` sums chosen Prometheus samples of a role's ``/metrics``.

Entry point: ``standalone`` builds a command's parser as ``gridserve bench NAME`` would (the module
docstring as its description) for ``python -m gridserve.benchmarks.MODULE``.

Import-light like the package: the standard library only (``prometheus_client``, which every
role depends on, imported by ``metric_sums`` when called).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any


def per_call_s(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call of ``fn``, over ``inner`` calls in a row."""
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def calls_per_sample(fn: Callable[[], object], sample_s: float) -> int:
    """How many calls of ``fn`` take about ``sample_s`` seconds, by one timed call (at least 1)."""
    return max(1, int(sample_s / max(per_call_s(fn, 1), 1e-6)))


def interleaved(calls: dict[str, Callable[[], object]], repeats: int, inner: int, *,
                warmup: bool) -> dict[str, list[float]]:
    """Per call name, ``repeats`` samples of seconds per call (each ``inner`` calls long), the calls
    taking turns within every round. ``warmup``: call each once first (untimed)."""
    if warmup:
        for fn in calls.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            samples[name].append(per_call_s(fn, inner))
    return samples


def standalone(doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """Parse ``argv`` with the command's own arguments (``doc``: the help's description); run it."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def post_completion(base_url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """``POST base_url/v1/completions`` with ``body`` (not streamed); the response's JSON."""
    request = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def metric_sums(metrics_address: str, names: dict[str, str]) -> dict[str, float]:
    """The samples of a role's Prometheus ``/metrics`` at ``metrics_address`` (host:port) whose name
    is a key of ``names``, summed over their labels under the value's name (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = dict.fromkeys(names.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[names[sample.name]] += sample.value
    return out
