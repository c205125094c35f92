"""The executor's ``sleeping_tags``: sleep releases both, wake_up restores only what still sleeps."""

from __future__ import annotations

import pytest

from gridserve.services.engine.executor.base import Executor
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import InvalidArgumentError


class _RecordingExecutor(Executor):
    def _init_executor(self) -> None:
        self.calls = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        self.calls.append((method, kwargs))
        return [{"rss_before": 2, "rss_after": 1, "device_before": 0, "device_after": 0}]

    def shutdown(self) -> None:
        pass


@pytest.fixture
def executor():
    return _RecordingExecutor(GridserveConfig())


def test_weights_then_kv_cache_wakes_each_in_turn(executor):
    executor.sleep(1)
    assert executor.sleeping_tags == {"weights", "kv_cache"} and executor.is_sleeping
    executor.wake_up(["weights"])
    assert executor.sleeping_tags == {"kv_cache"} and executor.is_sleeping
    executor.wake_up(["kv_cache"])
    assert not executor.is_sleeping
    assert executor.calls == [("sleep", {"level": 1}), ("wake_up", {"tags": ["weights"]}),
                              ("wake_up", {"tags": ["kv_cache"]})]


def test_waking_what_is_awake_calls_no_worker(executor):
    assert executor.wake_up() == []
    executor.sleep(2)
    executor.sleep(2)  # asleep already
    executor.wake_up()
    executor.wake_up(["kv_cache"])
    assert executor.calls == [("sleep", {"level": 2}), ("wake_up", {"tags": ["weights", "kv_cache"]})]


@pytest.mark.parametrize(("call", "field"), [(lambda e: e.sleep(3), "level"),
                                              (lambda e: e.wake_up(["weights", "kv"]), "tags")])
def test_bad_sleep_arguments_name_the_field(executor, call, field):
    with pytest.raises(InvalidArgumentError) as info:
        call(executor)
    assert info.value.field == field
