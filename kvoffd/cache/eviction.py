"""Eviction and CLEAR: which ready entries leave the pool to make room, and unlinking a namespace.

``Eviction`` is a part of ``Index`` (its base class), like ``ChunkReclaim``: it works on the index's
tables, LRU lists or policies, miss history and counters, on the loop thread, and never blocks.
Held entries (``refs`` > 0) are never evicted: they are skipped and go back to their LRU list (or are
handed back to the policy) when their last ref drops (``Index.release``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Collection

from kvoffd.cache.entries import Entry
from kvoffd.cache.policy import EvictionPolicy

log = logging.getLogger(__name__)

SHARD_EVICT_AHEAD = 4  # a sharded pool's STORE evicts at most this many victims per slot it needs


class Eviction:
    def _untrack(self, e: Entry) -> None:
        """``e`` leaves for a reason of the index's own (CLEAR, corrupt, its chunk drained)."""
        pol = self._policies.get(e.table.slot_bytes)
        if pol is not None:
            pol.on_remove((e.table, e.key))
        else:
            del self._lru[e.table.slot_bytes][e]
        e.in_lru = False

    def evict(self, slot_bytes: int, n: int) -> int:
        """Free up to ``n`` slots of this size, least recently used first (or the policy's victims),
        skipping held blocks."""
        pol = self._policies.get(slot_bytes)
        if pol is not None:
            return self._evict_victims(pol, slot_bytes, n)
        lru = self._lru.get(slot_bytes)
        if not lru:
            return 0
        freed: list[int] = []
        now = time.time()
        while lru and len(freed) < n:
            e, _ = lru.popitem(last=False)
            e.in_lru = False
            if e.refs:
                continue  # back in the list when its last ref drops
            t = e.table
            del t.entries[e.key]
            del t.visible[e.key]
            e.run.invalidate()
            e.dead = True
            freed.append(e.slot)
            self._remember(self.evicted, (t.namespace, e.key), now)
        self.resident -= len(freed)
        self._free(slot_bytes, freed, evicted=True)
        self.evictions += len(freed)
        return len(freed)

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

    def _evict_victims(self, pol: EvictionPolicy, slot_bytes: int, n: int) -> int:
        """``evict`` with a policy: a held victim stays (untracked) and is handed back by ``release``."""
        freed: list[int] = []
        now = time.time()
        while len(freed) < n:
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
            del t.entries[k]
            del t.visible[k]
            e.run.invalidate()
            e.dead = True
            freed.append(e.slot)
            self._remember(self.evicted, (t.namespace, k), now)
        self.resident -= len(freed)
        self._free(slot_bytes, freed, evicted=True)
        self.evictions += len(freed)
        return len(freed)

    def clear(self, namespace: str = "", in_use: Collection[str] | None = None) -> int:
        """Unlink every entry of one namespace (or all) and forget the cleared namespaces no engine
        uses (``in_use``: those some engine is registered in; None: forget none), so that their world size and layouts
        bind nobody. Returns the blocks that were resident. One pass over the miss history whatever
        the number of namespaces (once per namespace stalled the loop for seconds)."""
        names = [namespace] if namespace else list(self.namespaces)
        removed = 0
        for name in names:
            ns = self.namespaces.get(name)
            if ns is None:
                continue
            for t in ns.tables.values():
                free: list[int] = []
                held: list[Entry] = []
                for e in t.entries.values():
                    if e.ready:
                        removed += 1
                        e.run.invalidate()
                    if e.in_lru:
                        self._untrack(e)
                    e.dead = True
                    if e.refs == 0:
                        free.append(e.slot)
                    elif e.ready:
                        held.append(e)
                t.entries.clear()
                t.visible.clear()
                self._free(t.slot_bytes, free)
                for o in self.observers if held else ():
                    o.unlinked(held)
            for o in self.observers:
                o.cleared(name)
            if in_use is not None and name not in in_use:
                self.forget_if_idle(name)
        if namespace:
            self.evicted = OrderedDict((k, v) for k, v in self.evicted.items() if k[0] != namespace)
            self.failed = OrderedDict((k, v) for k, v in self.failed.items() if k[0] != namespace)
        else:
            self.evicted.clear()
            self.failed.clear()
        self.resident -= removed
        return removed
