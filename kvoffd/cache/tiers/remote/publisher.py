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
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvoffd.cache.entries import Entry, Hits, Table
from kvoffd.cache.index import Index
from kvoffd.cache.observer import IndexObserver
from kvoffd.cache.tiers.base import SpillResult, TableRef
from kvoffd.cache.tiers.remote.tier import RemoteTier

HELD_SHARE = 8  # 1/8 of the pool at most held by publishing


class Publisher(IndexObserver):
    def __init__(self, index: Index, tier: RemoteTier):
        self.index = index
        self.tier = tier
        self.max_held_bytes = index.pool.capacity_bytes // HELD_SHARE
        self.held_bytes = 0
        self.skipped_held = 0  # admitted blocks not published behind: the held share was full
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Entry] = []  # committed this loop turn, held at the next callback
        self.published = 0  # blocks handed to the tier's write-behind queue

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def committed(self, entries: Sequence[Entry]) -> None:
        if self._loop is None:
            return
        if not self._pending:
            self._loop.call_soon(self._take)
        self._pending.extend(entries)

    def _ref(self, t: Table) -> TableRef | None:
        ns = self.index.namespaces.get(t.namespace)
        if ns is None or t.rank not in ns.layouts:
            return None
        return TableRef(t.namespace, t.rank, ns.world_size, ns.layouts[t.rank])

    def _take(self) -> None:
        pending, self._pending = self._pending, []
        groups: dict[Table, list[Entry]] = {}
        for e in pending:
            if e.ready and not e.dead:  # not evicted or cleared since
                groups.setdefault(e.table, []).append(e)
        buf = memoryview(self.index.pool.buffer)
        for t, es in groups.items():
            ref = self._ref(t)
            if ref is None:
                continue
            keys = b"".join([e.key for e in es])
            have = self.tier.contains(ref, keys).tolist()
            es = [e for e, h in zip(es, have, strict=True) if not h]
            size = t.slot_bytes
            room = max(0, self.max_held_bytes - self.held_bytes) // size
            if len(es) > room:
                self.skipped_held += len(es) - room
                self.tier.note_held_full(len(es) - room)
                es = es[:room]
            if not es:
                continue
            self.index.hold(Hits(len(es), {0: es}, None, 1))
            self.held_bytes += len(es) * size
            src = [buf[e.slot:e.slot + size] for e in es]
            self.published += len(es)

            def release(_res: list[SpillResult], es: list[Entry] = es, nbytes: int = len(es) * size) -> None:
                self.held_bytes -= nbytes
                self.index.release(es)
            self.tier.publish(ref, b"".join([e.key for e in es]), src, release)
