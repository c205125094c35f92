"""``EngineLoop``: the engine's busy loop in its own thread, and the routing of its outputs.

Every touch of the ``EngineCore`` happens on the loop thread: the engine's asyncio servicer hands it
work through an inbox and awaits the answer (each call returns a ``concurrent.futures.Future``, so
it never blocks the event loop). Each iteration drains the inbox (adds, aborts, control calls), runs
one ``EngineCore.step()`` when there is work, and hands each gateway's ``OutputSink`` one batch with
the step's outputs of its requests (the sink hands it to the event loop). When a step fails or a
worker dies, the loop *recovers* (with ``recovery_timeout_s`` > 0): the ``Readiness`` goes
RECOVERING, every request goes back to the waiting queue to be recomputed (their KV is gone; their
gateway streams just pause), and the executor rebuilds the worker group once its workers are back;
adds and aborts keep being taken meanwhile (new requests queue). When the group is not back in time
(or the fault comes back after every recovery) the engine is dead: every gateway's stream ends with
``EngineDeadError``, later calls fail, and its ``Readiness`` goes DEAD. The loop keeps the
``Readiness`` (SLEEPING while asleep) and beats its watchdog every iteration, recovery included: a
loop thread that dies or hangs makes the engine not live.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Optional, Protocol

from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.observability import EngineObserver
from gridserve.services.engine.request import Request
from gridserve.services.engine.waves import WaveClient
from gridserve.shared.errors import EngineDeadError, FailedPreconditionError, InvalidArgumentError
from gridserve.shared.load import EngineLoad
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.readiness import Readiness, State

logger = logging.getLogger(__name__)

END = object()  # ends a gateway's output stream cleanly
MAX_RECOVERIES_IN_ROW = 3  # recoveries with no successful step between them: the fault is not transient


class OutputSink(Protocol):
    """Where one gateway's batches go; ``put`` is called on the loop thread and must not block.
    Items: a list of ``EngineCoreOutput`` (one step), an ``EngineDeadError``, or ``END``."""

    def put(self, item: Any) -> None: ...


class EngineLoop:
    """Runs ``core.step()`` in a thread and routes outputs to the gateway that sent each request."""

    def __init__(self, core: EngineCore, readiness: Readiness,
                 observer: Optional[EngineObserver] = None, waves: Optional[WaveClient] = None,
                 on_load: Optional[Callable[[Optional[EngineLoad]], None]] = None,
                 recovery_timeout_s: float = 0.0) -> None:
        self.core = core
        self.readiness = readiness
        self.waves = waves  # MoE with DP > 1: step in lockstep with the other engines
        self.on_load = on_load  # DP: the load after every change (None once dead), on the loop thread
        # Metrics, request log lines and spans; the scheduler collects step stats for it.
        self.observer = observer or EngineObserver()
        core.scheduler.take_step_stats()
        self.error: Optional[EngineDeadError] = None
        # Worker recovery: how long to wait for a failed group to be back (0: a fault kills the engine).
        self.recovery_timeout_s = recovery_timeout_s
        self.recoveries = 0  # completed recoveries (gridserve:worker_recoveries_total)
        self.last_recovery_s: Optional[float] = None
        self.recovering = False
        self._recoveries_in_row = 0
        self._fault: Optional[Exception] = None  # a worker failure reported from another thread
        self.sleeping = False
        self.draining = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, str] = {}  # request id -> gateway id
        # P/D: a finished request whose KV a producer still holds keeps its owner, so that its
        # gateway may abort it (an early release of the transfer); pruned to what is still held.
        self._held_routes: dict[str, str] = {}
        self._sinks: dict[str, OutputSink] = {}  # gateway id -> its open output stream
        self._stop = threading.Event()
        self._halted = False  # fault injection: the thread exits without a word (``halt``)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- called from any thread (the servicer's event loop, metrics, drain) -----------------------
    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the loop thread between steps; its result (or error) arrives in the future."""
        future: Future = Future()
        if self.error is not None:
            future.set_exception(self.error)
        else:
            self._inbox.put((fn, future))
        return future

    def add_request(self, request: Request, gateway_id: str) -> Future:
        if self.draining:
            raise EngineDeadError("the engine is shutting down")
        return self.submit(lambda: self._add(request, gateway_id))

    def abort(self, request_ids: list[str], owner: Optional[str] = None) -> Future:
        """The future's result: the ids that were still in the engine. ``owner``: abort only the
        requests routed to that caller's streams (``<owner>/<gateway id>``; None: any)."""
        return self.submit(lambda: self._abort(self._owned(request_ids, owner)))

    def open_stream(self, gateway_id: str, sink: OutputSink) -> Future:
        """Route ``gateway_id``'s outputs to ``sink`` from now on (a reconnect replaces the old one)."""
        return self.submit(lambda: self._sinks.__setitem__(gateway_id, sink))

    def close_stream(self, gateway_id: str, sink: OutputSink) -> None:
        """The gateway's stream ended: abort its requests, unless it already opened a new one."""
        if self.error is None and not self._stop.is_set():
            self.submit(lambda: self._drop_gateway(gateway_id, sink))

    def stats(self) -> Future:
        """One snapshot of the scheduler, taken between steps: the load report and the metrics."""
        return self.submit(self.core.stats)

    def load(self) -> Future:
        return self.submit(self._load)

    def sleep(self, level: int) -> Future:
        """The future's result: each worker's memory before and after."""
        def go() -> list[dict[str, int]]:
            if self.recovering:
                raise FailedPreconditionError("the engine is recovering its workers")
            if self.core.has_unfinished_requests():
                raise FailedPreconditionError("cannot sleep with requests in flight")
            reports = self.core.sleep(level)
            self.sleeping = True
            self.readiness.set(State.SLEEPING, f"sleep level {level}")
            return reports

        return self.submit(go)

    def wake_up(self, tags: Optional[list[str]]) -> Future:
        """Restore ``tags`` (all when None). Requests are refused, and readiness stays SLEEPING,
        until no tag sleeps: the KV cache is allocated again before the first request."""
        def go() -> list[dict[str, int]]:
            if self.recovering:
                raise FailedPreconditionError("the engine is recovering its workers")
            reports = self.core.wake_up(tags)
            still = self.core.sleeping_tags
            self.sleeping = bool(still)
            if still:
                self.readiness.try_set(State.SLEEPING, f"asleep: {', '.join(still)}")
            else:
                self.readiness.try_set(State.READY, "woken up")
            return reports

        return self.submit(go)

    def collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout: Optional[float],
                       unique_reply_rank: Optional[int]) -> Future:
        """A worker extension method on every worker, between steps."""
        return self.submit(lambda: self.core.collective_rpc(method, args, kwargs, timeout, unique_reply_rank))

    def drain(self, timeout: float) -> None:
        """Stop taking requests, let in-flight ones finish for ``timeout`` s, abort the rest, stop."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.error is None and time.monotonic() < deadline:
            if not self.submit(self.core.has_unfinished_requests).result(timeout):
                break
            time.sleep(0.05)
        if self.error is None:
            self.submit(lambda: self._abort(list(self._routes))).result(timeout)
        self.stop()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._inbox.put((self._close_sinks, Future()))
            self._stop.set()
            self._thread.join(timeout=10)

    def halt(self, reason: str) -> None:
        """Fault injection (tests only): the loop thread exits at once, as if it died outside any
        step; nothing is marked dead, so only the watchdog can notice (liveness goes NOT_SERVING)."""
        logger.error("engine loop thread halted: %s", reason)
        self._halted = True
        self._inbox.put((lambda: None, Future()))  # wake it if it waits for work

    def fail(self, error: Exception) -> None:
        """A worker failed (from any thread, e.g. the executor noticing a dead worker): the loop
        recovers, or, with no recovery timeout, the engine is dead."""
        self._fault = error
        self._inbox.put((lambda: None, Future()))  # wake the loop

    # ---- the loop thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        self._offer_load()  # the first report: an idle engine is there too
        while not self._halted:
            self.readiness.beat()
            if self._drain_inbox(block=not self._has_step()):
                self._offer_load()
            if self._stop.is_set() and self._inbox.empty():
                return
            if self._fault is not None and self.error is None:
                self._on_fault(self._fault)
                continue
            if not self._has_step():
                continue
            if not self.core.has_unfinished_requests():
                self._dummy_step()
                continue
            start = time.perf_counter()
            try:
                outputs = self.core.step()
            except Exception as exc:  # noqa: BLE001 - any step failure: recover the workers or die
                self._on_fault(exc)
                continue
            if outputs:
                self._recoveries_in_row = 0
            self._publish(outputs)
            self._observe(time.perf_counter() - start)
            self._offer_load()
            if self.waves is not None:
                self.waves.after_step(self.core.has_unfinished_requests(), dummy=False)

    def _has_step(self) -> bool:
        """Whether the next iteration runs a step: requests to serve, or an MoE wave to keep up."""
        if self.error is not None or self.sleeping:
            return False
        if self.core.has_unfinished_requests():
            return True
        return self.waves is not None and self.waves.poll()

    def _dummy_step(self) -> None:
        try:
            self.core.execute_dummy_batch()
        except Exception as exc:  # noqa: BLE001 - a step failure: recover the workers or die
            self._on_fault(exc)
            return
        self.waves.after_step(self.core.has_unfinished_requests(), dummy=True)

    def _observe(self, step_seconds: Optional[float]) -> None:
        """Hand the step's stats to the observer; its failure must not stop the loop."""
        try:
            self.observer.on_step(self.core.scheduler.take_step_stats(), step_seconds)
        except Exception:  # noqa: BLE001 - metrics / logs / spans are best effort
            logger.exception("observability of a step failed")

    def _load(self) -> EngineLoad:
        return dataclasses.replace(self.core.stats(), sleeping=self.sleeping, state=self.readiness.state.value)

    def _offer_load(self) -> None:
        if self.on_load is not None and self.error is None:
            self.on_load(self._load())

    def _drain_inbox(self, block: bool) -> bool:
        """Run what the RPC handlers handed in; whether there was anything."""
        try:
            item = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            fn, future = item
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - delivered to the caller
                future.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: Request, gateway_id: str) -> None:
        if self.sleeping:
            raise FailedPreconditionError("the engine is sleeping; wake it up first")
        if gateway_id not in self._sinks:
            raise FailedPreconditionError(f"gateway {gateway_id!r} has no open StreamOutputs stream")
        if request.request_id in self._routes:
            raise InvalidArgumentError("request_id", f"{request.request_id!r} is already in the engine")
        self.core.add_request(request)  # admission control may refuse it (RESOURCE_EXHAUSTED)
        self.observer.on_add(request)
        self._routes[request.request_id] = gateway_id
        if self.waves is not None:
            try:
                self.waves.on_request()
            except Exception as exc:  # noqa: BLE001 - serve it anyway; the others join late
                logger.error("could not start an MoE wave: %s", exc)

    def _owned(self, request_ids: list[str], owner: Optional[str]) -> list[str]:
        if owner is None:
            return request_ids
        self._prune_held_routes()
        return [rid for rid in request_ids
                if (self._routes.get(rid) or self._held_routes.get(rid, "")).startswith(owner + "/")]

    def _prune_held_routes(self) -> None:
        held = self.core.scheduler.held_request_ids()
        self._held_routes = {rid: gid for rid, gid in self._held_routes.items() if rid in held}

    def _abort(self, request_ids: list[str]) -> list[str]:
        aborted = self.core.abort_requests(request_ids)
        self._publish([EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in aborted])
        if aborted:
            self._observe(None)
        return aborted

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        batches: dict[str, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            gateway_id = self._routes.get(out.request_id)
            if gateway_id is None:
                continue
            batches[gateway_id].append(out)
            if out.finished:
                del self._routes[out.request_id]
                if out.kv_transfer_params is not None:
                    self._held_routes[out.request_id] = gateway_id
                    if len(self._held_routes) > 64:
                        self._prune_held_routes()
        for gateway_id, batch in batches.items():
            sink = self._sinks.get(gateway_id)
            if sink is not None:
                sink.put(batch)

    def _drop_gateway(self, gateway_id: str, sink: OutputSink) -> None:
        if self._sinks.get(gateway_id) is not sink:
            return  # the gateway reconnected with a new stream
        del self._sinks[gateway_id]
        orphans = [rid for rid, gid in self._routes.items() if gid == gateway_id]
        if orphans:
            logger.warning("gateway %s left: aborting %d requests", gateway_id, len(orphans))
            self._abort(orphans)

    # ---- recovery -----------------------------------------------------------------------------------
    def _on_fault(self, fault: Exception) -> None:
        """A step failed or a worker died: rebuild the worker group, or die when recovery is off,
        the engine is shutting down, or the fault came back after every recent recovery."""
        self._fault = None
        if self.recovery_timeout_s <= 0 or self.draining or self._stop.is_set():
            self._die(fault)
        elif self._recoveries_in_row >= MAX_RECOVERIES_IN_ROW:
            self._die(EngineDeadError(f"the fault came back after {self._recoveries_in_row} recoveries: {fault}"))
        else:
            self._recover(fault)

    def _recover(self, fault: Exception) -> None:
        """Requeue every request, rebuild the workers in a helper thread (up to the timeout) while
        this thread keeps beating and taking adds and aborts, then serve again."""
        start = time.monotonic()
        self._recoveries_in_row += 1
        self.recovering = True
        self.readiness.try_set(State.RECOVERING, f"worker failure: {fault}")
        resumed = self.core.requeue_after_worker_loss()
        logger.warning("worker group failed (%s): %d requests wait while it is rebuilt (up to %.0f s)",
                       fault, resumed, self.recovery_timeout_s)
        rebuilt: Future = Future()
        threading.Thread(target=_run_into, args=(rebuilt, self.core.reinitialize_workers, self.recovery_timeout_s),
                         name="worker-recovery", daemon=True).start()
        while not rebuilt.done() and not self._stop.is_set():
            self.readiness.beat()
            self._drain_inbox(block=True)
        self.recovering = False
        error = rebuilt.exception() if rebuilt.done() else EngineDeadError("stopped while recovering")
        if error is not None:
            self._die(error)
            return
        if self.core.executor.healthy:
            self._fault = None  # late reports of the replaced group's failure
        self.sleeping = False  # a rebuilt group is awake
        self.recoveries += 1
        self.last_recovery_s = time.monotonic() - start
        logger.warning("worker group recovered in %.2f s (recovery %d); %d requests resume",
                       self.last_recovery_s, self.recoveries, len(self.core.scheduler.waiting))
        self.readiness.try_set(State.READY, "worker group recovered")
        self._offer_load()

    def _die(self, error: Exception) -> None:
        if self.error is not None:
            return
        self.error = error if isinstance(error, EngineDeadError) else EngineDeadError(f"engine failed: {error}")
        logger.error("engine dead: %s", self.error)
        self.readiness.try_set(State.DEAD, str(self.error))
        if self.on_load is not None:
            self.on_load(None)  # the coordinator drops a dead engine
        for sink in self._sinks.values():
            sink.put(self.error)
        self._routes.clear()
        self._held_routes.clear()

    def _close_sinks(self) -> None:
        for sink in self._sinks.values():
            sink.put(END)


def _run_into(future: Future, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)``'s result or error into ``future`` (the body of a helper thread)."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - delivered to the waiting thread
        future.set_exception(exc)
