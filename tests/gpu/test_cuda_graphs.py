"""Decode-step CUDA graphs on a real GPU (skipped without one; run by ``benchmarks/gpu_check.sh``):

* greedy outputs token-exact with ``enforce_eager=True`` for three architectures and batch sizes from
  1 to 256 (padding rows, bucketing and the static buffers under real capture / replay);
* ``test_decode_step_time_eager_vs_graphs`` times one decode step (``ModelRunner.execute_model``:
  inputs, forward, sampling) eager vs graphs at batch 1, 8, 64 and 256 on llama-base (12 layers) and
  prints the ratio; with ``$OUT`` set it also writes ``$OUT/cuda_graphs_timing.json``.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="the Triton interpreter is on: these tests compile for the GPU"),
]

BATCHES = [1, 3, 8, 17, 64, 129, 256]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 4000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def _runner_of(llm):
    worker = getattr(llm.llm_engine.core.executor, "worker", None)
    return getattr(worker, "runner", None)


def _generate_all(path: str, enforce_eager: bool):
    """Greedy outputs for every batch in ``BATCHES`` (one LLM, each batch a ``generate`` call: its
    decode steps run that many requests) and the graph sizes captured (``None``: eager / unreachable)."""
    from gridserve import LLM, SamplingParams

    llm = LLM(model=path, device="cuda", kv_cache_memory_bytes=512 << 20, max_num_seqs=256,
              max_num_batched_tokens=4096, enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    outs = {}
    for batch in BATCHES:
        prompts = [{"prompt_token_ids": p} for p in _prompts(batch, seed=batch)]
        outs[batch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = _runner_of(llm)
    captured = sorted(runner.cuda_graphs.graphs) if runner is not None and runner.cuda_graphs is not None else None
    del llm, runner
    torch.cuda.empty_cache()
    return outs, captured


@pytest.mark.parametrize("arch", ["llama_tiny", "qwen2_tiny", "opt_tiny"])
def test_graphs_are_token_exact_with_eager(arch, request):
    path = str(request.getfixturevalue(arch))
    eager, none = _generate_all(path, enforce_eager=True)
    graphs, captured = _generate_all(path, enforce_eager=False)
    assert none is None
    print(f"{arch}: graph sizes captured {captured}")
    if captured is not None:  # the in-process worker is reachable: graphs were really used
        assert captured, f"{arch}: no decode step went through a graph"
    for batch in BATCHES:
        bad = [i for i, (a, b) in enumerate(zip(eager[batch], graphs[batch])) if a != b]
        assert not bad, f"{arch} batch {batch}: prompts {bad} differ from eager (captured sizes {captured})"


def _cuda_runner(path: str, enforce_eager: bool, max_seqs: int):
    from gridserve.services.worker.model_runner import ModelRunner
    from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
    from gridserve.shared.config import GridserveConfig
    from gridserve.shared.kv_cache_spec import single_group

    set_parallel_state(ParallelState.single())
    config = GridserveConfig.from_kwargs(model=path, device="cuda", max_num_seqs=max_seqs, max_model_len=512,
                                         enforce_eager=enforce_eager).finalize()
    runner = ModelRunner(config, torch.device("cuda"))
    runner.load_model()
    runner.initialize_cache(single_group(1 + max_seqs * (512 // config.cache.block_size), config.cache.block_size))
    return runner


def _time_decode(runner, batch: int, steps: int = 30) -> float:
    """Median seconds of one decode step of ``batch`` requests (64-token prompts)."""
    from gridserve.shared.sampling_params import SamplingParams
    from gridserve.shared.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    runner.requests.clear()
    per = 512 // runner.block_size
    reqs = [NewRequestData(f"t{i}", [5 + i % 100] * 64, SamplingParams(temperature=0.0, max_tokens=1 << 10),
                           [list(range(1 + i * per, 1 + (i + 1) * per))], 0) for i in range(batch)]
    n = {r.req_id: 64 for r in reqs}
    runner.execute_model(SchedulerOutput(scheduled_new_reqs=reqs, num_scheduled_tokens=n,
                                         total_num_scheduled_tokens=64 * batch))
    times = []
    for step in range(steps + 5):
        cached = [CachedRequestData(r.req_id, [[]], len(runner.requests[r.req_id].token_ids) - 1) for r in reqs]
        sched = SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={c.req_id: 1 for c in cached},
                                total_num_scheduled_tokens=batch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.execute_model(sched)
        torch.cuda.synchronize()
        if step >= 5:  # the first steps capture / warm up
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def test_decode_step_time_eager_vs_graphs():
    from gridserve.demo.recipe import ensure_checkpoint

    path = str(ensure_checkpoint("llama", "base"))
    rows = []
    eager, graphs = _cuda_runner(path, True, 256), _cuda_runner(path, False, 256)
    for batch in (1, 8, 64, 256):
        t_eager, t_graph = _time_decode(eager, batch), _time_decode(graphs, batch)
        rows.append({"batch": batch, "eager_ms": t_eager * 1e3, "graphs_ms": t_graph * 1e3,
                     "speedup": t_eager / t_graph})
        print(f"llama-base decode step, batch {batch:3d}: eager {t_eager * 1e3:.3f} ms, graphs "
              f"{t_graph * 1e3:.3f} ms, x{t_eager / t_graph:.2f}")
    assert graphs.cuda_graphs is not None and graphs.cuda_graphs.graphs
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "cuda_graphs_timing.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": "llama-base (recipe)", "rows": rows}, f,
                      indent=1)
