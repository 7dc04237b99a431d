"""Eviction: which ready entries leave the pool to make room.

``Eviction`` is held by the index (``Index.eviction``): it asks the slot size's policy for victims,
skips held ones and hands the rest to ``Index.drop_victims`` (which frees them, or returns them to
the caller: ``out``), on the loop thread, and never blocks.
Held entries (``refs`` > 0) are never evicted: the policy hands them over and gets them back when
their last ref drops (``Index.release``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry, Victims
    from kvoffd.cache.index import Index

log = logging.getLogger(__name__)

SHARD_EVICT_AHEAD = 4  # a sharded pool's STORE evicts at most this many victims per slot it needs


class Eviction:
    """The index's victims, in its policies' order."""

    def __init__(self, index: Index):
        self.index = index
        self.pool = index.pool

    def evict(self, slot_bytes: int, n: int, out: list[Victims] | None = None, held: bool = True) -> int:
        """Free up to ``n`` slots of this size, the policy's victims first, skipping held blocks (a held
        victim stays untracked and is handed back by ``Index.release``); ``out``, ``held``: as
        ``Index.drop_victims``."""
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
        return self.index.drop_victims(slot_bytes, victims, out=out, held=held) if victims else 0

    def evict_for(self, slot_bytes: int, n: int, shard: int, out: list[Victims] | None = None) -> int:
        """``evict`` for a STORE placed on ``shard`` of a NUMA-sharded pool: victims in the policy's
        order as ever, and more of them while the asked-for shard still lacks ``n`` free slots, at most
        ``SHARD_EVICT_AHEAD`` x ``n`` in all. The other shards' slots freed meanwhile are not wasted:
        their own engines' next stores take them without evicting, so the eviction rate stays the
        policy's while each engine's blocks stay on its node (without this, a full pool placed about
        half of every store on the other node). ``shard`` -1 (one shard): exactly ``evict``. The slots
        are for the STORE: victims handed over (``out``) are back in the pool, not held."""
        done = self.evict(slot_bytes, n, out, held=False)
        if shard < 0:
            return done
        budget = SHARD_EVICT_AHEAD * n - done
        while budget > 0:
            missing = n - self.pool.spare_slots(slot_bytes, n, shard)
            if missing <= 0:
                break
            got = self.evict(slot_bytes, min(missing, budget), out, held=False)
            if not got:
                break
            done += got
            budget -= got
        return done
