"""Decode-step CUDA graphs' CPU-side bookkeeping (``services/worker/cuda_graphs.py``).

A fake "graph" records the function captured and re-runs it on replay, against the same static
buffers, so bucketing, padding, in-place buffer updates and output slicing run on the CPU. The GPU
side (token-exact vs eager, timings) is ``tests/gpu/test_cuda_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

from gridserve.services.worker.cuda_graphs import (
    CudaGraphRunner,
    capture_sizes,
    default_capture_sizes,
    uses_cuda_graphs,
)
from gridserve.services.worker.model_runner import ModelRunner
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import DeviceConfig, GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.kv_cache_spec import single_group
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

BLOCK = 16
BLOCKS_PER_SEQ = 4


class FakeGraph:
    """Records the captured closure; ``replay`` re-runs it (as a CUDA graph re-runs its kernels)."""

    captures = 0

    def __init__(self, pool) -> None:
        self.fn = None
        self.replays = 0

    def capture(self, fn):
        FakeGraph.captures += 1
        self.fn = fn
        return fn()

    def replay(self):
        self.replays += 1
        return self.fn()


# ---- sizes and bucketing ------------------------------------------------------------------
def test_default_sizes_are_vllm_like():
    assert default_capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert default_capture_sizes(4) == [1, 2, 4]
    assert default_capture_sizes(2000)[-1] == 512
    assert capture_sizes([8, 1, 4, 4, 600], 256) == [1, 4, 8]
    assert capture_sizes([], 16) == [1, 2, 4, 8, 16]


def test_padded_size_is_the_next_captured_size_and_none_beyond():
    g = CudaGraphRunner(lambda *a: None, [1, 2, 4, 8, 16], 1, 4, torch.device("cpu"), graph_factory=FakeGraph)
    assert [g.padded_size(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert g.padded_size(17) is None


def test_graphs_only_on_cuda_without_enforce_eager_or_batch_invariant():
    assert uses_cuda_graphs(torch.device("cuda"), False, False)
    assert not uses_cuda_graphs(torch.device("cuda"), True, False)
    assert not uses_cuda_graphs(torch.device("cuda"), False, True)
    assert not uses_cuda_graphs(torch.device("cpu"), False, False)


def test_config_fields():
    assert DeviceConfig().enforce_eager is False and DeviceConfig().cuda_graph_sizes == []
    assert DeviceConfig(cuda_graph_sizes="1, 2,8").cuda_graph_sizes == [1, 2, 8]
    with pytest.raises(ConfigError):
        DeviceConfig(cuda_graph_sizes=[0])
    with pytest.raises(ConfigError):
        DeviceConfig(enforce_eager="yes")


def test_options_reach_the_worker_config():
    import argparse

    from gridserve.roles import add_engine_arguments
    from gridserve.shared.rpc.worker_convert import config_from_pb, config_to_pb

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--enforce-eager", "--cuda-graph-sizes", "1,4,16"])
    assert args.enforce_eager and args.cuda_graph_sizes == "1,4,16"
    config = GridserveConfig.from_kwargs(model="m", enforce_eager=True, cuda_graph_sizes="1,4,16")
    back = config_from_pb(config_to_pb(config))
    assert back.device.enforce_eager is True and list(back.device.cuda_graph_sizes) == [1, 4, 16]


# ---- a whole ModelRunner on the tiny model -----------------------------------------------
def _runner(model_path, fake: bool, **kwargs) -> ModelRunner:
    set_parallel_state(ParallelState.single())
    config = GridserveConfig.from_kwargs(model=str(model_path), device="cpu", block_size=BLOCK,
                                         max_num_seqs=16, max_model_len=BLOCK * BLOCKS_PER_SEQ, **kwargs).finalize()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_cache(single_group(2 + 20 * BLOCKS_PER_SEQ, BLOCK))
    assert runner.cuda_graphs is None  # CPU: never
    if fake:
        runner.cuda_graphs = runner._make_cuda_graphs(graph_factory=FakeGraph)
    return runner


def _blocks(i: int) -> list[int]:
    return list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ))  # block 0 is the null block


def _prompt(i: int) -> list[int]:
    return torch.randint(4, 4000, (3 + 2 * i,), generator=torch.Generator().manual_seed(i)).tolist()


def _prefill(runner: ModelRunner, ids: list[int]):
    reqs = [NewRequestData(f"r{i}", _prompt(i), SamplingParams(temperature=0.0, max_tokens=64), [_blocks(i)], 0)
            for i in ids]
    n = {r.req_id: len(r.prompt_token_ids) for r in reqs}
    return runner.execute_model(SchedulerOutput(scheduled_new_reqs=reqs, num_scheduled_tokens=n,
                                                total_num_scheduled_tokens=sum(n.values())))


def _decode(runner: ModelRunner, ids: list[int], **extra):
    cached = [CachedRequestData(f"r{i}", [[]], runner.requests[f"r{i}"].num_computed_tokens) for i in ids]
    n = {c.req_id: 1 for c in cached}
    for c in cached:  # the tokens computed so far: everything but the last sampled one
        c.num_computed_tokens = len(runner.requests[c.req_id].token_ids) - 1
    return runner.execute_model(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens=n,
                                                total_num_scheduled_tokens=len(ids), **extra))


def _hidden_spy(runner: ModelRunner) -> list:
    """Record each step's hidden states (the rows ``_forward`` returns)."""
    seen = []
    forward = runner._forward

    def spy(inputs):
        out = forward(inputs)
        seen.append((out.clone(), runner.cuda_graphs is not None and runner._graph_step(inputs)))
        return out

    runner._forward = spy
    return seen


