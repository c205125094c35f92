"""Proto <-> domain conversion of prefix-cache digest updates (``coordinator.v1.PrefixDigest``), for
the engine's ``LoadReporter``, the coordinator's servicer and the gateway's ``LoadWatcher``."""

from __future__ import annotations

from typing import Optional

from gridserve.api.coordinator.v1 import coordinator_pb2
from gridserve.shared.prefix_digest import DigestUpdate


def digest_to_pb(update: DigestUpdate) -> coordinator_pb2.PrefixDigest:
    return coordinator_pb2.PrefixDigest(epoch=update.epoch, seq=update.seq, base_seq=update.base_seq,
                                        reset=update.reset, stored=update.stored, removed=update.removed,
                                        block_size=update.block_size, capacity=update.capacity)


def digest_from_pb(load: coordinator_pb2.EngineLoad) -> Optional[DigestUpdate]:
    """The digest update a load message carries (None: it carries none)."""
    if not load.HasField("prefix_digest"):
        return None
    msg = load.prefix_digest
    return DigestUpdate(msg.epoch, msg.seq, msg.base_seq, msg.reset, tuple(msg.stored), tuple(msg.removed),
                        msg.block_size, msg.capacity)
