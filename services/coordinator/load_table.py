"""``LoadTable``: the coordinator's view of every engine's load, versioned so watchers wake on change.

Engines report (waiting, running, KV-cache usage) whenever it changes; an engine whose report stream
ends leaves the table. Watchers await ``wait_for_change`` until the version moves past theirs or
the publish interval passes (then they republish the same snapshot, so a gateway notices a silent
coordinator). ``bump`` wakes them for a change kept elsewhere (the MoE wave state). Everything but
``snapshot`` runs on the coordinator's event loop; ``snapshot`` may also be read from the metrics
thread (it copies the table in one step).

A report may carry a prefix-cache digest update: the table keeps a copy of each engine's digest
(``PrefixDigest``, a new one when the engine's report stream starts over), and a change to it is a
new version too; ``digest_since`` gives a watcher what its copy lacks. An update that does not
follow the copy (a gap) raises ``DigestGapError``: the engine's stream ends, and its next one
starts with the whole digest.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.load import EngineLoad
from gridserve.shared.prefix_digest import Cursor, DigestUpdate, PrefixDigest


class DigestGapError(InvalidArgumentError):
    """A digest update that does not start where the coordinator's copy is."""


@dataclass(frozen=True)
class Entry:
    """One engine's row: where it is, its latest load, and when that arrived."""

    dp_rank: int
    address: str
    load: EngineLoad
    reported_at: float = 0.0  # time.monotonic() of the report (the coordinator's clock)


class LoadTable:
    """The latest report of each engine (keyed by DP rank)."""

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._digests: dict[int, PrefixDigest] = {}  # the copy of each engine's prefix-cache digest
        self._version = 0
        self._changed = asyncio.Event()  # set (and replaced) on every new version

    def update(self, entry: Entry, digest: Optional[DigestUpdate] = None) -> None:
        old = self._entries.get(entry.dp_rank)
        self._entries[entry.dp_rank] = entry
        changed = old is None or _key(old) != _key(entry)
        if digest is not None:
            copy = self._digests.get(entry.dp_rank)
            if copy is None:
                copy = self._digests[entry.dp_rank] = PrefixDigest(digest.block_size, digest.capacity)
            if not copy.apply(digest):
                raise DigestGapError("load.prefix_digest", f"engine {entry.dp_rank}: version {digest.base_seq} "
                                     f"does not follow {copy.source} or exceeds {digest.capacity} blocks")
            changed = True
        if changed:
            self._bump()

    def remove(self, dp_rank: int) -> None:
        self._digests.pop(dp_rank, None)
        if self._entries.pop(dp_rank, None) is not None:
            self._bump()

    def digest_since(self, dp_rank: int, cursor: Optional[Cursor]) -> Optional[DigestUpdate]:
        """What a watcher's copy of engine ``dp_rank``'s digest at ``cursor`` lacks (None: nothing,
        or the engine publishes none)."""
        copy = self._digests.get(dp_rank)
        return None if copy is None else copy.since(cursor)

    def bump(self) -> None:
        """Wake every watcher (something they publish besides the loads changed)."""
        self._bump()

    def snapshot(self) -> tuple[int, list[Entry]]:
        """(version, entries sorted by DP rank)."""
        version, entries = self._version, dict(self._entries)
        return version, [entries[r] for r in sorted(entries)]

    async def wait_for_change(self, version: int, timeout: float) -> tuple[int, list[Entry]]:
        """The snapshot once the version differs from ``version``, or after ``timeout`` seconds."""
        if self._version == version:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.snapshot()

    def _bump(self) -> None:
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _key(entry: Entry) -> tuple:
    return entry.address, entry.load.routing_key()