@pytest.fixture(scope="module")
def pair(llama_tiny):
    return _runner(llama_tiny, False), _runner(llama_tiny, True)


@pytest.mark.parametrize("batch", [1, 3, 5, 11])
def test_padded_graph_rows_match_an_eager_run(pair, batch):
    eager, graphs = pair
    ids = list(range(batch))
    for r in (eager, graphs):
        r.requests.clear()
        _prefill(r, ids)
    eager_seen, graph_seen = _hidden_spy(eager), _hidden_spy(graphs)
    try:
        for _ in range(4):
            a, b = _decode(eager, ids), _decode(graphs, ids)
            assert a.sampled_token_ids == b.sampled_token_ids
    finally:
        del eager._forward, graphs._forward
    assert len(eager_seen) == len(graph_seen) == 4
    for (h_eager, used_eager), (h_graph, used_graph) in zip(eager_seen, graph_seen):
        assert not used_eager and used_graph
        assert h_graph.shape == h_eager.shape  # sliced to the real rows
        torch.testing.assert_close(h_graph, h_eager, rtol=1e-4, atol=1e-4)
    assert graphs.cuda_graphs.padded_size(batch) in graphs.cuda_graphs.graphs


def test_static_buffers_updated_in_place_between_replays(pair):
    _, graphs = pair
    cg = graphs.cuda_graphs
    graphs.requests.clear()
    _prefill(graphs, [0, 1, 2])
    ptrs = {name: getattr(cg.buffers, name).data_ptr() for name in ("input_ids", "positions", "seq_lens")}
    table_ptr, slot_ptr = cg.buffers.block_tables[0].data_ptr(), cg.buffers.slot_mappings[0].data_ptr()
    captures = FakeGraph.captures
    _decode(graphs, [0, 1, 2])
    lens_first = cg.buffers.seq_lens[:3].clone()
    graph = cg.graphs[4]
    replays = graph.replays
    _decode(graphs, [0, 1, 2])
    assert cg.graphs[4] is graph and graph.replays == replays + 1
    assert FakeGraph.captures <= captures + 1  # size 4 captured at most once
    assert torch.equal(cg.buffers.seq_lens[:3], lens_first + 1)  # the new step's values, in place
    assert cg.buffers.seq_lens[3].item() == 1 and cg.buffers.input_ids[3].item() == 0  # the padded row
    assert cg.buffers.slot_mappings[0][3].item() == 0 and not cg.buffers.block_tables[0][3].any()
    assert {n: getattr(cg.buffers, n).data_ptr() for n in ptrs} == ptrs
    assert cg.buffers.block_tables[0].data_ptr() == table_ptr and cg.buffers.slot_mappings[0].data_ptr() == slot_ptr


