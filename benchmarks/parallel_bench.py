"""Per-step cost of tensor parallelism on this machine, and the all-reduce time inside a step.

    gridserve bench parallel --size small --batch 8 --max-tokens 32
    gridserve bench parallel --size base --layouts 1x1,2x1,1x2

Part 1 runs the same greedy requests through ``LLM`` once per layout (``TPxPP``; every layout's
workers are local processes behind the gRPC executor, gloo between them) and reports the wall time
per decode round (batch wall time / output tokens per request; prefill included). Part 2 starts two gloo processes and times one
all-reduce of a decode step's activations (``batch x hidden`` fp32) and the logits gather; a TP
step does ``2 x layers + 1`` such all-reduces (attention and MLP outputs, the embedding) plus one
gather. One run; the machine is shared and noisy, so read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def round_time(model: str, tp: int, pp: int, batch: int, max_tokens: int) -> float:
    """Seconds per decode round (every request advances one token): the batch's wall time / max_tokens.

    Every layout runs its workers as processes behind the gRPC executor (TP=1 too), so the only
    difference is the split: one worker with all cores, or TP x PP workers with a share each.
    """
    from gridserve import LLM, SamplingParams
    from gridserve.launcher import Launcher

    workers = Launcher(model, [], tensor_parallel_size=tp, pipeline_parallel_size=pp)
    addresses = workers.start_workers()
    try:
        llm = LLM(model, kv_cache_memory_bytes=256 << 20, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  worker_addresses=addresses)
        try:
            llm.generate([[7, 8, 9]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
            prompts = [{"prompt_token_ids": [100 + i, 200 + i, 300 + i, 400 + i]} for i in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return (time.perf_counter() - start) / max_tokens
        finally:
            llm.shutdown()
    finally:
        workers.stop()


def collective_times(rank: int, port: int, batch: int, hidden: int, vocab: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(batch, hidden)
    logits = torch.randn(batch, vocab // 2)
    parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
    result = {}
    for name, op in (("all_reduce", lambda: dist.all_reduce(x)),
                     ("gather_logits", lambda: dist.gather(logits, parts, dst=0))):
        for _ in range(10):
            op()
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            op()
            samples.append(time.perf_counter() - start)
        result[name] = statistics.median(samples)
    dist.destroy_process_group()
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="small", help="recipe llama size (tiny, small, base)")
    parser.add_argument("--layouts", default="1x1,2x1", help="TPxPP layouts to time")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--collective-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the recipe's checkpoints are local
    from gridserve.demo.recipe import ensure_checkpoint

    model = ensure_checkpoint("llama", args.size)
    hf = json.loads((model / "config.json").read_text())
    if args.collective_rank is not None:
        out = collective_times(args.collective_rank, args.port, args.batch, hf["hidden_size"],
                               hf["vocab_size"], args.repeats)
        if args.collective_rank == 0:
            print(json.dumps(out))
        return 0

    print(f"llama-{args.size}: hidden {hf['hidden_size']}, {hf['num_hidden_layers']} layers, "
          f"vocab {hf['vocab_size']}; batch {args.batch}, {args.max_tokens} tokens, cores {os.cpu_count()}")
    baseline = None
    for layout in args.layouts.split(","):
        tp, pp = (int(v) for v in layout.split("x"))
        per_round = round_time(str(model), tp, pp, args.batch, args.max_tokens) * 1e3
        baseline = baseline or per_round
        print(f"TP={tp} PP={pp}: {per_round:.1f} ms per decode step (x{per_round / baseline:.2f} of the first layout)")

    from gridserve.launcher import free_port

    port = str(free_port())
    argv = [sys.executable, __file__, "--size", args.size, "--batch", str(args.batch),
            "--repeats", str(args.repeats), "--port", port, "--collective-rank"]
    peer = subprocess.Popen([*argv, "1"])
    out = json.loads(subprocess.run([*argv, "0"], capture_output=True, text=True, check=True).stdout)
    peer.wait()
    n = 2 * hf["num_hidden_layers"] + 1
    per_step = n * out["all_reduce"] + out["gather_logits"]
    print(f"gloo, 2 processes: all-reduce of {args.batch}x{hf['hidden_size']} fp32 "
          f"{out['all_reduce'] * 1e6:.0f} us, logits gather {out['gather_logits'] * 1e6:.0f} us; "
          f"per TP=2 step {n} all-reduces + 1 gather = {per_step * 1e3:.2f} ms")
    return 0


def main(argv: list[str] | None = None) -> int:  # also the collective ranks' entry (see run)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
