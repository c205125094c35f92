"""The KV-cache manager: which physical blocks each request owns, and the prefix cache.

The model (the contract the scheduler relies on):

* Every request owns a list of blocks (``req_to_blocks``); block ``i`` holds the KV of tokens
  ``[i * block_size, (i + 1) * block_size)``. The block ids go to the worker's block table.
* ``get_computed_blocks(request)`` looks up the longest run of leading *full* blocks already in the
  cache. It never reports the whole request as computed: at least one token is left to compute so
  the step produces logits.
* ``allocate_slots(...)`` makes room for ``num_computed_tokens + num_new_computed_tokens +
  num_new_tokens`` tokens. It is all or nothing: on ``None`` nothing changed (the scheduler then
  preempts or waits). On success it also records the hash of every block that becomes full with
  tokens computed in this step, so later requests can hit it.
* ``free(request)`` returns the request's blocks tail first, so the free list evicts a sequence's
  tail before its head (the head is the more widely shared prefix).
* Block hashes chain: ``hash(block i) = sha256(hash(block i-1), tokens of block i, extra keys)``;
  the request's ``cache_salt`` goes into the first block's extra keys, so it reaches every block;
  a block that covers image tokens has each such image's content hash (and where the block cuts
  it) in its extra keys, so the same image hits and a different image at the same place misses.
  The hashes are stable across processes (no Python ``hash()``, no pickle).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence

from gridserve.services.engine.block_pool import BlockPool, KVCacheBlock
from gridserve.services.engine.request import Request
from gridserve.shared.errors import ConfigError

logger = logging.getLogger(__name__)


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """SHA-256 of (parent hash, token ids, extra keys) over a deterministic byte encoding."""
    h = hashlib.sha256()
    # Length-prefix each field so that different splits can never produce the same bytes.
    parent = parent_hash or b""
    h.update(len(parent).to_bytes(4, "little"))
    h.update(parent)
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)  # little endian: same on every host
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(tokens)
    extra = repr(tuple(extra_keys)).encode("utf-8") if extra_keys else b""
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


def _extra_keys(request: Request, start: int, end: int) -> tuple | None:
    """What besides its tokens keys the block ``[start, end)``: the salt (first block) and the
    content hash of every image whose tokens it covers, with the offset of the block's first one
    inside the image (an image split across blocks keys each block by its own part)."""
    keys: list = [request.cache_salt] if start == 0 and request.cache_salt is not None else []
    for image in request.mm_features:
        if image.overlaps(start, end):
            keys.append((image.identifier, max(start, image.offset) - image.offset))
    return tuple(keys) or None


def num_blocks_for_memory(kv_cache_memory_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """How many blocks (the null block included) fit in ``kv_cache_memory_bytes``."""
    if bytes_per_token < 1:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    if block_size < 1:
        raise ConfigError("cache.block_size", f"must be a positive integer, got {block_size}")
    bytes_per_block = bytes_per_token * block_size
    num_blocks = kv_cache_memory_bytes // bytes_per_block
    if num_blocks < 2:
        raise ConfigError(
            "cache.kv_cache_memory_bytes",
            f"{kv_cache_memory_bytes} bytes hold {num_blocks} blocks of {bytes_per_block} bytes; "
            f"at least 2 are needed (one is the null block), i.e. {2 * bytes_per_block} bytes",
        )
    return num_blocks


class KVCacheManager:
    """Allocates blocks to requests and serves prefix-cache hits, on top of a ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request already have their hash recorded in the pool.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Lookups of requests resuming after preemption (they mostly hit their own blocks).
        self.preempted_prefix_cache_queries = 0
        self.preempted_prefix_cache_hits = 0

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

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ---- hashing ---------------------------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of ``all_token_ids``."""
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = _extra_keys(request, i * bs, (i + 1) * bs)
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs:(i + 1) * bs], extra))

    # ---- the scheduler's interface ---------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached run of leading full blocks and the number of tokens it covers.

        The blocks are not referenced yet: pass them to ``allocate_slots`` in the same step.
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        # Leave at least one token to compute, so the step yields logits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for this step's tokens; return the newly allocated block ids, or None.

        ``new_computed_blocks``/``num_new_computed_tokens`` are the prefix hits from
        ``get_computed_blocks`` (only for a request that holds no blocks yet); passing them, even
        empty, counts the lookup in the query / hit counters once it succeeds. On None nothing
        changed. The returned ids exclude the prefix-hit blocks.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(
                f"token counts must be non-negative, got {num_new_tokens}, {num_new_computed_tokens}"
            )
        looked_up = new_computed_blocks is not None
        new_computed_blocks = list(new_computed_blocks or [])
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        if new_computed_blocks and req_blocks:
            raise ValueError(f"{request.request_id}: prefix hits given for a request that holds blocks")

        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_tokens_after // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Touching a free prefix-hit block takes it out of the free list, too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_cached = self.num_cached_blocks.get(request.request_id, 0) + len(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        self.num_cached_blocks[request.request_id] = num_cached

        if self.enable_caching:
            if looked_up and request.num_preemptions:  # a resumed request: counted apart (vLLM)
                self.preempted_prefix_cache_queries += request.num_tokens
                self.preempted_prefix_cache_hits += num_new_computed_tokens
            elif looked_up:  # counted once per admission, not per failed attempt
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
            self._update_block_hashes(request)
            # Blocks full of tokens computed up to the end of this step.
            num_full = min(num_tokens_after // self.block_size, len(request.block_hashes), len(req_blocks))
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
                self.num_cached_blocks[request.request_id] = num_full
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Return the request's blocks (tail first) and forget it. Freeing twice is a no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; fails (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()
