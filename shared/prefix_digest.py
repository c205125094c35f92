"""``PrefixDigest``: which prefix-cache blocks an engine holds, copied engine -> coordinator -> gateways.

The model (KV events, as in vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``):

* A digest is a set of 64-bit block keys (``prefix_hash.digest_key``): the full, hashed blocks of
  an engine's prefix cache, KV cache group 0. A key enters when a block with that hash is cached
  and leaves when the last such block is evicted; a prefix-cache reset (sleep, worker recovery,
  ``ResetPrefixCache``) clears them all. At most ``capacity`` keys: the engine's block count.
* The owner records changes as they happen (``block_stored`` / ``block_removed`` /
  ``cache_cleared``: it is the engine's ``PrefixCacheListener``) and ``commit``s them, which makes a
  new version: ``(epoch, seq)``, ``epoch`` drawn at random per digest (a restarted engine, a new
  copy at the coordinator: a new series), ``seq`` counting commits.
* ``since(cursor)`` is the ``DigestUpdate`` that brings a copy at version ``cursor`` up to date:
  the changes of the versions after it, merged (for each key its last change), when the recent
  ones are still kept (at most ``bound`` keys of changes, 4096 by default) and the merge stays
  within ``bound``; otherwise a *reset*: every key held, which replaces the copy. A copy that has
  nothing (``cursor`` None) or another epoch also gets a reset. So an update is either at most
  ``bound`` keys, or a snapshot of at most ``capacity``.
* ``apply(update)`` brings a copy up to date. A non-reset update must start at the version the
  copy has (``base_seq`` of the same epoch); one that does not is a *gap*: the copy empties and
  answers False, and its receiver reopens its stream, whose first update is a reset. A copy past
  its ``capacity`` is refused the same way. A copy is a digest too: the coordinator republishes
  its copies to every gateway with ``since``.

Recording and committing run on one thread (the engine loop); ``since`` and ``apply`` may run on
another (a lock guards the keys and the kept changes).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from gridserve.shared.prefix_hash import digest_key

logger = logging.getLogger(__name__)

DIGEST_BOUND = 4096  # most keys of changes one update carries (more: a reset instead)

Cursor = tuple[int, int]  # (epoch, seq): the version a copy holds


@dataclass(frozen=True)
class DigestUpdate:
    """Changes from version ``(epoch, base_seq)`` to ``(epoch, seq)``, or (``reset``) every key held
    at ``seq``; ``block_size`` and ``capacity`` (the engine's block count) travel with it."""

    epoch: int
    seq: int
    base_seq: int = 0
    reset: bool = False
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    block_size: int = 0
    capacity: int = 0

    @property
    def cursor(self) -> Cursor:
        return self.epoch, self.seq


class PrefixDigest:
    """An engine's prefix-cache keys (or a copy of them) and its recent changes."""

    def __init__(self, block_size: int, capacity: int, bound: int = DIGEST_BOUND,
                 epoch: Optional[int] = None) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.bound = bound
        self.epoch = secrets.randbits(63) if epoch is None else epoch
        self.seq = 0
        self.keys: set[int] = set()
        self.source: Optional[Cursor] = None  # a copy: the version of the digest it copies
        self._pending: dict[int, bool] = {}  # key -> held, the last change of each since the commit
        self._pending_reset = False
        self._log: deque[tuple[int, bool, dict[int, bool]]] = deque()  # (seq, reset, changes), oldest first
        self._logged = 0  # keys in the log
        self._lock = threading.Lock()

    @property
    def cursor(self) -> Cursor:
        return self.epoch, self.seq

    # ---- the owner's changes (the engine's PrefixCacheListener) ---------------------------------
    def block_stored(self, block_hash: bytes) -> None:
        self._pending[digest_key(block_hash)] = True

    def block_removed(self, block_hash: bytes) -> None:
        self._pending[digest_key(block_hash)] = False

    def cache_cleared(self) -> None:
        self._pending.clear()
        self._pending_reset = True

    def commit(self) -> bool:
        """Make the changes recorded since the last commit the next version; whether there were any."""
        if not self._pending and not self._pending_reset:
            return False
        with self._lock:
            changes, reset = self._pending, self._pending_reset
            self._pending, self._pending_reset = {}, False
            if reset:
                self.keys.clear()
            for key, held in changes.items():
                if held:
                    self.keys.add(key)
                else:
                    self.keys.discard(key)
            self.seq += 1
            self._keep(reset, changes)
        return True

    def _keep(self, reset: bool, changes: dict[int, bool]) -> None:
        if reset:  # nobody needs the versions before a reset: it replaces them
            self._log.clear()
            self._logged = 0
        self._log.append((self.seq, reset, changes))
        self._logged += len(changes)
        while self._log and self._logged > self.bound:
            self._logged -= len(self._log.popleft()[2])

    # ---- publishing -----------------------------------------------------------------------------
    def since(self, cursor: Optional[Cursor]) -> Optional[DigestUpdate]:
        """What brings a copy at ``cursor`` up to date (None: it is)."""
        with self._lock:
            if cursor == (self.epoch, self.seq):
                return None
            if cursor is not None and cursor[0] == self.epoch and cursor[1] < self.seq:
                merged = self._merged_after(cursor[1])
                if merged is not None:
                    reset, changes = merged
                    return DigestUpdate(self.epoch, self.seq, cursor[1], reset,
                                        tuple(k for k, held in changes.items() if held),
                                        () if reset else tuple(k for k, held in changes.items() if not held),
                                        self.block_size, self.capacity)
            return DigestUpdate(self.epoch, self.seq, 0, True, tuple(self.keys), (), self.block_size,
                                self.capacity)

    def _merged_after(self, seq: int) -> Optional[tuple[bool, dict[int, bool]]]:
        """The kept changes of the versions after ``seq`` as one (None: not all kept, or too many)."""
        if not self._log or self._log[0][0] > seq + 1:
            return None
        reset, merged = False, {}
        for version, was_reset, changes in self._log:
            if version <= seq:
                continue
            if was_reset:
                reset, merged = True, {}
            merged.update(changes)
        return (reset, merged) if len(merged) <= self.bound else None

    # ---- copying --------------------------------------------------------------------------------
    def apply(self, update: DigestUpdate) -> bool:
        """Bring this copy to ``update``'s version; False (and the copy empty) on a gap or beyond
        capacity: the receiver then needs a reset."""
        if not update.reset and self.source != (update.epoch, update.base_seq):
            logger.warning("prefix digest: an update from version %d of %x does not follow %s; waiting for "
                           "a full one", update.base_seq, update.epoch, self.source)
            self._drop()
            return False
        if update.reset:
            self._pending.clear()
            self._pending_reset = True
            self.block_size, self.capacity = update.block_size, update.capacity
        for key in update.stored:
            self._pending[key] = True
        for key in update.removed:
            self._pending[key] = False
        self.commit()
        self.source = update.cursor
        if len(self.keys) > self.capacity:
            logger.warning("prefix digest: %d keys exceed the engine's %d blocks; dropped", len(self.keys),
                           self.capacity)
            self._drop()
            return False
        return True

    def _drop(self) -> None:
        self._pending.clear()
        self._pending_reset = True
        self.commit()
        self.source = None

    @property
    def known(self) -> bool:
        """A copy that holds what its source published (not waiting for a reset)."""
        return self.source is not None

    def prefix_match(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (a prompt's blocks, in order) are held, counted from the first."""
        held = self.keys
        for i, key in enumerate(keys):
            if key not in held:
                return i
        return len(keys)
