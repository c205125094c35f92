"""``Readiness``: the one lifecycle state machine of every role (health, metrics and the router read it)."""

from __future__ import annotations

import time

import pytest

from gridserve.shared.readiness import Readiness, State


def test_states_move_only_along_the_table_and_listeners_see_each_change():
    readiness = Readiness("engine")
    seen = []
    readiness.watch(lambda state, reason: seen.append((state, reason)))
    assert readiness.state is State.LOADING and not readiness.ready and readiness.live
    readiness.set(State.READY, "loaded")
    assert readiness.ready
    assert readiness.set(State.READY) is False  # no change, no event
    readiness.set(State.SLEEPING)
    with pytest.raises(ValueError, match="sleeping to recovering"):
        readiness.set(State.RECOVERING)
    readiness.set(State.READY)
    readiness.set(State.RECOVERING, "worker 0 died")
    assert not readiness.ready and readiness.live
    readiness.set(State.READY)
    readiness.set(State.DRAINING)
    assert readiness.try_set(State.READY) is False  # a drain is never undone
    readiness.set(State.DEAD, "stopped")
    assert not readiness.live
    assert [s for s, _ in seen] == [State.READY, State.SLEEPING, State.READY, State.RECOVERING, State.READY,
                                    State.DRAINING, State.DEAD]
    assert seen[3][1] == "worker 0 died"


def test_watchdog_makes_a_role_whose_thread_stops_beating_not_live():
    readiness = Readiness()
    readiness.set(State.READY)
    assert readiness.live  # no watchdog armed: live until dead
    readiness.arm_watchdog(0.05)
    assert readiness.live
    time.sleep(0.1)
    assert not readiness.live and readiness.ready  # hung, though nothing set a state
    readiness.beat()
    assert readiness.live


def test_a_failing_listener_does_not_stop_the_others():
    readiness = Readiness()
    seen = []
    readiness.watch(lambda *_: 1 / 0)
    readiness.watch(lambda state, _: seen.append(state))
    readiness.set(State.DEAD)
    assert seen == [State.DEAD]
