"""Expert parallelism's dispatch and combine (``FusedMoE`` with ``ParallelState.ep``): ranks that
each hold a contiguous 1 / EP of the experts, joined by a real gloo group (threads of this process
on one in-memory store), give every rank's tokens the single-rank layer's output; a rank with no
tokens (a dummy step) still completes its peers' steps; the experts load only their rank's tensors;
a dead peer fails the step instead of hanging."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport  # noqa: E402
from gridserve.services.worker.fused_moe import ExpertTensors, FusedMoE, route  # noqa: E402
from gridserve.services.worker.parallel_state import ExpertParallelGroup, ParallelState  # noqa: E402
from gridserve.shared.errors import ConfigError  # noqa: E402
from gridserve.shared.parallel import RankLayout, expert_shard  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 16, 12


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate_up": torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5,
            "down": torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5}


def _layer(w: dict[str, torch.Tensor], ep: ExpertParallelGroup | None = None) -> FusedMoE:
    layer = FusedMoE(EXPERTS, HIDDEN, INTER, ParallelState(RankLayout(0, 1, 1), ep=ep))
    e = layer.experts
    layer.gate_up_proj.data.copy_(w["gate_up"][e.start : e.end])
    layer.down_proj.data.copy_(w["down"][e.start : e.end])
    return layer


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=g), TOP_K)
    return x, weights, ids


def _run_ranks(size: int, body, timeout_s: float = 10.0) -> list:
    """``body(group)`` on ``size`` gloo ranks (threads); each rank's result or exception."""
    store = dist.HashStore()
    results: list = [None] * size

    def run(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("ep", store), rank, size, timedelta(seconds=timeout_s))
            results[rank] = body(ExpertParallelGroup(group, rank, size))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 20)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


@pytest.mark.parametrize("size, tokens", [(2, (5, 3)), (2, (4, 0)), (4, (1, 7, 0, 2)), (2, (0, 0))])
def test_expert_parallel_ranks_match_the_single_rank_layer(size: int, tokens: tuple[int, ...]) -> None:
    w = _weights()
    single = _layer(w)
    inputs = [_inputs(t, seed=rank + 1) for rank, t in enumerate(tokens)]

    def body(group: ExpertParallelGroup) -> torch.Tensor:
        layer = _layer(w, group)
        assert layer.gate_up_proj.shape[0] == EXPERTS // size  # this rank's experts only
        out = layer(*inputs[group.rank])
        layer.dummy_step()  # a step where this rank and maybe others have nothing: no hang either
        return out

    results = _run_ranks(size, body)
    for rank, out in enumerate(results):
        assert not isinstance(out, Exception), out
        expected = single(*inputs[rank])
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_dummy_step_pairs_with_a_peers_real_step() -> None:
    """An idle engine runs each MoE layer's collectives on zero tokens; its peer's tokens still go
    through the experts the idle rank holds."""
    w = _weights(1)
    x, weights, ids = _inputs(6, seed=3)
    ids[:, 0] = EXPERTS - 1  # every token needs an expert only rank 1 holds

    def body(group: ExpertParallelGroup):
        layer = _layer(w, group)
        if group.rank == 1:
            layer.dummy_step()
            return None
        return layer(x, weights, ids)

    results = _run_ranks(2, body)
    torch.testing.assert_close(results[0], _layer(w)(x, weights, ids), rtol=1e-5, atol=1e-6)
    assert results[1] is None


def test_a_dead_peer_fails_the_step_instead_of_hanging() -> None:
    w = _weights()
    x, weights, ids = _inputs(3, seed=0)

    def body(group: ExpertParallelGroup):
        layer = _layer(w, group)
        if group.rank == 1:
            return None  # this engine is gone: it never joins the step
        return layer(x, weights, ids)

    start = time.monotonic()
    results = _run_ranks(2, body, timeout_s=2.0)
    assert isinstance(results[0], RuntimeError)
    assert time.monotonic() - start < 15


def test_expert_parallel_loading_reads_only_this_ranks_experts() -> None:
    """Per-expert checkpoint tensors of another rank's experts are left unread; stacked ones are
    read only for this rank's rows."""
    w = _weights()

    class Group:  # loading needs the rank and size only
        rank, size = 1, 2

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.experts = FusedMoE(EXPERTS, HIDDEN, INTER, ParallelState(RankLayout(0, 1, 1), ep=Group()))

    report = LoadReport()

    def tensor(name: str, value: torch.Tensor) -> CheckpointTensor:
        return CheckpointTensor(name, tuple(value.shape), lambda index: value[index], report)

    per_expert = []
    for e in range(EXPERTS):
        per_expert += [(f"mlp.experts.{e}.gate_proj.weight", tensor(f"g{e}", w["gate_up"][e, :INTER])),
                       (f"mlp.experts.{e}.up_proj.weight", tensor(f"u{e}", w["gate_up"][e, INTER:])),
                       (f"mlp.experts.{e}.down_proj.weight", tensor(f"d{e}", w["down"][e]))]
    model = Model()
    loader = ExpertTensors(model, {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}, lambda n: n)
    assert list(loader.others(per_expert)) == []
    half = slice(EXPERTS // 2, EXPERTS)
    torch.testing.assert_close(model.mlp.experts.gate_up_proj.data, w["gate_up"][half])
    torch.testing.assert_close(model.mlp.experts.down_proj.data, w["down"][half])
    assert sorted(report.read) == sorted(f"{p}{e}" for p in "gud" for e in range(EXPERTS // 2, EXPERTS))

    stacked = Model()
    report = LoadReport()
    loader = ExpertTensors(stacked, {}, lambda n: n)
    list(loader.others([("mlp.experts.gate_up_proj", tensor("gu", w["gate_up"])),
                        ("mlp.experts.down_proj", tensor("d", w["down"]))]))
    torch.testing.assert_close(stacked.mlp.experts.gate_up_proj.data, w["gate_up"][half])
    torch.testing.assert_close(stacked.mlp.experts.down_proj.data, w["down"][half])
    assert report.read["gu"][0] == w["gate_up"][half].numel()


def test_experts_that_do_not_split_across_the_ep_ranks_name_the_field() -> None:
    with pytest.raises(ConfigError, match="n_routed_experts"):
        expert_shard(6, 4, 0, "model.hf_config.n_routed_experts")
    assert expert_shard(8, 2, 1, "f").start == 4
