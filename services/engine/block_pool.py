"""The pool of physical KV-cache blocks, with an LRU free list and a prefix-cache map.

The model (the contract the KV-cache manager and the worker rely on):

* There are ``num_blocks`` physical blocks, ids ``0 .. num_blocks - 1``. Block 0 is the *null
  block*: it is never handed out and never freed; the worker uses it as padding in block tables.
  So ``num_blocks - 1`` blocks are usable.
* A block is *in use* while ``ref_cnt > 0`` (several requests may share a prefix block). A block
  with ``ref_cnt == 0`` sits in the free list, in LRU order: blocks freed earlier are reused
  (evicted) first.
* A full block may carry a ``block_hash``. A freed block keeps its hash, so a later request can
  still hit it (``touch`` takes it back out of the free list) until ``get_new_blocks`` reuses it,
  which evicts the hash first.
* Every KV cache group draws from this one pool, and the same tokens hash alike in every group
  while their KV lives in different blocks, so the cache key names the group: the hash itself for
  group 0 (a model of one layer kind has only that group, and pays nothing), ``(hash, group)``
  for the others.
* A ``PrefixCacheListener`` (``listener``), when set, hears each group-0 hash enter the cache (its
  first block cached), leave it (its last block evicted) and the whole cache cleared (reset): the
  prefix-cache digest the engine publishes for cache-aware routing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Optional, Protocol

logger = logging.getLogger(__name__)


class PrefixCacheListener(Protocol):
    """Hears the prefix cache of KV cache group 0 change, on the thread that changes it."""

    def block_stored(self, block_hash: bytes) -> None:
        """``block_hash`` is cached now (a first block holds it)."""

    def block_removed(self, block_hash: bytes) -> None:
        """``block_hash`` is cached no more (its last block was evicted)."""

    def cache_cleared(self) -> None:
        """Every hash was dropped (a prefix-cache reset)."""


def cache_key(block_hash: bytes, group: int) -> bytes | tuple[bytes, int]:
    """The prefix-cache key of ``block_hash`` in KV cache group ``group``."""
    return block_hash if group == 0 else (block_hash, group)


class KVCacheBlock:
    """One physical block: its id, reference count, prefix-cache hash and free-list links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | tuple[bytes, int] | None = None  # the cache key (``cache_key``)
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = is_null

    def __repr__(self) -> str:
        key = self.block_hash
        h = None if key is None else key.hex()[:8] if isinstance(key, bytes) else f"{key[0].hex()[:8]}/g{key[1]}"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks: O(1) popleft, append and remove.

    The head is the least recently freed block (evicted first); ``append`` adds at the tail.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels keep every real node's prev/next non-None while it is in the list.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the list."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail (it will be evicted last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block!r} is already in the free list")
        last = self._tail.prev_free  # the head sentinel when the list is empty; never None
        last.next_free = block  # type: ignore[union-attr]
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head (next to evict) to tail. O(n); for tests and debugging."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free
        return out


class BlockPool:
    """Owns every ``KVCacheBlock``: hands out free blocks, counts references, maps hashes to blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i, is_null=(i == 0)) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        # hash -> {block_id: block}; several blocks may hold the same content when two requests
        # computed the same prefix at the same time.
        self.cached_block_hash_to_block: dict[bytes | tuple[bytes, int], dict[int, KVCacheBlock]] = {}
        self.listener: Optional[PrefixCacheListener] = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (0.0 .. 1.0)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free list, evicting their hashes."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {self.get_num_free_blocks()} free"
            )
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        holders = self.cached_block_hash_to_block.get(block.block_hash)
        if holders is not None:
            holders.pop(block.block_id, None)
            if not holders:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.listener is not None and isinstance(block.block_hash, bytes):  # group 0's key
                    self.listener.block_removed(block.block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free list (the null
        block, a window group's placeholder, is nobody's)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free-list tail in order.

        The hash is kept, so the block can still be hit until it is evicted.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"{block!r} freed more times than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Record ``hash -> block`` for ``blocks[num_cached_blocks:num_full_blocks]`` of KV cache
        group ``group``.

        ``block_hashes[i]`` is the hash of ``blocks[i]``. Blocks that already carry a hash (prefix
        hits) and null blocks (a window group's freed head) are left alone.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            block.block_hash = cache_key(block_hashes[i], group)
            holders = self.cached_block_hash_to_block.get(block.block_hash)
            if holders is None:
                holders = self.cached_block_hash_to_block[block.block_hash] = {}
                if self.listener is not None and group == 0:
                    self.listener.block_stored(block_hashes[i])
            holders[block.block_id] = block

    def get_cached_block(self, block_hash: bytes, group: int = 0) -> KVCacheBlock | None:
        """A block of group ``group`` holding the content with ``block_hash``, or None on a miss."""
        holders = self.cached_block_hash_to_block.get(cache_key(block_hash, group))
        if not holders:
            return None
        return next(iter(holders.values()))

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only possible when no block is in use; returns whether it was done."""
        num_used = self.num_usable_blocks - self.get_num_free_blocks()
        if num_used > 0:
            logger.warning("cannot reset the prefix cache: %d blocks still in use", num_used)
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.listener is not None:
            self.listener.cache_cleared()
        logger.info("prefix cache reset")
        return True
