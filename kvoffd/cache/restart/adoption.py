"""Adoption: the blocks a warm restart found committed in the pool file become index entries again.

``Adoption`` is a part of ``Index`` (its base class): called at start, a slice per loop turn
(kvoffd/cache/restart/plan.py, kvoffd/cache/restart/filekeeper.py), on the loop thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffd.cache.entries import Entry, Table
from kvoffd.cache.runs import Run


class Adoption:
    def adopt(self, tables: Sequence[Table], keys: Sequence[bytes], slots: Sequence[int], stamps: Sequence[float],
              checksums: Sequence[int], cold_end: bool = False) -> list[Entry]:
        """Blocks a warm restart found committed (kvoffd/cache/restart/filekeeper.py), in last-use order, oldest
        first: visible at once, least recently used first in their LRU lists (or handed to the
        policy as admitted); ``cold_end``: all of them before (colder than) the blocks already there,
        as a slice of older blocks than the slices adopted before it. Their slots are already held in
        the pool (``Pool.adopt_slots``); the observers are not told (the blocks are already what
        they mirror). One run per table and stamp (a commit's blocks share one), so a prompt's
        lookups take the run shortcut again."""
        out: list[Entry] = []
        runs: dict[Table, tuple[float, list[Entry]]] = {}
        for t, k, s, when, crc in zip(tables, keys, slots, stamps, checksums, strict=True):
            e = Entry(k, t, s)
            e.ready, e.stored_at, e.checksum = True, when, crc
            t.entries[k] = t.visible[k] = self._slot_entry[s] = e
            pol = self._policies.get(t.slot_bytes)
            if pol is not None:
                pol.on_insert((t, k), None)
            else:
                self._lru[t.slot_bytes][e] = None
            e.in_lru = True
            out.append(e)
            cur = runs.get(t)
            if cur is None or cur[0] != when:
                self._close_run(cur)
                cur = runs[t] = (when, [])
            cur[1].append(e)
        for cur in runs.values():
            self._close_run(cur)
        if cold_end:
            for e in reversed(out):
                lru = self._lru[e.table.slot_bytes]
                if e in lru:
                    lru.move_to_end(e, last=False)
        self.resident += len(out)
        return out

    def holds_table(self, t: Table) -> bool:
        """Whether ``t`` is still the table its namespace and rank read (not CLEARed away or forgotten)."""
        ns = self.namespaces.get(t.namespace)
        return ns is not None and ns.tables.get(t.rank) is t

    @staticmethod
    def _close_run(cur: tuple[float, list[Entry]] | None) -> None:
        if cur:
            run = Run(b"".join([e.key for e in cur[1]]), cur[1])
            for i, e in enumerate(cur[1]):
                e.run, e.run_at = run, i
