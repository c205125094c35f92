"""PrefixDigest: what an engine publishes of its prefix cache, and the copies that follow it."""

from __future__ import annotations

from gridserve.shared.prefix_digest import DigestUpdate, PrefixDigest
from gridserve.shared.prefix_hash import digest_key


def h(n: int) -> bytes:
    """A block hash whose digest key is ``n``."""
    return n.to_bytes(8, "little") + b"\x00" * 24


def _copy_of(source: PrefixDigest, cursor=None, copy: PrefixDigest | None = None) -> PrefixDigest:
    copy = copy or PrefixDigest(0, 0, bound=0)
    update = source.since(cursor if cursor is not None else copy.source)
    if update is not None:
        assert copy.apply(update)
    return copy


def test_stored_removed_and_cleared_make_versions_a_copy_follows():
    engine = PrefixDigest(block_size=16, capacity=100)
    copy = _copy_of(engine)  # version 0: an empty reset
    assert copy.known and copy.keys == set() and copy.block_size == 16 and copy.capacity == 100
    engine.block_stored(h(1))
    engine.block_stored(h(2))
    engine.block_stored(h(3))
    assert engine.keys == set()  # recorded, not committed
    assert engine.commit() and not engine.commit()  # a second commit with nothing new: no version
    update = engine.since(copy.source)
    assert not update.reset and sorted(update.stored) == [1, 2, 3] and update.base_seq == 0
    assert copy.apply(update) and copy.keys == {1, 2, 3}
    engine.block_removed(h(2))  # evicted
    engine.block_stored(h(4))
    engine.commit()
    update = engine.since(copy.source)
    assert update.stored == (4,) and update.removed == (2,)
    assert copy.apply(update) and copy.keys == {1, 3, 4} == engine.keys
    engine.cache_cleared()  # sleep / reset: everything goes, the next update says so
    engine.block_stored(h(9))
    engine.commit()
    update = engine.since(copy.source)
    assert update.reset and update.stored == (9,)
    assert copy.apply(update) and copy.keys == {9}
    assert engine.since(copy.source) is None  # up to date


def test_changes_since_an_older_version_are_merged_last_change_wins():
    engine = PrefixDigest(16, 100)
    first = engine.since(None)
    engine.block_stored(h(1))
    engine.commit()
    engine.block_stored(h(2))
    engine.commit()
    engine.block_removed(h(1))  # stored then evicted after the copy's version: nothing to add
    engine.commit()
    update = engine.since(first.cursor)
    assert update.base_seq == first.seq and update.seq == engine.seq == 3
    assert update.stored == (2,) and update.removed == (1,)


def test_a_gap_empties_the_copy_and_only_a_reset_repairs_it():
    engine = PrefixDigest(16, 100)
    copy = _copy_of(engine)
    engine.block_stored(h(1))
    engine.commit()
    lost = engine.since(copy.source)  # never delivered
    engine.block_stored(h(2))
    engine.commit()
    late = engine.since(lost.cursor)  # starts where the lost one ended
    assert not copy.apply(late)
    assert not copy.known and copy.keys == set()
    assert not copy.apply(late)  # still waiting for a reset
    assert copy.apply(engine.since(None)) and copy.keys == {1, 2}


def test_another_epoch_gets_a_reset():
    engine = PrefixDigest(16, 100)
    engine.block_stored(h(1))
    engine.commit()
    copy = _copy_of(engine)
    restarted = PrefixDigest(16, 100)  # the engine restarted: a new series
    update = restarted.since(copy.source)
    assert update.reset and update.stored == ()
    assert copy.apply(update) and copy.keys == set()


def test_more_changes_than_the_bound_become_a_full_snapshot():
    engine = PrefixDigest(16, capacity=10_000, bound=8)
    copy = _copy_of(engine)
    for n in range(5):
        engine.block_stored(h(n))
    engine.commit()
    small = engine.since(copy.source)
    assert not small.reset and len(small.stored) == 5
    for n in range(5, 25):  # 20 more: beyond the 8 kept
        engine.block_stored(h(n))
        engine.commit()
    update = engine.since(small.cursor)
    assert update.reset and sorted(update.stored) == list(range(25))
    copy.apply(small)
    assert copy.apply(update) and copy.keys == set(range(25))


def test_a_copy_holds_at_most_the_engines_block_count():
    copy = PrefixDigest(0, 0, bound=0)
    too_many = DigestUpdate(epoch=7, seq=1, reset=True, stored=tuple(range(11)), block_size=16, capacity=10)
    assert not copy.apply(too_many)
    assert copy.keys == set() and not copy.known
    assert copy.apply(DigestUpdate(7, 2, reset=True, stored=tuple(range(10)), block_size=16, capacity=10))
    assert not copy.apply(DigestUpdate(7, 3, base_seq=2, stored=(10,), block_size=16, capacity=10))
    assert copy.keys == set()


def test_a_copy_republishes_what_it_copies():
    """The coordinator's copy is a digest too: gateways follow it with ``since``."""
    engine = PrefixDigest(16, 100)
    coordinator = _copy_of(engine, copy=PrefixDigest(0, 0))
    gateway = _copy_of(coordinator)
    for n in range(1, 4):
        engine.block_stored(h(n))
        engine.commit()
        _copy_of(engine, copy=coordinator)
    engine.block_removed(h(2))
    engine.commit()
    _copy_of(engine, copy=coordinator)
    update = coordinator.since(gateway.source)
    assert not update.reset and update.epoch == coordinator.epoch != engine.epoch
    assert gateway.apply(update) and gateway.keys == {1, 3} == engine.keys
    assert (gateway.block_size, gateway.capacity) == (16, 100)


def test_prefix_match_counts_leading_held_keys():
    digest = PrefixDigest(16, 100)
    for n in (1, 2, 4):
        digest.block_stored(h(n))
    digest.commit()
    assert digest.prefix_match([1, 2, 3, 4]) == 2
    assert digest.prefix_match([5, 1]) == 0
    assert digest.prefix_match([]) == 0
    assert digest_key(h(42)) == 42
