"""Disaggregated prefill / decode on the worker: the ``KVTransfer`` service and the step hook.

``KVTransferServicer`` serves ``worker.v1.KVTransfer.PullBlocks`` next to the worker's own service:
a consumer's worker (only the deployment's ``worker`` identity: the ``RULES`` row) presents a
transfer id and its token and gets the blocks as checksummed ``common.v1.Tensor`` chunks, read by
the connector in a thread (never on the event loop).

``KVStepHook`` runs around every ``execute_model`` (the worker servicer calls it): before the step it
applies the plan's ``kv_releases`` and ``kv_sends`` to the connector (a released transfer is no
longer served once the step that may reuse its blocks runs) and pulls the KV of every new request
that carries ``kv_load`` into its first blocks of every KV cache group (``block_ids[g]``); a request
whose pull failed is taken out of this and every later step until the engine tells the worker to
forget it (``finished_req_ids``), and reported once in ``ModelRunnerOutput.kv_load_failed`` (the
engine then computes its prompt). After the step it adds the transfers pulled from this worker
(``kv_sent``) and the bytes moved.

Engines of several workers (TP / PP, same shape on both sides): the worker of rank r pulls its own
shard (its layers, its KV heads) from the producer's worker of rank r; the ranks then agree on the
failed pulls (``agree``: OR over the worker group) so every rank leaves the same requests out of
the step (a batch that differed between ranks would break the collectives). Every rank, not only
the output rank, reports what it served (``report``), so the producer engine frees a transfer once
every rank's shard was pulled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Optional

import grpc

from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.services.worker.kv_connector import (
    KVConnector,
    KVTransferError,
    TransferNotFound,
    TransferRefused,
    chunk_to_pb,
)
from gridserve.shared.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name


class KVTransferServicer(worker_pb2_grpc.KVTransferServicer):
    """``PullBlocks``: a registered transfer's blocks, chunk by chunk."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector

    async def PullBlocks(self, request: worker_pb2.PullBlocksRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PullBlocksResponse]:
        chunks = self.connector.serve(request.transfer_id, request.token, request.release)
        while True:
            try:
                chunk = await asyncio.to_thread(next, chunks, None)
            except TransferRefused as exc:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            except TransferNotFound as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
            if chunk is None:
                return
            yield chunk_to_pb(chunk)


class KVStepHook:
    """The connector's part of each step (see the module docstring). Runs on the worker thread."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector
        # This worker's rank in its engine's group, and how ranks agree on failed pulls (set by the
        # servicer once the worker's device is up; a single worker keeps the defaults).
        self.rank = 0
        self.agree: Optional[Callable[[list[bool]], list[bool]]] = None
        self._left_out: set[str] = set()  # pulls failed: out of every step until forgotten
        self._failed_now: dict[str, str] = {}
        self._bytes_received = 0

    def before_step(self, plan: SchedulerOutput) -> SchedulerOutput:
        for transfer_id in plan.kv_releases:
            self.connector.release(transfer_id)
        for send in plan.kv_sends:
            self.connector.register(send)
        self._left_out -= plan.finished_req_ids
        loads = [new for new in plan.scheduled_new_reqs if new.kv_load is not None]
        errors: list[Optional[str]] = []
        for new in loads:
            try:
                local = self._local_blocks(new)
                self._bytes_received += self.connector.pull(new.kv_load, local, self.rank)
                errors.append(None)
            except KVTransferError as exc:
                logger.warning("request %s: KV pull failed (%s); the engine computes its prompt", new.req_id, exc)
                errors.append(str(exc))
        failed = [e is not None for e in errors]
        if self.agree is not None and loads:  # every rank holds the same plan: same flags, same order
            failed = self.agree(failed)
        for new, error, fail in zip(loads, errors, failed):
            if fail:
                self._failed_now[new.req_id] = error or "the pull failed on another worker of this engine"
                self._left_out.add(new.req_id)
        return self._without(plan, self._left_out) if self._left_out else plan

    @staticmethod
    def _local_blocks(new: NewRequestData) -> tuple[list[int], ...]:
        """The request's first blocks of each KV cache group, as many as the producer's list has."""
        theirs = new.kv_load.group_block_ids
        return tuple(ids[:len(remote)] for ids, remote in zip(new.block_ids, theirs))

    def after_step(self, out: ModelRunnerOutput) -> None:
        out.kv_sent, out.kv_bytes_sent = self.connector.take_sent()
        out.kv_load_failed, self._failed_now = self._failed_now, {}
        out.kv_bytes_received, self._bytes_received = self._bytes_received, 0

    def report(self) -> Optional[ModelRunnerOutput]:
        """A rank other than the output rank: what it served and pulled since its last report, as an
        output holding only those fields (None when there is nothing to say). Its failed pulls are
        the output rank's too (agreed), so they are not repeated."""
        sent, bytes_sent = self.connector.take_sent()
        self._failed_now = {}
        received, self._bytes_received = self._bytes_received, 0
        if not (sent or bytes_sent or received):
            return None
        return ModelRunnerOutput(kv_sent=sent, kv_bytes_sent=bytes_sent, kv_bytes_received=received)

    @staticmethod
    def _without(plan: SchedulerOutput, left_out: set[str]) -> SchedulerOutput:
        """The plan without ``left_out``'s requests (their tokens taken out of the total)."""
        counts = {r: n for r, n in plan.num_scheduled_tokens.items() if r not in left_out}
        return dataclasses.replace(
            plan,
            scheduled_new_reqs=[r for r in plan.scheduled_new_reqs if r.req_id not in left_out],
            scheduled_cached_reqs=[r for r in plan.scheduled_cached_reqs if r.req_id not in left_out],
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=sum(counts.values()),
            scheduled_spec_tokens={r: t for r, t in plan.scheduled_spec_tokens.items() if r not in left_out},
        )
