"""The micro-benchmarks' shared timing loop and entry point (``benchmarks/harness.py``): calls take
turns round by round, each sample is seconds per call over ``inner`` calls, the warm-up call is
untimed and optional, and ``standalone`` parses a command's own arguments."""

from __future__ import annotations

import argparse

import pytest

from gridserve.benchmarks import harness


class _Clock:
    """``time.perf_counter`` replaced by a clock that only the timed calls move (by their cost)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(harness.time, "perf_counter", fake)
    return fake


def _costing(clock: _Clock, log: list[str], name: str, seconds: float):
    def call() -> None:
        log.append(name)
        clock.now += seconds
    return call


def test_interleaved_calls_take_turns_and_give_seconds_per_call(clock: _Clock) -> None:
    log: list[str] = []
    calls = {"a": _costing(clock, log, "a", 0.002), "b": _costing(clock, log, "b", 0.005)}
    samples = harness.interleaved(calls, repeats=3, inner=2, warmup=True)
    assert log == ["a", "b"] + ["a", "a", "b", "b"] * 3  # one untimed warm-up each, then rounds
    assert list(samples) == ["a", "b"]
    assert samples["a"] == pytest.approx([0.002] * 3)
    assert samples["b"] == pytest.approx([0.005] * 3)


def test_interleaved_without_warmup_times_every_call(clock: _Clock) -> None:
    log: list[str] = []
    samples = harness.interleaved({"a": _costing(clock, log, "a", 0.001)}, repeats=2, inner=3,
                                  warmup=False)
    assert log == ["a"] * 6
    assert samples["a"] == pytest.approx([0.001, 0.001])


def test_calls_per_sample_fills_the_sample_from_one_timed_call(clock: _Clock) -> None:
    log: list[str] = []
    assert harness.calls_per_sample(_costing(clock, log, "a", 0.0005), 20e-3) == 40
    assert harness.calls_per_sample(_costing(clock, log, "slow", 0.5), 20e-3) == 1  # at least one
    assert harness.calls_per_sample(_costing(clock, log, "free", 0.0), 2e-3) == 2000  # a 1 us floor
    assert log == ["a", "slow", "free"]


def test_standalone_parses_the_commands_own_arguments() -> None:
    seen: list[argparse.Namespace] = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--repeats", type=int, default=7)

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 3

    assert harness.standalone("doc", add_arguments, run, ["--repeats", "9"]) == 3
    assert seen[0].repeats == 9
    with pytest.raises(SystemExit):
        harness.standalone("doc", add_arguments, run, ["--bogus"])
