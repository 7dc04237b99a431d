"""Eviction: which ready entries leave the pool to make room, and when a store evicts ahead.

``Eviction`` is held by the index (``Index.eviction``): it asks the slot size's policy for victims,
skips held ones and hands the rest to ``Index.drop_victims``, on the loop thread, and never blocks.
Held entries (``refs`` > 0) are never evicted: the policy hands them over and gets them back when
their last ref drops (``Index.release``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvoffd.cache.deferral import AHEAD_SHARE, DeferredSlots

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry
    from kvoffd.cache.index import Index

log = logging.getLogger(__name__)

SHARD_EVICT_AHEAD = 4  # a sharded pool's STORE evicts at most this many victims per slot it needs


class Eviction:
    """The index's victims, in its policies' order; ``deferral``: the slots spills still read."""

    def __init__(self, index: Index, deferral: DeferredSlots):
        self.index = index
        self.pool = index.pool
        self.deferral = deferral

    def evict(self, slot_bytes: int, n: int) -> int:
        """Free up to ``n`` slots of this size, the policy's victims first, skipping held blocks (a held
        victim stays untracked and is handed back by ``Index.release``)."""
        pol = self.index.policy_for(slot_bytes)
        if pol is None:
            return 0
        victims: list[Entry] = []
        while len(victims) < n:
            key = pol.victim()
            if key is None:
                break
            t, k = key
            e = t.entries.get(k)
            if e is None or not e.in_lru:  # a policy bug: never evict what it does not hold
                log.error("eviction policy %s named a block it does not hold; skipped", pol.name)
                continue
            e.in_lru = False
            if e.refs:
                continue
            victims.append(e)
        return self.index.drop_victims(slot_bytes, victims) if victims else 0

    def evict_for(self, slot_bytes: int, n: int, shard: int) -> int:
        """``evict`` for a STORE placed on ``shard`` of a NUMA-sharded pool: victims in the policy's
        order as ever, and more of them while the asked-for shard still lacks ``n`` free slots, at most
        ``SHARD_EVICT_AHEAD`` x ``n`` in all. The other shards' slots freed meanwhile are not wasted:
        their own engines' next stores take them without evicting, so the eviction rate stays the
        policy's while each engine's blocks stay on its node (without this, a full pool placed about
        half of every store on the other node). ``shard`` -1 (one shard): exactly ``evict``."""
        done = self.evict(slot_bytes, n)
        if shard < 0:
            return done
        budget = SHARD_EVICT_AHEAD * n - done
        while budget > 0:
            missing = n - self.pool.spare_slots(slot_bytes, n, shard)
            if missing <= 0:
                break
            got = self.evict(slot_bytes, min(missing, budget))
            if not got:
                break
            done += got
            budget -= got
        return done

    def for_store(self, slot_bytes: int, n: int, shard: int) -> list[int]:
        """Evict for ``n`` slots a STORE needs now and take them. Their victims are never deferred
        when a budget is set (kvoffd/cache/deferral.py: a store never waits for the disk)."""
        d = self.deferral
        if not d.budget:
            self.evict_for(slot_bytes, n, shard)
            return self.pool.alloc(slot_bytes, n, shard)
        d.ok = False
        try:
            self.evict_for(slot_bytes, n, shard)
        finally:
            d.ok = True
        return self.pool.alloc(slot_bytes, n, shard)

    def keep_ahead(self, slot_bytes: int, n: int) -> None:
        """Evict now, deferred and within the budget, what the next store of ``n`` slots would need
        (kvoffd/cache/deferral.py), at most 1/``AHEAD_SHARE`` of the slots this size holds (a small
        pool keeps most of its blocks). Nothing without a budget."""
        if not self.deferral.budget:
            return
        want = min(n, self.pool.slots_share(slot_bytes) // AHEAD_SHARE, self.deferral.room(slot_bytes))
        if want <= 0:
            return
        missing = want - self.pool.spare_slots(slot_bytes, want)
        if missing > 0:
            self.evict(slot_bytes, missing)
