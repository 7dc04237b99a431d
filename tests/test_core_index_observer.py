"""The index's one seam for what mirrors it (warm-restart records, a lower tier, KV events).

A real Index over a real Pool, with LRU and with the default policy: an observer hears every entry that
becomes visible, and every slot before it goes back to the pool — while the slot still holds the
block's bytes and before anything else can write it — for each way a slot is given back (eviction,
CLEAR, a failed store, a corrupt entry discarded); blocks that left while a ref still held them (their
slot comes back later); and each cleared namespace. Which of those were evictions the index returns
to its caller (``StorePlan.victims``), never through an observer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

from kvoffd.cache.index import Entry, Index, IndexObserver, Victims
from kvoffd.cache.policy import DEFAULT_POLICY
from kvoffd.pool.allocator import Pool

SLOT = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


class Recorder(IndexObserver):
    """Keeps what it is told, and what the slot held at that moment."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.gone_while_held: list[bytes] = []
        self.namespaces_cleared: list[str] = []
        self.shown: list[bytes] = []
        self.freed: list[tuple[bytes, bool, bytes]] = []  # key, was ready, first bytes of its slot

    def committed(self, entries: Sequence[Entry]) -> None:
        self.shown += [e.key for e in entries]

    def unlinked(self, entries: Sequence[Entry]) -> None:
        self.gone_while_held += [e.key for e in entries]

    def cleared(self, namespace: str) -> None:
        self.namespaces_cleared.append(namespace)

    def freeing(self, slot_bytes: int, entries: Sequence[Entry]) -> None:
        assert slot_bytes == SLOT
        for e in entries:
            assert e.dead
            self.freed.append((e.key, e.ready, bytes(self.pool.view(e.slot, 8))))


def _index(policy: str) -> tuple[Index, Recorder]:
    index = Index(Pool(4 * SLOT, chunk_bytes=4 * SLOT), policy)
    rec = Recorder(index.pool)
    index.observers.append(rec)
    return index, rec


def _store(index: Index, keys: list[bytes], ok: bool = True, victims: list[Victims] | None = None) -> list[Entry]:
    """A STORE; ``victims``: what it evicts is handed over there, then freed (as a caller with no tier does)."""
    t = index.table("obs", 0, 1, SLOT, (SLOT,))
    plan = index.prepare_store(t, keys, hand_over=victims is not None)
    for v in plan.victims:
        victims.append(v)
        index.free_victims(v)
    entries = index.add_pending(plan)
    for e in entries:  # the "copy": each slot holds its key's first bytes
        index.pool.view(e.slot, 8)[:] = memoryview(e.key[:8])
    index.complete_store(plan, ok)
    return entries


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
def test_observer_hears_commits_and_every_free_while_the_bytes_are_still_there(policy):
    index, rec = _index(policy)
    first = [key(i) for i in range(4)]
    _store(index, first)
    assert rec.shown == first
    assert rec.freed == []

    # A LOOKUP of the next chain makes the default policy admit it (second request); LRU admits anyway.
    more = [key(i) for i in range(10, 12)]
    victims: list[Victims] = []
    index.lookup("obs", b"".join(more))
    _store(index, more, victims=victims)
    index.lookup("obs", b"".join(more))
    _store(index, more, victims=victims)
    evicted = [k for k, ready, head in rec.freed]
    assert len(evicted) == 2 and set(evicted) <= set(first)
    assert all(ready and head == k[:8] for k, ready, head in rec.freed)  # bytes intact when told
    assert rec.shown[4:] == more
    assert [e.key for v in victims for e in v.entries] == evicted  # the store returned its victims

    # A failed store: its slots come back unready (nothing was committed).
    rec.freed.clear()
    index.clear("obs")
    cleared = {k for k, _, _ in rec.freed}
    assert cleared == (set(first) - set(evicted)) | set(more)
    assert rec.namespaces_cleared == ["obs"]
    rec.freed.clear()
    failed = _store(index, [key(20)], ok=False, victims=victims)
    assert sum(len(v.entries) for v in victims) == 2  # a CLEAR is no eviction, nor is a failed store
    assert [(k, ready) for k, ready, _ in rec.freed] == [(failed[0].key, False)]


def test_a_discarded_entry_is_freed_once_its_last_ref_drops():
    index, rec = _index("lru")
    (e,) = _store(index, [key(1)])
    hits = index.lookup("obs", e.key, with_entries=True)
    index.hold(hits)  # a LOAD reads it
    index.discard(e)
    assert rec.freed == [] and rec.gone_while_held == [key(1)]  # gone, but still read: slot kept
    index.release([e])
    assert [k for k, _, _ in rec.freed] == [key(1)]


def test_a_block_cleared_while_a_lease_holds_it_is_unlinked_then_freed_on_release():
    index, rec = _index("lru")
    held, free = _store(index, [key(1), key(2)])
    hits = index.lookup("obs", held.key, with_entries=True)
    index.hold(hits)
    index.clear("obs")
    assert rec.gone_while_held == [key(1)]
    assert [k for k, _, _ in rec.freed] == [key(2)]
    index.release([held])
    assert [k for k, _, _ in rec.freed] == [key(2), key(1)]


def test_a_deferred_slot_is_never_handed_out_until_released_and_is_invisible():
    """Victims handed over with their slots held (as a tier evicting ahead takes them): a slot kept for
    a spill is never handed out until released; a STORE's own victims are its slots."""
    pool = Pool(8 * SLOT, chunk_bytes=8 * SLOT)  # one chunk of 8 slots
    index = Index(pool, "lru")
    rec = Recorder(pool)
    index.observers.append(rec)

    def store(lo: int, n: int) -> list[int]:
        return [e.slot for e in _store(index, [key(i) for i in range(lo, lo + n)], victims=[])]

    first = store(0, 8)
    assert len(first) == 8
    ahead = index.take_victims(SLOT, 4)  # evicted, handed over: their slots held out of the pool
    assert ahead.held and len(ahead.entries) == 4 and rec.freed == [] and pool.used_bytes == 8 * SLOT
    assert index.lookup("obs", b"".join(e.key for e in ahead.entries)).n == 0  # dead: invisible
    index.free_victims(ahead, keep=ahead.entries)  # a spill still reads them all: deferred
    assert [k for k, _, _ in rec.freed] == [e.key for e in ahead.entries]  # told now, bytes intact
    assert index.deferral.deferred_bytes == 4 * SLOT
    deferred = {e.slot for e in ahead.entries}
    got = store(8, 4)  # evicts the other 4, whose slots are the store's own: none deferred
    assert len(got) == 4 and not set(got) & deferred and set(got) <= set(first)
    assert index.deferral.deferred_bytes == 4 * SLOT and pool.used_bytes == 8 * SLOT
    index.deferral.release(SLOT, sorted(deferred))
    assert index.deferral.deferred_bytes == 0
    reused = store(30, 4)
    assert set(reused) == deferred  # only the released ones came back
    index.deferral.release(SLOT, sorted(deferred))  # a second release is refused, not a double free
    assert index.deferral.deferred_bytes == 0 and pool.used_bytes == 8 * SLOT
