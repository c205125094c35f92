"""``KVTransfers``: a producer engine's prefilled requests whose KV blocks wait for a consumer.

Disaggregated prefill / decode (``--kv-role``, ``shared/kv_transfer.py``). On a producer a request
asked to run prefill-only stops after its first token; unless a stop rule of its own ended it, its
blocks stay referenced here (``hold``) under a fresh transfer id and token, and its final output
carries the ``KVTransferParams`` a consumer pulls with. The next step plan registers the transfer
with the workers (``kv_sends``); a transfer ends when a worker reports it pulled (``kv_sent``) or
when its deadline passes, and its blocks go back to the pool, the workers told first
(``kv_releases``, applied before that step writes any block). While transfers wait the engine keeps
polling its workers with empty steps (``waiting``), so a pull is noticed on an idle engine too.
A gateway that ends the request at its first token (a stop string it applies, a client gone) aborts
it here: the abort of a held request ``release``s its transfer at once (blocks freed, workers told),
instead of at the deadline.

A transfer moves every KV cache group of the model's plan (sliding-window layers beside full ones):
the prompt's blocks of each group, all held until the transfer ends. A window group's blocks wholly
before the window of the consumer's first step (the token after the prompt) are not sent: their
place in the group's list is the null block (``NULL_BLOCK``), whether this engine already freed
them or not.

``check_consumer`` is a consumer's check of the params a gateway hands it (role, pairing, sizes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from gridserve.services.engine.request import Request
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.kv_cache_spec import num_skipped_blocks
from gridserve.shared.kv_transfer import (
    NULL_BLOCK,
    KVSend,
    KVTransferParams,
    KVTransferStats,
    check_pairing,
    count_blocks,
    new_transfer,
)
from gridserve.shared.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

PRODUCERS = ("kv_producer", "kv_both")
CONSUMERS = ("kv_consumer", "kv_both")


@dataclass
class _Held:
    request: Request
    params: KVTransferParams
    num_blocks: int  # blocks the request holds (a window group's unsent ones too, until it ends)


class KVTransfers:
    """The transfers a producer holds, and the sends / releases its workers have not seen yet."""

    def __init__(self, config: GridserveConfig, windows: tuple[int, ...] = (0,)) -> None:
        self.config = config
        self.windows = windows  # each KV cache group's sliding window (0: keeps every token)
        self.timeout_s = config.cache.kv_transfer_timeout_s
        self.held: dict[str, _Held] = {}
        self._sends: list[KVSend] = []
        self._releases: list[str] = []
        # Workers that served a transfer whole so far: it ends when all of them did (each rank of a
        # TP / PP group serves its own shard, pulled by the consumer's worker of the same rank).
        self._served_by: dict[str, int] = {}
        self.world_size = config.parallel.world_size
        self.stats = KVTransferStats(kv_role=config.cache.kv_role or "")

    @property
    def waiting(self) -> bool:
        """Transfers wait for a consumer, or workers must still hear of a release."""
        return bool(self.held or self._releases)

    def hold(self, request: Request, block_ids: tuple[list[int], ...]) -> KVTransferParams:
        """Keep ``request``'s blocks (already referenced by it; ``block_ids``: its lists, one per KV
        cache group) for a consumer; its params."""
        transfer_id, token = new_transfer(request.request_id)
        cache, model = self.config.cache, self.config.model
        prompt = self.prompt_blocks(request.num_prompt_tokens, block_ids)
        params = KVTransferParams(
            transfer_id=transfer_id, token=token, worker_addresses=tuple(self.config.parallel.worker_addresses),
            block_ids=prompt[0], num_tokens=request.num_prompt_tokens,
            deadline_unix_s=time.time() + self.timeout_s, block_size=cache.block_size,
            kv_cache_dtype=cache.kv_cache_dtype, model=model.model, quantization=model.quantization or "",
            world_size=self.config.parallel.world_size,
            tensor_parallel_size=self.config.parallel.tensor_parallel_size,
            more_group_block_ids=prompt[1:])
        # what the request holds of the prompt (a block a window group already freed is null)
        num_blocks = count_blocks(tuple(ids[:len(prompt[0])] for ids in block_ids))
        self.held[transfer_id] = _Held(request, params, num_blocks)
        self._sends.append(KVSend(transfer_id, token, prompt[0], params.deadline_unix_s,
                                  prompt[1:]))
        self.stats.held_blocks += num_blocks
        return params

    def prompt_blocks(self, num_prompt_tokens: int,
                      block_ids: tuple[list[int], ...]) -> tuple[tuple[int, ...], ...]:
        """Per group, the blocks of a prompt of ``num_prompt_tokens`` a consumer pulls; in a window
        group, those wholly before the window of the token after the prompt are ``NULL_BLOCK``."""
        if len(block_ids) != len(self.windows):
            raise ValueError(f"block ids of {len(block_ids)} KV cache groups, the plan has "
                             f"{len(self.windows)}")
        block_size = self.config.cache.block_size
        num_blocks = -(-num_prompt_tokens // block_size)
        prompt = []
        for ids, window in zip(block_ids, self.windows):
            skipped = num_skipped_blocks(window, num_prompt_tokens, block_size)
            prompt.append((NULL_BLOCK,) * skipped + tuple(ids[skipped:num_blocks]))
        return tuple(prompt)

    def fill(self, plan: SchedulerOutput) -> None:
        """Hand the workers the sends and releases they have not seen, in this plan."""
        plan.kv_sends, self._sends = self._sends, []
        plan.kv_releases, self._releases = self._releases, []

    def pulled(self, transfer_ids: list[str], num_bytes: int) -> list[Request]:
        """Transfers workers served whole (one id per worker that did, from every rank's output):
        the requests whose transfers every rank has now served, whose blocks go back to the pool."""
        self.stats.bytes_sent += num_bytes
        complete = []
        for transfer_id in transfer_ids:
            if transfer_id not in self.held:
                continue
            served = self._served_by[transfer_id] = self._served_by.get(transfer_id, 0) + 1
            if served >= self.world_size:
                complete.append(transfer_id)
        done = self._end(complete)
        self.stats.transfers_sent += len(done)
        return done

    def release(self, request_ids: list[str]) -> list[Request]:
        """Held transfers of requests the gateway aborted (ended at their first token): no consumer
        will pull them; their requests (blocks to free now, not at the deadline)."""
        wanted = set(request_ids)
        if done := self._end([tid for tid, held in self.held.items() if held.request.request_id in wanted]):
            logger.debug("%d KV transfer(s) released unpulled: their requests were aborted", len(done))
        self.stats.transfers_released += len(done)
        return done

    def expire(self) -> list[Request]:
        """Transfers past their deadline, never pulled: their requests (blocks to free)."""
        now = time.time()
        late = [tid for tid, held in self.held.items() if held.params.deadline_unix_s <= now]
        if late:
            logger.warning("%d KV transfer(s) expired unpulled after %.0f s: blocks freed", len(late), self.timeout_s)
        done = self._end(late)
        self.stats.transfers_expired += len(done)
        return done

    def drop_all(self) -> list[Request]:
        """The workers lost their KV (recovery): every transfer ends; nothing left to release there."""
        done = [held.request for held in self.held.values()]
        self.held.clear()
        self._served_by.clear()
        self._sends, self._releases = [], []
        self.stats.held_blocks = 0
        return done

    def _end(self, transfer_ids: list[str]) -> list[Request]:
        done = []
        for transfer_id in transfer_ids:
            held = self.held.pop(transfer_id, None)
            self._served_by.pop(transfer_id, None)
            if held is None:
                continue
            unsent = [send for send in self._sends if send.transfer_id == transfer_id]
            if unsent:  # ended before any plan registered it: the workers never hear of it
                self._sends.remove(unsent[0])
            else:
                self._releases.append(transfer_id)
            self.stats.held_blocks -= held.num_blocks
            done.append(held.request)
        return done


def check_producer(config: GridserveConfig) -> None:
    """A prefill-only request needs a producer engine whose workers a consumer can reach."""
    if config.cache.kv_role not in PRODUCERS:
        raise InvalidArgumentError("kv_transfer_params", f"this engine's kv_role is {config.cache.kv_role!r}: "
                                   "prefill-only requests need --kv-role kv_producer or kv_both")
    if not config.parallel.worker_addresses:
        raise InvalidArgumentError("kv_transfer_params", "a producer's workers must be services (grpc executor) "
                                   "for consumers to pull from")


def check_consumer(config: GridserveConfig, params: KVTransferParams, num_prompt_tokens: int,
                   num_output_tokens: int) -> None:
    """A consumer's check of the params it is handed; each refusal names the field."""
    if config.cache.kv_role not in CONSUMERS:
        raise InvalidArgumentError("kv_transfer_params", f"this engine's kv_role is {config.cache.kv_role!r}: "
                                   "pulling KV needs --kv-role kv_consumer or kv_both")
    check_pairing(params, block_size=config.cache.block_size, kv_cache_dtype=config.cache.kv_cache_dtype,
                  model=config.model.model, quantization=config.model.quantization,
                  world_size=config.parallel.world_size,
                  tensor_parallel_size=config.parallel.tensor_parallel_size)
    if params.num_tokens != num_prompt_tokens:
        raise InvalidArgumentError("kv_transfer_params.num_tokens",
                                   f"{params.num_tokens} for a prompt of {num_prompt_tokens} tokens")
    num_blocks = -(-params.num_tokens // config.cache.block_size)
    for group, ids in enumerate(params.group_block_ids):
        if len(ids) != num_blocks:
            field = "block_ids" if group == 0 else f"more_group_block_ids[{group - 1}]"
            raise InvalidArgumentError(f"kv_transfer_params.{field}", f"{len(ids)} blocks of KV "
                                       f"cache group {group} for {params.num_tokens} tokens")
    if num_output_tokens < 1:
        raise InvalidArgumentError("output_token_ids", "a request with kv_transfer_params continues from the "
                                   "prefill engine's first token: send it as output")
