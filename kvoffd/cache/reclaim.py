"""Chunk reclaim: moving a chunk of the pool from one slot size to another that holds less than its
fair share, by draining it a bounded number of entries per store (docs/architecture.md, "The pool").

``Reclaimer`` is held by the index (``Index.reclaimer``): it reads the index's slot map and hands the
entries it drains to ``Index.drop_victims``, on the loop thread, and never blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry, Victims
    from kvoffd.cache.index import Index

RECLAIM_BUDGET = 4096  # entries one store may evict from a chunk taken for another slot size
_PICK_CHUNKS = 4  # candidate chunks compared (the least recently allocated from)
_PICK_CHECK = 2  # candidates scanned for held entries (a scan costs one dict probe per slot of the chunk)
_DRAIN_SCAN = 8 * RECLAIM_BUDGET  # slots of the draining chunk looked at per store
DRAIN_PATIENCE_S = 30.0  # a drain stuck on held entries this long is given up (the connector leases 30 s)


@dataclass
class _Drain:
    """A chunk being emptied for another slot size: ``cursor`` is the next of its carved slots to
    look at; ``progress_at`` when it last evicted something."""

    chunk: int
    slot_bytes: int  # the size whose entries live there now
    cursor: int = 0
    progress_at: float = 0.0


class Reclaimer:
    """Drains one chunk at a time (``_drain``) towards the slot size that asked for memory."""

    def __init__(self, index: Index):
        self.index = index
        self.pool = index.pool
        self._drain: _Drain | None = None

    def reclaim(self, slot_bytes: int, out: list[Victims] | None = None) -> None:
        """Move memory towards ``slot_bytes`` if it holds less than its fair share of the pool.

        One chunk at a time is drained: the pool hands nothing more out of it, and each call evicts
        at most ``RECLAIM_BUDGET`` of its unheld entries (a 64 MiB chunk of 4 KiB blocks holds
        16k), so no store stalls the loop whatever the block size. Held and pending entries are
        never touched; a chunk that holds some is drained around them and freed when their refs
        drop, or given up after ``DRAIN_PATIENCE_S``. When the chunk's last slot is given back the
        pool gives the chunk to the slot size that asked. ``out``: the entries evicted are handed
        over there, their slots held (``Index.drop_victims``): the chunk changes hands once the caller
        has freed them.
        """
        d = self._drain
        if d is not None and not self.pool.draining(d.chunk):
            d = self._drain = None  # emptied meanwhile (evictions, CLEAR, finished stores)
        if d is None:
            victim = self.pool.reclaim_victim(slot_bytes)
            chunk = self._pick_chunk(victim) if victim else None
            if chunk is None:
                return
            self.pool.begin_drain(chunk, slot_bytes)
            d = self._drain = _Drain(chunk, victim, progress_at=time.monotonic())
        self._drain_step(d, out)

    def _pick_chunk(self, slot_bytes: int) -> int | None:
        """The chunk of this slot size to empty: of the few least recently allocated from (the oldest
        blocks), the emptiest (fewest evictions) that holds no held entry; if each holds one, the
        emptiest anyway, drained around them. Bounded work: two chunk scans at most."""
        pool = self.pool
        order = sorted(pool.oldest_chunks(slot_bytes, _PICK_CHUNKS), key=pool.chunk_live)  # stable: age
        for c in order[:_PICK_CHECK]:
            if not self._chunk_held(c):
                return c
        return order[0] if order else None

    def _chunk_held(self, chunk: int) -> bool:
        get = self.index.slot_entry.get
        return any(e.refs for e in map(get, self.pool.carved_slots(chunk)) if e is not None)

    def _drain_step(self, d: _Drain, out: list[Victims] | None) -> None:
        """Evict up to ``RECLAIM_BUDGET`` unheld entries of the draining chunk."""
        slots = self.pool.carved_slots(d.chunk)
        get = self.index.slot_entry.get
        victims: list[Entry] = []
        i = d.cursor
        end = min(len(slots), i + _DRAIN_SCAN)
        while i < end and len(victims) < RECLAIM_BUDGET:
            e = get(slots[i])
            i += 1
            if e is None or e.refs:
                continue
            victims.append(e)
        d.cursor = i
        if victims:
            d.progress_at = time.monotonic()
            self.index.drop_victims(d.slot_bytes, victims, reclaim=True, out=out)  # the chunk changes hands here if that was its last slot
        if not self.pool.draining(d.chunk):
            self._drain = None
        elif i >= len(slots):  # what is left was held when passed
            if time.monotonic() - d.progress_at > DRAIN_PATIENCE_S:
                self.pool.end_drain(d.chunk)  # held for good, it seems: let its slab use it again
                self._drain = None
            else:
                d.cursor = 0  # look again on a later store
