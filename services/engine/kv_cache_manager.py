"""The KV-cache manager: which physical blocks each request owns, and the prefix cache.

The model (the contract the scheduler relies on):

* The model's layers form KV cache groups (``gridserve.shared.kv_cache_spec``); all draw from one
  ``BlockPool``. Every request owns a list of blocks per group (``req_to_blocks[id][g]``); block
  ``i`` holds the KV of tokens ``[i * block_size, (i + 1) * block_size)`` for that group's layers.
  The lists go to the worker's block tables (``block_ids[g]``). A model of one layer kind has one
  group, and everything below reads as for a single list.
* A sliding-window group frees the blocks its window no longer sees: before a step, every block
  wholly before ``num_computed_tokens - window + 1`` goes back to the pool (keeping its hash) and
  its place in the list becomes the null block. So a long request holds about ``window /
  block_size + 1`` blocks there between steps; a prefill chunk still gets every block it writes.
* ``get_computed_blocks(request)`` looks up the longest run of leading *full* blocks already in the
  cache. It never reports the whole request as computed: at least one token is left to compute so
  the step produces logits. With several groups, a hit of ``n`` blocks must hold in every group: a
  full group needs all ``n`` cached, a window group only the blocks the window of the next token
  reaches (the ones before are null in its list, never touched); the longest ``n`` all agree on is
  the hit (vLLM's rule).
* ``allocate_slots(...)`` makes room for ``num_computed_tokens + num_new_computed_tokens +
  num_new_tokens`` tokens. It is all or nothing: on ``None`` nothing changed (the scheduler then
  preempts or waits). On success it also records the hash of every block that becomes full with
  tokens computed in this step, so later requests can hit it.
* ``free(request)`` returns the request's blocks tail first, so the free list evicts a sequence's
  tail before its head (the head is the more widely shared prefix); null entries are skipped.
* Block hashes chain: ``hash(block i) = sha256(hash(block i-1), tokens of block i, extra keys)``;
  the request's ``cache_salt`` and LoRA adapter ``(lora_name, lora_int_id)`` go into the first
  block's extra keys, so they reach every block;
  a block that covers image tokens has each such image's content hash (and where the block cuts
  it) in its extra keys, so the same image hits and a different image at the same place misses.
  The hashes are stable across processes (``gridserve.shared.prefix_hash``, which a gateway that
  routes by cached prefix computes them with too).
* ``watch_prefix_cache(listener)`` tells a ``PrefixCacheListener`` which hashes enter and leave the
  prefix cache (the pool's events; the DP load report publishes them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gridserve.services.engine.block_pool import BlockPool, KVCacheBlock, PrefixCacheListener
from gridserve.services.engine.request import Request
from gridserve.shared.kv_cache_spec import (
    FULL,
    KVCacheGroup,
    num_blocks_for_memory,
    num_skipped_blocks,
)
from gridserve.shared.prefix_hash import extend_block_hashes

__all__ = ["KVCacheManager", "num_blocks_for_memory"]

logger = logging.getLogger(__name__)


class KVCacheManager:
    """Allocates blocks to requests, per KV cache group, and serves prefix-cache hits, on top of one
    ``BlockPool``. ``groups`` defaults to one full-attention group."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroup] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups: tuple[KVCacheGroup, ...] = tuple(groups) if groups else (KVCacheGroup(FULL, ()),)
        self.windows = tuple(g.sliding_window for g in self.groups)  # 0: keeps every token
        self.has_windows = any(self.windows)
        self.num_groups = len(self.groups)
        self._no_hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in self.groups)  # never mutated
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.null_block = self.block_pool.null_block
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        # How many leading blocks of each request, per group, already have their hash in the pool.
        self.num_cached_blocks: dict[str, list[int]] = {}
        self.blocks_in_use = [0] * self.num_groups  # distinct blocks each group holds
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Lookups of requests resuming after preemption (they mostly hit their own blocks).
        self.preempted_prefix_cache_queries = 0
        self.preempted_prefix_cache_hits = 0
        # Requests whose blocks hold KV still being pulled from a producer (P/D): their hashes are
        # not published to the prefix cache until the pull is confirmed (a failed one leaves garbage).
        self._deferred: set[str] = set()

    # ---- sizes and stats -------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def group_usage(self) -> list[tuple[str, int]]:
        """(group name, blocks it holds) per group: the pool's use split by group."""
        return [(g.name, n) for g, n in zip(self.groups, self.blocks_in_use)]

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (0 where a window group freed a block)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return tuple([] for _ in self.groups)
        return tuple([b.block_id for b in group] for group in blocks)

    # ---- hashing ---------------------------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of ``all_token_ids``."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            lora = request.lora_request.cache_key if request.lora_request is not None else None
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
                                lora, request.mm_features)

    # ---- the scheduler's interface ---------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest cached prefix every group can serve: its blocks per group and the number of
        tokens it covers (a window group's list starts with null blocks it does not need).

        The blocks are not referenced yet: pass them to ``allocate_slots`` in the same step.
        """
        if not self.enable_caching:
            return tuple([] for _ in self.groups), 0
        self._update_block_hashes(request)
        # Leave at least one token to compute, so the step yields logits.
        num_hit = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        hashes = request.block_hashes
        while True:  # each group can only shorten the hit; stop when all agree
            agreed = num_hit
            for g, window in enumerate(self.windows):
                num_hit = self._window_hit(hashes, g, window, num_hit) if window else self._full_hit(hashes, g, num_hit)
            if num_hit == agreed or self.num_groups == 1:
                break
        computed = []
        for g, window in enumerate(self.windows):
            skipped = num_skipped_blocks(window, num_hit * self.block_size, self.block_size)
            blocks = [self.null_block] * skipped
            blocks += [self.block_pool.get_cached_block(h, g) for h in hashes[skipped:num_hit]]
            computed.append(blocks)
        return tuple(computed), num_hit * self.block_size

    def _full_hit(self, hashes: list[bytes], group: int, limit: int) -> int:
        """Leading blocks of ``hashes[:limit]`` cached in ``group``."""
        for i in range(limit):
            if self.block_pool.get_cached_block(hashes[i], group) is None:
                return i
        return limit

    def _window_hit(self, hashes: list[bytes], group: int, window: int, limit: int) -> int:
        """The longest hit of at most ``limit`` blocks for which ``group`` holds the blocks the next
        token's window reaches (the ``ceil((window - 1) / block_size)`` blocks before the hit's end,
        or every block from the first when the hit is shorter than that)."""
        needed = -(-(window - 1) // self.block_size)
        if needed == 0:
            return limit
        run = 0
        for i in range(limit - 1, -1, -1):
            if self.block_pool.get_cached_block(hashes[i], group) is None:
                run = 0
                continue
            run += 1
            if run == needed:
                return i + needed
        return run  # a run from block 0 on: the hit starts the sequence, no window before it

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """Make room for this step's tokens; return the newly allocated block ids per group, or None.

        ``new_computed_blocks``/``num_new_computed_tokens`` are the prefix hits from
        ``get_computed_blocks`` (only for a request that holds no blocks yet); passing them, even
        empty, counts the lookup in the query / hit counters once it succeeds. On None nothing
        changed, except that window groups may have freed blocks their window no longer sees. The
        returned ids exclude the prefix-hit blocks. ``num_lookahead_tokens``: slots past the step's
        tokens (a speculative draft model's proposals), reserved but never cached.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(
                f"token counts must be non-negative, got {num_new_tokens}, {num_new_computed_tokens}"
            )
        looked_up = new_computed_blocks is not None
        hits = self._per_group(new_computed_blocks) if new_computed_blocks else self._no_hits
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is not None:
            if hits is not self._no_hits and any(hits):
                raise ValueError(f"{request.request_id}: prefix hits given for a request that holds blocks")
            if self.has_windows:
                self._free_skipped(request, req_blocks)

        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-(num_tokens_after + num_lookahead_tokens) // self.block_size)
        held = req_blocks or self._no_hits
        num_new_blocks = [max(0, num_required - len(held[g]) - len(hits[g])) for g in range(self.num_groups)]
        # Touching a free prefix-hit block takes it out of the free list, too.
        num_evictable_hits = sum(1 for group in hits for b in group if b.ref_cnt == 0 and not b.is_null)
        if sum(num_new_blocks) > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = tuple([] for _ in self.groups)
            self.num_cached_blocks[request.request_id] = [0] * self.num_groups
        num_cached = self.num_cached_blocks[request.request_id]
        # Every group's hits first: a new block of one group must never be another's free hit.
        if hits is not self._no_hits:
            for g in range(self.num_groups):
                free_before = self.block_pool.get_num_free_blocks()
                self.block_pool.touch(hits[g])
                self.blocks_in_use[g] += free_before - self.block_pool.get_num_free_blocks()
                req_blocks[g].extend(hits[g])
                num_cached[g] += len(hits[g])
        new_ids = []
        for g in range(self.num_groups):
            if not num_new_blocks[g]:
                new_ids.append([])
                continue
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks[g])
            self.blocks_in_use[g] += len(new_blocks)
            req_blocks[g].extend(new_blocks)
            new_ids.append([b.block_id for b in new_blocks])

        if self.enable_caching and request.request_id not in self._deferred:
            if looked_up and request.num_preemptions:  # a resumed request: counted apart (vLLM)
                self.preempted_prefix_cache_queries += request.num_tokens
                self.preempted_prefix_cache_hits += num_new_computed_tokens
            elif looked_up:  # counted once per admission, not per failed attempt
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
            self._update_block_hashes(request)
            # Blocks full of tokens computed up to the end of this step.
            full = min(num_tokens_after // self.block_size, len(request.block_hashes))
            for g in range(self.num_groups):
                num_full = min(full, len(req_blocks[g]))
                if num_full > num_cached[g]:
                    self.block_pool.cache_full_blocks(req_blocks[g], request.block_hashes, num_cached[g], num_full, g)
                    num_cached[g] = num_full
        return tuple(new_ids)

    def _per_group(self, blocks: Sequence | None) -> tuple[list[KVCacheBlock], ...]:
        """Prefix hits as one list per group (a flat list is the single group's)."""
        if not blocks:
            return tuple([] for _ in self.groups)
        if isinstance(blocks[0], KVCacheBlock):
            if self.num_groups != 1:
                raise ValueError(f"prefix hits must be given per group ({self.num_groups} groups)")
            return (list(blocks),)
        if len(blocks) != self.num_groups:
            raise ValueError(f"prefix hits for {len(blocks)} groups, the cache has {self.num_groups}")
        return tuple(list(group) for group in blocks)

    def _free_skipped(self, request: Request, req_blocks: tuple[list[KVCacheBlock], ...]) -> None:
        """Window groups: return the blocks wholly outside the next token's window (tail first)."""
        for g, window in enumerate(self.windows):
            if not window:
                continue
            blocks = req_blocks[g]
            skipped = min(num_skipped_blocks(window, request.num_computed_tokens, self.block_size), len(blocks))
            done = [b for b in blocks[:skipped] if not b.is_null]
            if not done:
                continue
            free_before = self.block_pool.get_num_free_blocks()
            self.block_pool.free_blocks(reversed(done))
            self.blocks_in_use[g] -= self.block_pool.get_num_free_blocks() - free_before
            blocks[:skipped] = [self.null_block] * skipped

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``ceil(num_tokens / block_size)`` of every group
        (speculative decoding's rejected drafts: slots reserved for tokens that did not come)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        keep = -(-num_tokens // self.block_size)
        for g, group in enumerate(blocks):
            tail = [b for b in group[keep:] if not b.is_null]
            del group[keep:]
            if tail:
                free_before = self.block_pool.get_num_free_blocks()
                self.block_pool.free_blocks(reversed(tail))
                self.blocks_in_use[g] -= self.block_pool.get_num_free_blocks() - free_before
            cached = self.num_cached_blocks[request.request_id]
            cached[g] = min(cached[g], len(group))

    def free(self, request: Request) -> None:
        """Return the request's blocks (tail first) and forget it. Freeing twice is a no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self._deferred.discard(request.request_id)
        if not blocks:
            return
        for g, group in enumerate(blocks):
            free_before = self.block_pool.get_num_free_blocks()
            self.block_pool.free_blocks(reversed(group))
            self.blocks_in_use[g] -= self.block_pool.get_num_free_blocks() - free_before

    def defer_caching(self, request_id: str) -> None:
        """Keep the request's blocks out of the prefix cache until ``confirm_caching`` (P/D: their KV
        arrives from a producer and may not come)."""
        self._deferred.add(request_id)

    def confirm_caching(self, request_id: str) -> None:
        """The request's KV is real: its full blocks enter the prefix cache at its next allocation."""
        self._deferred.discard(request_id)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; fails (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def watch_prefix_cache(self, listener: PrefixCacheListener) -> None:
        """Tell ``listener`` every (group 0) hash that enters or leaves the prefix cache from now on.
        Set it before the first request: the hashes cached before are not replayed."""
        self.block_pool.listener = listener
