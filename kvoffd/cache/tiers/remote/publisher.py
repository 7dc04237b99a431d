"""``Publisher``: blocks admitted into the pool are written behind to the cluster (``RemoteTier.publish``),
so that other nodes find them while they are still in this node's pool, not only once evicted.

Rules:
* It observes the index (``committed``) and, one loop callback later (an observer never calls back into
  the index from inside a call), takes one ref on each block still visible: a held block is never
  evicted, so its slot's bytes stay put while the publisher's thread reads them; the ref drops when the
  publish ends or is dropped (``release``).
* Bounded: at most ``HELD_SHARE`` of the pool's bytes are held for publishing at once (more would
  leave STOREs without evictable slots: a pool of held blocks refuses stores); past it a block is not
  published now (counted ``skipped_held``) but when it is evicted (the spill path). ``RemoteTier.publish``
  keeps at most its ``queue_blocks`` waiting and drops the oldest; blocks this node already knows the
  cluster holds are not queued.
* Every rank's blocks are published (each rank's table is its own namespace identity in the store).
* A value's header carries the block's pool checksum where the pool has one (``EntrySums``): summed
  once, and a block whose bytes changed in the pool since is refused by the node that fetches it.
* No Python step per block on the loop: a turn's admitted blocks are read as arrays (their keys as one
  binary, their flags and slots through ``map``), filtered with numpy, and their slots' views are made on
  the publisher's thread (``SlotViews``). What stays per block is the index's own ref taking.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from kvoffd.cache.entries import Entry, Table
from kvoffd.cache.index import Index
from kvoffd.cache.observer import IndexObserver
from kvoffd.cache.tiers.base import SpillResult, TableRef
from kvoffd.cache.tiers.remote.tier import RemoteTier

HELD_SHARE = 8  # 1/8 of the pool at most held by publishing
_KEY = 32
_key_of, _slot_of, _table_of = attrgetter("key"), attrgetter("slot"), attrgetter("table")
_ready_of, _dead_of = attrgetter("ready"), attrgetter("dead")


class SlotViews(Sequence[memoryview]):
    """The pool slots a publish reads, as a sequence of memoryviews made when read (on the publisher's
    thread, ~0.2 µs each) rather than all of them on the loop when queued. Holds a view of the pool's
    buffer while it lives: dropped with the publish job."""

    __slots__ = ("_mv", "_slots", "_size")

    def __init__(self, buf: np.ndarray, slots: np.ndarray, size: int):
        self._mv = memoryview(buf)
        self._slots = slots.tolist()
        self._size = size

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._slots)))]
        s = self._slots[i]
        return self._mv[s:s + self._size]


class EntrySums(Sequence[int]):
    """The entries' pool checksums (``Entry.checksum``), read when asked: on the publisher's thread as it
    takes the batch, by which time the pool file's sealing (kvoffd/cache/restart/) may have summed
    blocks that had none when they were queued (-1: the header sums them itself)."""

    __slots__ = ("_entries",)

    def __init__(self, entries: list[Entry]):
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [e.checksum for e in self._entries[i]]
        return self._entries[i].checksum


def _objects(entries: list[Entry]) -> np.ndarray:
    """``entries`` as an object array, so that a mask picks them without a Python step per entry."""
    out = np.empty(len(entries), dtype=object)
    out[:] = entries
    return out


class Publisher(IndexObserver):
    def __init__(self, index: Index, tier: RemoteTier):
        self.index = index
        self.tier = tier
        self.max_held_bytes = index.pool.capacity_bytes // HELD_SHARE
        self.held_bytes = 0
        self.skipped_held = 0  # admitted blocks not published behind: the held share was full
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Sequence[Entry]] = []  # the batches committed this loop turn, held at the next callback
        self.published = 0  # blocks handed to the tier's write-behind queue

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def committed(self, entries: Sequence[Entry]) -> None:
        if self._loop is None or not entries:
            return
        if not self._pending:
            self._loop.call_soon(self._take)
        self._pending.append(entries)

    def _ref(self, t: Table) -> TableRef | None:
        ns = self.index.namespaces.get(t.namespace)
        if ns is None or t.rank not in ns.layouts:
            return None
        return TableRef(t.namespace, t.rank, ns.world_size, ns.layouts[t.rank])

    def _take(self) -> None:
        """The turn's committed blocks, by table: those still visible that this node does not know the
        cluster holds, within the held share, held and queued for publishing."""
        batches, self._pending = self._pending, []
        es = list(itertools.chain.from_iterable(batches))
        if not es:
            return
        objs = _objects(es)
        tables = list(map(_table_of, es))
        if tables.count(tables[0]) == len(tables):  # the usual turn: one table
            groups = [(tables[0], objs)]
        else:
            ids = np.fromiter(map(id, tables), dtype=np.uintp, count=len(tables))
            _, first, inv = np.unique(ids, return_index=True, return_inverse=True)
            groups = [(tables[f], objs[inv == g]) for g, f in enumerate(first.tolist())]
        for t, group in groups:
            self._publish(t, group)

    def _publish(self, t: Table, group: np.ndarray) -> None:
        ref = self._ref(t)
        if ref is None:
            return
        es = group.tolist()
        n = len(es)
        keys = b"".join(map(_key_of, es))
        alive = np.fromiter(map(_ready_of, es), dtype=bool, count=n) & \
            ~np.fromiter(map(_dead_of, es), dtype=bool, count=n)  # not evicted or cleared since
        pick = np.flatnonzero(alive & ~self.tier.contains(ref, keys))
        size = t.slot_bytes
        room = max(0, self.max_held_bytes - self.held_bytes) // size
        if len(pick) > room:
            self.skipped_held += len(pick) - room
            self.tier.note_held_full(len(pick) - room)
            pick = pick[:room]
        if not len(pick):
            return
        sel = group[pick].tolist()
        self.index.hold_entries(sel)
        nbytes = len(sel) * size
        self.held_bytes += nbytes
        slots = np.fromiter(map(_slot_of, sel), dtype=np.int64, count=len(sel))
        src = SlotViews(self.index.pool.buffer, slots, size)
        self.published += len(sel)

        def release(_res: list[SpillResult]) -> None:
            self.held_bytes -= nbytes
            self.index.release(sel)
        picked = keys if len(pick) == n else np.frombuffer(keys, dtype=np.uint8).reshape(n, _KEY)[pick].tobytes()
        self.tier.publish(ref, picked, src, release, sums=EntrySums(sel))
