"""``SchedulingPolicy``: the order in which the scheduler serves requests (``--scheduling-policy``).

The scheduler keeps the waiting queue and the running batch; the policy says where a request goes
in each, and whether a waiting request may take a running one's place.

- ``fcfs`` (the default): first come, first served. New requests join the back of the queue,
  continuations (failover from a dead engine) go ahead of every new request, a preempted request
  goes back to the front; the running batch is in admission order, so the most recently admitted
  request is the one preempted when the KV cache runs out. A request's ``priority`` must be 0.
- ``priority``: each request has an integer ``priority``; a lower value runs first, ties by
  arrival, and a continuation goes ahead of new requests of its priority. The waiting queue and the
  running batch are both kept in that order, so the KV cache's victim (the batch's last) is the
  worst-priority request, and a waiting request that finds every slot taken (``max_num_seqs``) or
  the KV cache short preempts the worst running request when that one is strictly worse. Strictly:
  a preempted request never preempts back the one that took its place.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import MutableSequence

from gridserve.services.engine.request import Request, RequestStatus
from gridserve.shared.config import FCFS, PRIORITY, SCHEDULING_POLICIES
from gridserve.shared.errors import InvalidArgumentError


class SchedulingPolicy(ABC):
    """Where a request stands in the scheduler's waiting queue and running batch."""

    name: str
    # Whether a waiting request may preempt a running one to be admitted (``outranks``).
    preemptive: bool = False

    @abstractmethod
    def check(self, request: Request) -> None:
        """Refuse a request this policy cannot serve (``InvalidArgumentError`` naming the field)."""

    @abstractmethod
    def queue(self, waiting: deque[Request], request: Request) -> None:
        """A new request joins the waiting queue."""

    @abstractmethod
    def queue_continuation(self, waiting: deque[Request], request: Request) -> None:
        """A continuation (a request failed over from a dead engine) joins the waiting queue."""

    @abstractmethod
    def requeue(self, waiting: deque[Request], request: Request) -> None:
        """A preempted request goes back to the waiting queue."""

    @abstractmethod
    def run(self, running: list[Request], request: Request) -> None:
        """An admitted request joins the running batch (whose last request is preempted first)."""

    def outranks(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting`` may take ``running``'s place (only a ``preemptive`` policy says yes)."""
        return False


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; no request has a priority."""

    name = FCFS

    def check(self, request: Request) -> None:
        if request.priority:
            raise InvalidArgumentError("priority", f"must be 0 with --scheduling-policy fcfs (this engine's), "
                                                   f"got {request.priority}")

    def queue(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def queue_continuation(self, waiting: deque[Request], request: Request) -> None:
        """Behind preempted requests and earlier continuations, ahead of every new request."""
        waiting.insert(_first_new(waiting), request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        waiting.appendleft(request)

    def run(self, running: list[Request], request: Request) -> None:
        running.append(request)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, then continuations, then arrival; a better waiting request
    preempts a strictly worse running one."""

    name = PRIORITY
    preemptive = True

    def check(self, request: Request) -> None:
        pass  # any priority the caller could send (the contracts bound it to int32)

    def queue(self, waiting: deque[Request], request: Request) -> None:
        _insert_in_order(waiting, request)

    def queue_continuation(self, waiting: deque[Request], request: Request) -> None:
        _insert_in_order(waiting, request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        _insert_in_order(waiting, request)

    def run(self, running: list[Request], request: Request) -> None:
        _insert_in_order(running, request)

    def outranks(self, waiting: Request, running: Request) -> bool:
        return order_key(waiting) < order_key(running)


def order_key(request: Request) -> tuple[int, bool, float]:
    """The priority policy's order: priority, then continuations before new requests, then arrival."""
    return request.priority, not request.admit_always, request.arrival_time


def _insert_in_order(requests: MutableSequence[Request], request: Request) -> None:
    """Behind every request of the same or a better key (equal keys: first in, first out)."""
    requests.insert(bisect.bisect_right(requests, order_key(request), key=order_key), request)


def _first_new(waiting: deque[Request]) -> int:
    for i, request in enumerate(waiting):
        if request.status is RequestStatus.WAITING and not request.admit_always:
            return i
    return len(waiting)


def make_policy(name: str) -> SchedulingPolicy:
    """The policy ``--scheduling-policy`` names."""
    policies = {FCFS: FCFSPolicy, PRIORITY: PriorityPolicy}
    if name not in policies:
        raise InvalidArgumentError("scheduling_policy", f"must be one of {SCHEDULING_POLICIES}, got {name!r}")
    return policies[name]()