def test_prefill_mixed_drafts_and_oversize_steps_stay_eager(pair):
    _, graphs = pair
    graphs.requests.clear()
    seen = _hidden_spy(graphs)
    try:
        _prefill(graphs, [0, 1])  # prefill
        _prefill(graphs, [2])
        cached = CachedRequestData("r0", [[]], len(graphs.requests["r0"].token_ids) - 1)
        new = NewRequestData("r3", _prompt(3), SamplingParams(temperature=0.0, max_tokens=8), [_blocks(3)], 0)
        graphs.execute_model(SchedulerOutput(  # mixed: a decode and a prefill
            scheduled_new_reqs=[new], scheduled_cached_reqs=[cached],
            num_scheduled_tokens={"r0": 1, "r3": len(new.prompt_token_ids)},
            total_num_scheduled_tokens=1 + len(new.prompt_token_ids)))
        r1 = graphs.requests["r1"]
        graphs.execute_model(SchedulerOutput(  # drafts to verify
            scheduled_cached_reqs=[CachedRequestData("r1", [[]], len(r1.token_ids) - 1)],
            num_scheduled_tokens={"r1": 3}, total_num_scheduled_tokens=3, scheduled_spec_tokens={"r1": [5, 6]}))
    finally:
        del graphs._forward
    assert [used for _, used in seen] == [False, False, False, False]
    _decode(graphs, [0])
    assert graphs.cuda_graphs.graphs  # while a plain decode step does go through a graph
    meta = type("M", (), {"block_table": torch.zeros(1, 1), "other_groups": ()})()
    assert not graphs.cuda_graphs.can_run(17, meta)  # beyond the largest size (max_num_seqs 16)


def test_enforce_eager_batch_invariant_and_lora_build_no_graph_runner(llama_tiny):
    for kwargs in ({"enforce_eager": True}, {"batch_invariant": True}, {"enable_lora": True}):
        runner = _runner(llama_tiny, False, **kwargs)
        assert runner._make_cuda_graphs(graph_factory=FakeGraph) is None


def test_release_on_sleep_then_lazy_recapture(llama_tiny):
    runner = _runner(llama_tiny, True)
    _prefill(runner, [0, 1])
    _decode(runner, [0, 1])
    assert set(runner.cuda_graphs.graphs) == {2}
    runner.release_cache()  # Worker.sleep
    assert runner.cuda_graphs.graphs == {}
    runner.initialize_cache(runner.kv_cache_config)  # Worker.wake_up
    assert runner.cuda_graphs is not None and runner.cuda_graphs.graphs == {}
    _prefill(runner, [0, 1])
    _decode(runner, [0, 1])
    assert set(runner.cuda_graphs.graphs) == {2}


class FailingGraph(FakeGraph):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_eager_for_good(llama_tiny):
    eager = _runner(llama_tiny, False)
    runner = _runner(llama_tiny, False)
    runner.cuda_graphs = runner._make_cuda_graphs(graph_factory=FailingGraph)
    for r in (eager, runner):
        _prefill(r, [0, 1, 2])
    assert _decode(runner, [0, 1, 2]).sampled_token_ids == _decode(eager, [0, 1, 2]).sampled_token_ids
    assert runner.cuda_graphs.disabled and runner.cuda_graphs.graphs == {}
    assert _decode(runner, [0, 1, 2]).sampled_token_ids == _decode(eager, [0, 1, 2]).sampled_token_ids
