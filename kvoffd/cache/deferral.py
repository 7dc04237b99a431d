"""Deferred free: evicted slots kept out of the pool until a thread has read them.

Why: a spill to the disk tier is written straight from the pool slot by the tier's I/O threads
(``pwritev`` from the pool's memory), so the loop never copies a block. The slot must then stay out
of the pool until that write has read it: the caller that was handed the victims
(``Index.free_victims(victims, keep)``) keeps their slots here and gives them back with
``DeferredSlots.release`` (``Index.deferral``). A deferred slot is never handed out (the pool still
counts it as live, so a draining chunk waits for it as for a held entry); its entry is already dead
(invisible, its slot record invalidated by ``freeing`` as for any free).

Since a deferred slot is not free, a store must not wait for one; so (kvoffd/cache/tiers/manager.py):

* **a store's own victims are never deferred**: their slots are the store's (``Victims.held`` off);
  the disk tier copies those victims out instead, within its budget, or drops their spills: a store
  never waits for the disk;
* **keep ahead**: after a store, when the pool has fewer spare slots of its size than the store took,
  the tier evicts the difference now (``Index.take_victims``), deferred (their spills start at once,
  no copy), so the next store finds the slots their writes gave back and evicts nothing itself. The
  reserve is one store's worth, at most 1/32 of the size's slots and within the tier's spill budget:
  while the disk lags, a store that needs more than the other 31/32 can give loses the rest
  (``pool_full``), never waits.

Chunk reclaim's evictions (a drain) are deferred too: the chunk changes hands once its last
deferred slot comes back, as a drain waits for held entries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry
    from kvoffd.pool.allocator import Pool

log = logging.getLogger(__name__)

AHEAD_SHARE = 32  # the reserve kept ahead is at most 1/32 of a slot size's slots (a small pool keeps its blocks)


class DeferredSlots:
    """Evicted pool slots kept out of the pool while a thread still reads them."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.deferred: dict[int, int] = {}  # slot -> slot_bytes: evicted, kept out of the pool for a reader
        self.deferred_bytes = 0

    def keep(self, slot_bytes: int, slots: list[int], kept: Sequence[Entry]) -> list[int]:
        """Keep the slots of ``kept`` out of the pool (a thread still reads them); the rest of ``slots``."""
        held = {e.slot for e in kept}
        for s in held:
            self.deferred[s] = slot_bytes
        self.deferred_bytes += len(held) * slot_bytes
        return [s for s in slots if s not in held]

    def release(self, slot_bytes: int, slots: Sequence[int]) -> None:
        """The reader is done with slots kept here: back to the pool now. A slot not deferred (a bug in
        the caller) is refused with an error log: freeing it twice would hand one slot to two blocks."""
        back = []
        for s in slots:
            if self.deferred.get(s) != slot_bytes:
                log.error("release_deferred: slot %d of %d bytes is not deferred; ignored", s, slot_bytes)
                continue
            del self.deferred[s]
            back.append(s)
        self.deferred_bytes -= len(back) * slot_bytes
        self.pool.free(slot_bytes, back)
