"""The index's mirror in the pool file: the slot records and namespace facts kept true while serving.

* **committed** blocks get their records at once, on the loop, in the callback that made them visible
  (after their copy completed): COMMITTED, without a checksum, so a block whose STORE was acknowledged
  is adopted after any crash of the daemon. Their checksums follow behind (kvoffd/cache/restart/sealing.py:
  on the checksum threads, kvoffd/cache/checksum.py's sum) and are filled into the records of the blocks
  still alive (docs/architecture.md, "Crash consistency", says why a record without one is sound).
* **freeing** slots have their records invalidated before the pool may hand them out again.
* blocks read by a LOAD are **touched**: their last-use stamps are rewritten at each ``flush_touches``
  (batched, on the loop), so the next daemon rebuilds the LRU order.

The namespace facts also keep each namespace's KV-event identity (``note_identity``, told at every
REGISTER, whether or not this daemon publishes events), so that a daemon that adopts the blocks can
announce them to routers before any engine registers again (kvoffd/events/announce.py). The identity is
the REGISTER's own word, so it cannot be wrong for blocks stored under it; an engine that registers
with another one (a changed ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) replaces it for the next events.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

from kvoffd.cache.checksum import LEGACY_CRC32, NONE
from kvoffd.cache.identity import EventIdentity
from kvoffd.cache.index import Entry, Index, Table
from kvoffd.cache.restart.plan import AdoptionPlan
from kvoffd.cache.restart.records import (
    MAX_NAMESPACE_IDS,
    NamespaceArea,
    NamespaceFacts,
    RankFacts,
    SlotRecords,
)
from kvoffd.cache.restart.sealing import Sealer
from kvoffd.pool.file import PoolFile
from kvoffd.pool.format import NS_AREA_BYTES


class RecordMirror:
    """The pool file's slot records and namespace area, written from the index's moments (loop thread
    only, but for the ``Sealer``'s tasks)."""

    def __init__(self, pf: PoolFile, buffer: np.ndarray, index: Index, executor: Executor):
        lay = pf.layout
        words = np.frombuffer(pf.map, dtype=np.uint64, count=lay.num_records * 8, offset=lay.records_offset)
        chunks = np.frombuffer(pf.map, dtype=np.uint64, count=lay.num_chunks, offset=lay.chunks_offset)
        self.records = SlotRecords(words.reshape(-1, 8), chunks, lay)
        self.namespaces = NamespaceArea(memoryview(pf.map)[lay.ns_offset:lay.ns_offset + 2 * NS_AREA_BYTES])
        self.sealer = Sealer(buffer, executor, self._write_sums)
        self._index = index
        self._ids: weakref.WeakKeyDictionary[Table, int] = weakref.WeakKeyDictionary()
        self._events: OrderedDict[str, EventIdentity | None] = OrderedDict()  # REGISTER's layout.kv_events
        self._touched: list[Entry] = []
        self.committed_records = 0  # records written at commit (with or without their checksum)
        self.sealed = 0  # records with their checksum

    # --- adoption ---------------------------------------------------------------------------------
    def wipe(self) -> None:
        """A file whose records cannot be planned: none of them is kept (a cold start, not a crash loop)."""
        self.records.words[:, 0] = 0
        self.records.chunks[:] = 0
        self.namespaces.keep_only(set())

    def keep(self, plan: AdoptionPlan) -> None:
        """The records and namespaces of ``plan`` stay, the rest go."""
        for t, i in plan.table_ids.items():
            self._ids[t] = i
        self.namespaces.keep_only(set(plan.table_ids.values()))
        self.records.invalidate(plan.dropped_records)

    def identities(self) -> dict[str, EventIdentity]:
        """The KV-event identities the file kept, by namespace (adopted namespaces only until the first
        REGISTER: ``keep`` left those alone)."""
        return {f.name: f.events for f in self.namespaces.by_id.values() if f.events is not None}

    def note_identity(self, namespace: str, ident: EventIdentity | None) -> None:
        """REGISTER's ``layout.kv_events`` for ``namespace`` (None: absent): kept with its facts."""
        self.namespaces.set_events(namespace, ident)
        self._events[namespace] = ident  # for facts made later (at the namespace's first seal)
        self._events.move_to_end(namespace)
        while len(self._events) > MAX_NAMESPACE_IDS:
            self._events.popitem(last=False)

    # --- the index's moments ------------------------------------------------------------------------
    def committed(self, entries: Sequence[Entry]) -> None:
        """Their copies completed (this runs in the loop callback that made them visible): their records
        at once, without a checksum unless ``--verify`` summed them already; the sums follow behind."""
        by_table: dict[Table, list[Entry]] = {}
        for e in entries:
            by_table.setdefault(e.table, []).append(e)
        for t, mine in by_table.items():
            ns_id = self._ns_id(t)
            if ns_id is None:
                continue
            idx = self.records.index_of(np.fromiter((e.slot for e in mine), dtype=np.int64, count=len(mine)),
                                        t.slot_bytes)
            keep = idx >= 0
            if not keep.all():  # slots past a chunk's records: not persisted
                mine = [e for e, k in zip(mine, keep.tolist(), strict=True) if k]
                idx = idx[keep]
            if not mine:
                continue
            sums = np.fromiter((e.checksum if 0 <= e.checksum < LEGACY_CRC32 else NONE for e in mine),
                               dtype=np.int64, count=len(mine))
            self.records.seal(idx, ns_id, t.rank, b"".join([e.key for e in mine]),
                              np.fromiter((e.stored_at for e in mine), dtype=np.float64, count=len(mine)), sums,
                              t.slot_bytes)
            self.committed_records += len(mine)
            known = sums >= 0
            if known.any():  # --verify: summed before the notice, sealed already
                self.sealed += int(known.sum())
                mine = [e for e, k in zip(mine, known.tolist(), strict=True) if not k]
            self.sealer.submit(mine)

    def freeing(self, slot_bytes: int, entries: Sequence[Entry]) -> None:
        self.sealer.forget(entries)
        slots = np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries))
        idx = self.records.index_of(slots, slot_bytes)
        self.records.invalidate(idx[idx >= 0])

    def touched(self, entries: Sequence[Entry]) -> None:
        """Read by a LOAD: their stamps move at the next ``flush_touches``."""
        self._touched += entries

    def flush_touches(self) -> None:
        touched, self._touched = self._touched, []
        by_size: dict[int, set[int]] = {}
        for e in touched:
            if not e.dead:
                by_size.setdefault(e.table.slot_bytes, set()).add(e.slot)
        now = time.time()
        for size, slots in by_size.items():
            idx = self.records.index_of(np.fromiter(slots, dtype=np.int64, count=len(slots)), size)
            self.records.touch(idx[idx >= 0], now)

    def _write_sums(self, part: list[Entry], sums: list[int]) -> None:
        """On the loop: the sums of ``part`` (kvoffd/cache/restart/sealing.py) into the records of the blocks
        still alive. A block freed meanwhile is skipped: its record was invalidated at its ``freeing``
        and its slot may hold another block by now (whose own record this must not touch)."""
        by_table: dict[Table, list[tuple[Entry, int]]] = {}
        for e, c in zip(part, sums, strict=True):
            if not e.dead and c >= 0:
                e.checksum = c
                by_table.setdefault(e.table, []).append((e, c))
        for t, got in by_table.items():
            idx = self.records.index_of(np.fromiter((e.slot for e, _ in got), dtype=np.int64, count=len(got)),
                                        t.slot_bytes)
            crcs = np.fromiter((c for _, c in got), dtype=np.int64, count=len(got))
            keep = idx >= 0
            self.sealed += self.records.fill(idx[keep], crcs[keep])

    def _ns_id(self, t: Table) -> int | None:
        got = self._ids.get(t)
        if got is None:
            ns = self._index.namespaces.get(t.namespace)
            if ns is None or ns.tables.get(t.rank) is not t:
                return None
            facts = NamespaceFacts(t.namespace, ns.world_size, {t.rank: RankFacts(t.slot_bytes, ns.layouts[t.rank])},
                                   ns.replicas, self._events.get(t.namespace))
            got = self.namespaces.id_for(facts)
            if got is not None:
                self._ids[t] = got
        return got
