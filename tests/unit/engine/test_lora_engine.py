"""The engine's side of multi-LoRA (no torch): the adapter table, max_loras in the scheduler, the
prefix cache keyed by adapter, and vllm:lora_requests_info."""

from __future__ import annotations

import os

import pytest
from prometheus_client import generate_latest

from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.lora_adapters import LoRAAdapters
from gridserve.services.engine.metrics import EngineMetrics
from gridserve.services.engine.request import Request
from gridserve.services.engine.scheduler import Scheduler
from gridserve.shared.config import (
    GridserveConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    parse_lora_modules,
)
from gridserve.shared.errors import (
    AlreadyExistsError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    ModelNotFoundError,
    PermissionDeniedError,
)
from gridserve.shared.lora import LoRARequest
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput


class FakeExecutor:
    """Records the LoRA calls; ``refuse`` makes add_lora fail like a worker that found the adapter bad."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.refuse: str | None = None

    def collective_rpc(self, method: str, args: tuple = (), **_):
        if method == "add_lora" and self.refuse:
            raise InvalidArgumentError("adapter_config.r", self.refuse)
        self.calls.append((method, args))
        return [None]


def table(tmp_path, **kw) -> tuple[LoRAAdapters, FakeExecutor]:
    executor = FakeExecutor()
    config = LoRAConfig(enable_lora=True, lora_dir=str(tmp_path), allow_runtime_lora_updating=True, **kw)
    return LoRAAdapters(config, executor), executor


def test_load_assigns_increasing_ids_that_are_never_reused(tmp_path):
    adapters, executor = table(tmp_path)
    a = adapters.load("sql", "sql-adapter")
    b = adapters.load("chat", str(tmp_path / "chat"))
    assert (a.request.lora_int_id, b.request.lora_int_id) == (1, 2)
    assert a.request.lora_path == os.path.realpath(tmp_path / "sql-adapter")  # relative: inside lora_dir
    assert executor.calls[0] == ("add_lora", (a.request,))
    adapters.unload("sql")
    assert executor.calls[-1] == ("remove_lora", (1,))
    again = adapters.load("sql", "sql-adapter")
    assert again.request.lora_int_id == 3, "an unloaded adapter's id is retired"
    assert [x.request.lora_name for x in adapters.list()] == ["chat", "sql"]
    assert adapters.resolve("chat") == b.request


def test_bad_loads_name_the_field_and_leave_the_table_unchanged(tmp_path):
    adapters, executor = table(tmp_path)
    adapters.load("sql", "sql")
    with pytest.raises(AlreadyExistsError, match="lora_name"):
        adapters.load("sql", "other")
    for path in ("../outside", "/etc", str(tmp_path / ".." / "x")):
        with pytest.raises(InvalidArgumentError, match="lora_path.*outside the allowed directory"):
            adapters.load("evil", path)
    for name in ("", " padded", "x" * 300, "tab\tname"):
        with pytest.raises(InvalidArgumentError, match="lora_name"):
            adapters.load(name, "p")
    executor.refuse = "rank 64 exceeds --max-lora-rank 16"
    with pytest.raises(InvalidArgumentError, match="adapter_config.r"):
        adapters.load("big", "big")
    assert [x.request.lora_name for x in adapters.list()] == ["sql"]
    with pytest.raises(ModelNotFoundError, match="no LoRA adapter 'nope'"):
        adapters.unload("nope")
    with pytest.raises(ModelNotFoundError):
        adapters.resolve("big")


def test_runtime_updates_need_the_switch_and_a_lora_dir(tmp_path):
    executor = FakeExecutor()
    off = LoRAAdapters(LoRAConfig(enable_lora=True, lora_dir=str(tmp_path)), executor)
    with pytest.raises(PermissionDeniedError, match="--allow-runtime-lora-updating"):
        off.load("a", "a")
    no_dir = LoRAAdapters(LoRAConfig(enable_lora=True, allow_runtime_lora_updating=True), executor)
    with pytest.raises(FailedPreconditionError, match="--lora-dir"):
        no_dir.load("a", "a")
    # adapters named at start need neither (the operator chose them)
    start = LoRAAdapters(LoRAConfig(enable_lora=True, lora_modules={"a": str(tmp_path / "a")}), executor)
    start.load_modules()
    assert start.resolve("a").lora_path == str(tmp_path / "a")


def test_offline_requests_register_once_and_conflicts_are_refused(tmp_path):
    adapters, executor = table(tmp_path)
    first = LoRARequest("a", 7, str(tmp_path / "a"))
    assert adapters.register(first) == first and adapters.register(first) == first
    assert [c[0] for c in executor.calls] == ["add_lora"]
    with pytest.raises(InvalidArgumentError, match="one id per adapter name"):
        adapters.register(LoRARequest("a", 8, str(tmp_path / "a")))
    with pytest.raises(InvalidArgumentError, match="one id per adapter name"):
        adapters.register(LoRARequest("b", 7, str(tmp_path / "b")))
    assert adapters.load("served", "s").request.lora_int_id == 8, "served ids continue past offline ones"


def test_lora_request_and_config_checks():
    for bad in ({"lora_name": ""}, {"lora_int_id": 0}, {"lora_int_id": True}, {"lora_path": 3}):
        with pytest.raises(InvalidArgumentError):
            LoRARequest(**{"lora_name": "a", "lora_int_id": 1, "lora_path": "/p", **bad})
    with pytest.raises(ConfigError, match="max_lora_rank"):
        LoRAConfig(enable_lora=True, max_lora_rank=17)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="--enable-lora"):
        LoRAConfig(lora_modules={"a": "/p"})
    assert LoRAConfig(enable_lora=True, lora_modules="a=/x, b=/y").lora_modules == {"a": "/x", "b": "/y"}
    assert parse_lora_modules('[{"name": "a", "path": "/x", "base_model_name": "m"}]') == {"a": "/x"}
    with pytest.raises(ConfigError, match="name=path"):
        parse_lora_modules("justaname")


def test_lora_with_speculative_decoding_is_refused_at_start(llama_tiny):
    with pytest.raises(ConfigError, match="LoRA with speculative decoding"):
        GridserveConfig.from_kwargs(model=str(llama_tiny), enable_lora=True,
                                    speculative_config={"method": "ngram"}).finalize()


# ---- the scheduler ------------------------------------------------------------------------------
def scheduler(max_loras: int, max_num_seqs: int = 8, caching: bool = True) -> Scheduler:
    config = GridserveConfig(model=ModelConfig(max_model_len=512),
                             scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256),
                             lora=LoRAConfig(enable_lora=True, max_loras=max_loras))
    return Scheduler(config, KVCacheManager(64, 16, caching))


def request(rid: str, lora: LoRARequest | None, n_prompt: int = 20, max_tokens: int = 3) -> Request:
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens), eos_token_id=2,
                   lora_request=lora)


A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def step(s: Scheduler):
    out = s.schedule()
    done = [r for r in out.num_scheduled_tokens if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens]
    s.update_from_output(out, ModelRunnerOutput(req_ids=done, sampled_token_ids=[7] * len(done),
                                                logprobs=[None] * len(done)))
    return out


def adapters_of(s: Scheduler, out) -> set:
    return {s.requests[r].lora_request.lora_name for r in out.num_scheduled_tokens
            if r in s.requests and s.requests[r].lora_request is not None}


def test_a_step_runs_at_most_max_loras_adapters_and_passes_over_the_others():
    s = scheduler(max_loras=2)
    for rid, lora in (("a1", A), ("b1", B), ("c1", C), ("base", None), ("a2", A)):
        s.add_request(request(rid, lora))
    out = step(s)
    # c1 would be a third adapter: it keeps its place, base and a2 behind it go first
    assert set(out.num_scheduled_tokens) == {"a1", "b1", "base", "a2"}
    assert [r.request_id for r in s.waiting] == ["c1"]
    assert out.scheduled_new_reqs[0].lora_request == A
    assert {r.req_id: r.lora_request for r in out.scheduled_new_reqs}["base"] is None
    seen = set()
    while s.has_unfinished_requests():
        out = step(s)
        assert len(adapters_of(s, out)) <= 2
        seen |= set(out.num_scheduled_tokens)
    assert "c1" in seen, "the passed-over request ran once an adapter drained"


def test_one_adapter_at_a_time_serves_every_request_in_bursts():
    s = scheduler(max_loras=1)
    for i in range(12):
        s.add_request(request(f"r{i}", (A, B, C)[i % 3]))
    finished = set()
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert len({s.requests[r].lora_request.lora_name for r in out.num_scheduled_tokens}) <= 1
        done = [r for r in out.num_scheduled_tokens if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens]
        for o in s.update_from_output(out, ModelRunnerOutput(req_ids=done, sampled_token_ids=[7] * len(done),
                                                             logprobs=[None] * len(done))):
            if o.finished:
                finished.add(o.request_id)
    assert finished == {f"r{i}" for i in range(12)}


def test_the_same_prompt_under_two_adapters_shares_no_kv():
    s = scheduler(max_loras=3)
    s.add_request(request("base", None, n_prompt=40))
    s.add_request(request("a", A, n_prompt=40))
    step(s)
    while s.has_unfinished_requests():
        step(s)
    hits = {}
    for rid, lora in (("base2", None), ("a2", A), ("b2", B), ("a-other-id", LoRARequest("a", 9, "/x"))):
        r = request(rid, lora, n_prompt=40)
        _, hits[rid] = s.kv.get_computed_blocks(r)
    assert hits["base2"] == 32 and hits["a2"] == 32, "the same adapter (or none) hits its own blocks"
    assert hits["b2"] == 0 and hits["a-other-id"] == 0, "another adapter, or another id, never hits"


def test_lora_requests_info_names_running_and_waiting_adapters():
    s = scheduler(max_loras=1)
    for rid, lora in (("a1", A), ("b1", B)):
        s.add_request(request(rid, lora))
    s.schedule()
    load = s.stats()
    assert (load.max_lora, load.running_lora_adapters, load.waiting_lora_adapters) == (1, ("a",), ("b",))
    config = GridserveConfig(lora=LoRAConfig(enable_lora=True))
    text = generate_latest(EngineMetrics(config, lambda: load).registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="1"' in line and 'running_lora_adapters="a"' in line and 'waiting_lora_adapters="b"' in line
    off = Scheduler(GridserveConfig(), KVCacheManager(8, 16, True)).stats()
    assert "lora_requests_info" not in generate_latest(EngineMetrics(GridserveConfig(), lambda: off).registry).decode()
