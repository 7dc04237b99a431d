"""Deferred free: evicted slots an observer keeps out of the pool until a thread has read them.

Why: a spill to the disk tier is written straight from the pool slot by the tier's I/O threads
(``pwritev`` from the pool's memory), so the loop never copies a block. The slot must then stay out
of the pool until that write has read it; ``IndexObserver.evicted`` returns the entries whose slots
it defers and the observer gives them back with ``release_deferred``. A deferred slot is never
handed out (the pool still counts it as live, so a draining chunk waits for it as for a held entry);
its entry is already dead (invisible, its slot record invalidated by ``freeing`` as for any free).

Since a deferred slot is not free, a store must not wait for one; so:

* **a store's own evictions are never deferred** (``defer_ok`` off while it evicts: the disk tier
  copies those victims out instead, within its budget, or drops their spills): it needs the slots
  now, and a store never waits for the disk;
* **keep ahead**: after a store, when the pool has fewer spare slots of its size than the store took,
  the index evicts the difference now, deferred (their spills start at once, no copy), so the next
  store finds the slots their writes gave back and evicts nothing itself. The reserve is one
  store's worth, at most 1/32 of the size's slots and within ``defer_budget``: while the disk lags,
  a store that needs more than the other 31/32 can give loses the rest (``pool_full``), never waits.

Chunk reclaim's evictions (a drain) are deferred too: the chunk changes hands once its last
deferred slot comes back, as a drain waits for held entries.

``DeferredFree`` is a part of ``Index`` (its base class) and works on its pool and counters.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry

log = logging.getLogger(__name__)

AHEAD_SHARE = 32  # the reserve kept ahead is at most 1/32 of a slot size's slots (a small pool keeps its blocks)


class DeferredFree:
    """It expects the index's ``pool``, ``deferred``, ``deferred_bytes``, ``defer_budget``,
    ``defer_ok`` and ``evict``."""

    def _defer(self, slot_bytes: int, slots: list[int], kept: list[Entry]) -> list[int]:
        """Keep the slots of ``kept`` out of the pool (an observer still reads them); the rest of ``slots``."""
        held = {e.slot for e in kept}
        for s in held:
            self.deferred[s] = slot_bytes
        self.deferred_bytes += len(held) * slot_bytes
        return [s for s in slots if s not in held]

    def release_deferred(self, slot_bytes: int, slots: Sequence[int]) -> None:
        """An observer is done with slots it deferred: back to the pool now. A slot not deferred (a
        bug in the caller) is refused with an error log: freeing it twice would hand one slot to two
        blocks."""
        back = []
        for s in slots:
            if self.deferred.get(s) != slot_bytes:
                log.error("release_deferred: slot %d of %d bytes is not deferred; ignored", s, slot_bytes)
                continue
            del self.deferred[s]
            back.append(s)
        self.deferred_bytes -= len(back) * slot_bytes
        self.pool.free(slot_bytes, back)

    def _evict_undeferred(self, slot_bytes: int, n: int, shard: int = -1) -> list[int]:
        """Evict ``n`` more for slots needed now: no observer may defer these."""
        self.defer_ok = False
        try:
            self.evict_for(slot_bytes, n, shard)
        finally:
            self.defer_ok = True
        return self.pool.alloc(slot_bytes, n, shard)

    def _keep_ahead(self, slot_bytes: int, n: int) -> None:
        """Evict now, within the budget, what the next store of ``n`` slots would need (see above),
        at most 1/``AHEAD_SHARE`` of the slots this size holds (a small pool keeps most of its blocks)."""
        room = (self.defer_budget - self.deferred_bytes) // slot_bytes
        want = min(n, self.pool.slots_share(slot_bytes) // AHEAD_SHARE, room)
        if want <= 0:
            return
        missing = want - self.pool.spare_slots(slot_bytes, want)
        if missing > 0:
            self.evict(slot_bytes, missing)
