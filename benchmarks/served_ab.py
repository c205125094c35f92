"""``gridserve bench served-ab``: served W from two source trees, alternating B A B A B A.

Does a change regress served throughput? Each tree (``--before``, ``--after``) is a full gridserve
checkout with its own ``.venv`` (``make install`` in that tree). Each run starts that tree's
``gridserve serve`` on the same model (default: the default model's GGUF, SmolLM2-135M-Instruct
Q4_1, from this process's install) with its own interpreter, from its own folder, in its own process
group; waits for its ``gridserve ready`` line; measures served W (docs/benchmarks: 256 requests at
once, prompts 64-256 tokens, outputs 32-256, ``ignore_eos``, greedy) with ``bench default-model``'s
client (``_served_w``, from this process's package: both trees get the same client); then stops it
(SIGTERM, then SIGKILL of the group). The trees alternate, before first, so slow drift in the
machine's load falls on both alike.

Per run: the tree, output tok/s, median TTFT and TPOT, the load average at its start. Summary: each
tree's median output tok/s and their after / before ratio, and the median of the paired ratios (run
i of after over run i of before). Each server's log is kept (``--log-dir``).

    .venv/bin/python benchmarks/served_ab.py --before /tmp/ab_before --after /tmp/ab_after --runs 3 \\
        --output-json /tmp/served_ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TREES = ("before", "after")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", required=True, help="the baseline checkout (with its own .venv)")
    parser.add_argument("--after", required=True, help="the changed checkout (with its own .venv)")
    parser.add_argument("--runs", type=int, default=3, help="runs per tree, alternating before / after")
    parser.add_argument("--model", default=None, help="model file both trees serve (default: the default GGUF)")
    parser.add_argument("--num-prompts", type=int, default=256, help="W's requests, all submitted at once")
    parser.add_argument("--input-lens", default="64-256", metavar="MIN-MAX")
    parser.add_argument("--output-lens", default="32-256", metavar="MIN-MAX")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=6 << 30)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a start or a W request may take")
    parser.add_argument("--log-dir", default=None, help="each server's log and each tree's built kernels go "
                        "here (default: a new temp folder, kept)")
    parser.add_argument("--output-json", default=None, help="write the results here")


def _python(tree: Path) -> Path:
    python = tree / ".venv" / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"{python} is missing: run `make install` in {tree}")
    return python


@contextlib.contextmanager
def served_from(tree: Path, model: str, extra: list[str], log: Path, extensions_dir: Path,
                timeout: float) -> Iterator[str]:
    """``tree``'s ``gridserve serve model`` until the block ends: yields its base URL.

    ``bench default-model``'s ``served`` runs this interpreter's gridserve; here the tree's own
    interpreter runs from the tree (``-m`` puts the working folder first on ``sys.path``), with the
    tree's own torch-extensions folder (its C++ kernels may differ), and its output goes to ``log``.
    """
    venv_bin = str(tree / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"VIRTUAL_ENV": str(tree / ".venv"), "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
            "TORCH_EXTENSIONS_DIR": str(extensions_dir)}
    with logged_server(str(_python(tree)), model, extra, log, timeout, cwd=tree, env=env) as url:
        yield url


@contextlib.contextmanager
def logged_server(python: str, model: str, extra: list[str], log: Path, timeout: float,
                  **popen: Any) -> Iterator[str]:
    """``python -m gridserve.cli serve model`` on a free port, its output in ``log``, until the block
    ends: yields its base URL once its ``gridserve ready`` line is there; stopped with SIGTERM, then
    SIGKILL of its process group. ``popen``: ``cwd`` / ``env`` for the server."""
    from gridserve.launcher import free_port

    port = free_port()
    cmd = [python, "-m", "gridserve.cli", "serve", model, "--port", str(port), *extra]
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True, **popen)
    try:
        start = time.perf_counter()
        while "gridserve ready" not in log.read_text(errors="replace"):
            if server.poll() is not None or time.perf_counter() - start > timeout:
                raise RuntimeError(f"{' '.join(cmd)} did not get ready (exit {server.poll()}); its log: {log}")
            time.sleep(0.5)
        logger.info("  ready in %.1f s", time.perf_counter() - start)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # whatever of the group outlived the leader
        server.wait()


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def run(args: argparse.Namespace) -> int:
    from gridserve.benchmarks.default_model_bench import _served_w
    from gridserve.default_model import default_model_file

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per request
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for tree in trees.values():
        _python(tree)
    model = args.model or str(default_model_file())
    extra = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    w_args = argparse.Namespace(num_prompts=args.num_prompts, input_lens=args.input_lens,
                                output_lens=args.output_lens, timeout=args.timeout)
    result: dict = {"benchmark": "served-ab", "model": model, "trees": {k: str(v) for k, v in trees.items()},
                    "commits": {k: _commit(v) for k, v in trees.items()}, "cpus": os.cpu_count(),
                    "workload": vars(w_args), "serve_args": extra, "runs": []}
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gridserve-served-ab-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result["log_dir"] = str(log_dir)
    logger.info("server logs: %s", log_dir)
    for i in range(args.runs):
        for name in TREES:
            load = os.getloadavg()
            logger.info("run %d %s (%s), load %.2f", i + 1, name, trees[name], load[0])
            log = log_dir / f"serve-{i + 1}-{name}.log"
            with served_from(trees[name], model, extra, log, log_dir / f"torch-extensions-{name}",
                             args.timeout) as url:
                w = _served_w(url, model, w_args)
            row = {"run": i + 1, "tree": name, "output_tok_s": round(w["output_throughput"], 1),
                   "median_ttft_ms": round(w["median_ttft_ms"], 1), "median_tpot_ms": round(w["median_tpot_ms"], 2),
                   "load_avg_at_start": [round(x, 2) for x in load], "served_w": w}
            result["runs"].append(row)
            logger.info("  %.1f output tok/s, TTFT %.0f ms, TPOT %.1f ms (%d completed, %d failed)",
                        row["output_tok_s"], row["median_ttft_ms"], row["median_tpot_ms"], w["completed"], w["failed"])
    result["summary"] = _summary(result["runs"])
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _summary(runs: list[dict]) -> dict:
    tok_s = {name: [r["output_tok_s"] for r in runs if r["tree"] == name] for name in TREES}
    medians = {name: _median(v) for name, v in tok_s.items()}
    paired = [round(a / b, 4) for b, a in zip(tok_s["before"], tok_s["after"])]
    summary = {"median_output_tok_s": medians,
               "ratio_after_over_before": round(medians["after"] / medians["before"], 4) if tok_s["before"] else None,
               "paired_ratios": paired, "median_paired_ratio": round(statistics.median(paired), 4) if paired else None}
    for name in TREES:
        summary[f"median_ttft_ms_{name}"] = _median([r["median_ttft_ms"] for r in runs if r["tree"] == name])
        summary[f"median_tpot_ms_{name}"] = _median([r["median_tpot_ms"] for r in runs if r["tree"] == name])
    return summary


def _commit(tree: Path) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    # Run as a script, this folder would come first on sys.path, and its modules (datasets, metrics,
    # serve, ...) would shadow installed packages of those names.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.exit(main())
