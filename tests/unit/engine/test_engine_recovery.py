"""``EngineLoop`` worker recovery with a fake worker group (no processes, no torch).

The fake group samples a token that depends only on the request and its position, as seeded or
greedy sampling does, so a request resumed by recomputation must produce the same tokens as a run
without the fault; it fails on the steps it is told to and rebuilds (or not) on ``reinitialize``.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import pytest

from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.executor import Executor
from gridserve.services.engine.loop import END, MAX_RECOVERIES_IN_ROW, EngineLoop
from gridserve.services.engine.request import Request
from gridserve.shared.config import GridserveConfig, ModelConfig
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.kv_cache_spec import FULL, KVCacheConfig, LayerKVCacheSpec
from gridserve.shared.outputs import FinishReason
from gridserve.shared.readiness import Readiness, State
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput, SchedulerOutput

NUM_BLOCKS = 64


class FakeGroup(Executor):
    """One fake worker: token = f(request, position); fails the steps in ``fail_steps``."""

    def __init__(self, config: GridserveConfig, fail_steps: set[int] = frozenset(),
                 rebuild_error: Optional[Exception] = None) -> None:
        self.fail_steps = set(fail_steps)
        self.rebuild_error = rebuild_error
        self.rebuilds: list[int] = []
        self.steps = 0
        super().__init__(config)

    def _init_executor(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def collective_rpc(self, method: str, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict[str, Any]] = None, non_block: bool = False):
        result = {"determine_available_memory": NUM_BLOCKS * 16 * 64,
                  "get_kv_cache_spec": [LayerKVCacheSpec("layer", FULL, 16, 64)]}.get(method)
        if method == "execute_model":
            result = self._step(args[0])
        future: Future = Future()
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result([result])
        return future if non_block else future.result()

    def _step(self, sched: SchedulerOutput):
        self.steps += 1
        if self.steps in self.fail_steps:
            return EngineDeadError(f"worker killed at step {self.steps}")
        for rid in sched.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
        computed = {n.req_id: n.num_computed_tokens for n in sched.scheduled_new_reqs}
        computed.update({c.req_id: c.num_computed_tokens for c in sched.scheduled_cached_reqs})
        out = ModelRunnerOutput()
        for rid, n in sched.num_scheduled_tokens.items():
            tokens = self.tokens[rid]
            if computed[rid] + n >= len(tokens):
                token = (sum(tokens) * 31 + len(tokens)) % 1000 + 3
                tokens.append(token)
                out.req_ids.append(rid)
                out.sampled_token_ids.append(token)
                out.logprobs.append(None)
        return out

    def reinitialize(self, kv_cache_config: KVCacheConfig, timeout_s: float) -> None:
        self.rebuilds.append(kv_cache_config.num_blocks)
        if self.rebuild_error is not None:
            raise self.rebuild_error
        self.tokens = {}

    def shutdown(self) -> None:
        pass


class Sink:
    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        self.items.put(item)


def _config() -> GridserveConfig:
    return GridserveConfig(model=ModelConfig(max_model_len=256, num_layers=1, num_kv_heads=1, head_dim=8))


def _run(executor: FakeGroup, recovery_timeout_s: float, n_requests: int = 3, max_tokens: int = 12):
    """Serve ``n_requests`` through a loop; (tokens per request, the end item or None, loop, states)."""
    readiness = Readiness("engine")
    states: list[State] = []
    readiness.watch(lambda state, _reason: states.append(state))
    readiness.set(State.READY)
    loop = EngineLoop(EngineCore(_config(), executor), readiness, recovery_timeout_s=recovery_timeout_s)
    sink = Sink()
    loop.open_stream("gw", sink).result(5)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [Request(f"r{i}", [10 + i, 20 + i, 30 + i], params) for i in range(n_requests)]
    loop.submit(lambda: [loop._add(r, "gw") for r in requests]).result(5)  # one batch from the first step
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(n_requests)}
    finished, end = set(), None
    deadline = time.monotonic() + 20
    while len(finished) < n_requests and end is None and time.monotonic() < deadline:
        item = sink.items.get(timeout=20)
        if isinstance(item, Exception) or item is END:
            end = item
            break
        for out in item:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH
                finished.add(out.request_id)
    loop.stop()
    return tokens, end, loop, states


def test_a_step_lost_with_its_worker_is_recomputed_and_every_request_completes_unchanged():
    reference, end, _, _ = _run(FakeGroup(_config()), recovery_timeout_s=5)
    assert end is None and all(len(t) == 12 for t in reference.values())
    group = FakeGroup(_config(), fail_steps={4})
    tokens, end, loop, states = _run(group, recovery_timeout_s=5)
    assert end is None and tokens == reference
    assert group.rebuilds == [NUM_BLOCKS] and loop.recoveries == 1 and loop.last_recovery_s is not None
    assert states == [State.READY, State.RECOVERING, State.READY]


def test_a_group_not_back_in_time_fails_the_requests_and_the_engine_is_dead():
    group = FakeGroup(_config(), fail_steps={3}, rebuild_error=EngineDeadError("the worker group is not back"))
    tokens, end, loop, states = _run(group, recovery_timeout_s=1)
    assert isinstance(end, EngineDeadError) and "not back" in str(end)
    assert states == [State.READY, State.RECOVERING, State.DEAD] and loop.recoveries == 0
    with pytest.raises(EngineDeadError):
        loop.add_request(Request("late", [1, 2], SamplingParams()), "gw").result(5)


def test_without_a_recovery_timeout_a_worker_failure_kills_the_engine():
    group = FakeGroup(_config(), fail_steps={3})
    _, end, loop, states = _run(group, recovery_timeout_s=0)
    assert isinstance(end, EngineDeadError) and group.rebuilds == []
    assert states == [State.READY, State.DEAD]


def test_a_fault_that_comes_back_after_every_recovery_kills_the_engine():
    group = FakeGroup(_config(), fail_steps=set(range(2, 100)))  # the first step passes, then every one fails
    _, end, loop, states = _run(group, recovery_timeout_s=5)
    assert isinstance(end, EngineDeadError) and "came back" in str(end)
    assert loop.recoveries == MAX_RECOVERIES_IN_ROW and states[-1] is State.DEAD


def test_a_worker_failure_noticed_while_idle_starts_a_recovery():
    readiness = Readiness("engine")
    readiness.set(State.READY)
    group = FakeGroup(_config())
    loop = EngineLoop(EngineCore(_config(), group), readiness, recovery_timeout_s=5)
    recovered = threading.Event()
    readiness.watch(lambda state, _reason: state is State.READY and recovered.set())
    loop.fail(EngineDeadError("worker stream broke"))
    assert recovered.wait(5) and group.rebuilds == [NUM_BLOCKS] and loop.recoveries == 1
    loop.stop()
