"""``Tiers``: what sits between the index and the tiers below the pool: the disk tier (``--disk-path``),
the cluster tier (``--remote``), or both, local first (kvoffd/cache/tiers/stack.py).

The rules with both (docs/architecture.md, *Tiers below the pool*):

* a LOOKUP counts the pool's hits, then the disk's (its probe alone, as without the cluster: a run the
  disk covers never reaches the cluster tier), then what the cluster tier knows (``Known``: published
  by this node, or found by a probe). Keys no local tier holds are asked of the cluster by the
  keyspace (``Answer.asked``, bounded by ``ASK_WAIT_S``); a leading run may mix pool, disk and
  cluster blocks;
* a key on the disk and in the cluster is read from the disk, once; every promotion, from either,
  lands in a pending pool slot before the LOAD that waits for it, under each tier's deadline and the
  late-copy rule (``Tier.read``);
* the pool's evictions spill to the disk, and to the cluster only what this node does not know it
  holds (the cluster is written at admission, kvoffd/cache/tiers/remote/publisher.py; the spill is
  the second chance for what the publisher could not take);
* the disk's own evictions touch nothing else (the cluster may still hold the block: a later LOOKUP
  finds it there); a CLEAR clears each tier.

With KV events on, ``publish`` connects each tier to the stream: what it writes and drops is
published under its medium, and what it found at start is announced (kvoffd/events/announce.py).

The keyspace (kvoffd/cache/keyspace.py) calls it at each moment that concerns the tiers: the victims
of every STORE (``after_store``: spilled, kvoffd/cache/tiers/spill.py, or freed, and the next store's
room evicted ahead), a CLEAR (``clear``: what each tier forgot, for the reply; a CLEAR of all is one
pass over the tiers, which also takes the namespaces the index does not know: blocks left on disk
from before a restart), a LOOKUP past the pool's leading hits (``find_below``: the blocks found below
are hits too; ``fits`` says whether the LOOKUP may be answered before ``promote`` takes their pool
slots and starts their reads) and a LOAD (``promotions``, which it then waits for, so the LOAD itself
is an ordinary pool -> engine copy).

A promotion takes pool slots the way a STORE does (evicting as needed, its victims spilled in turn,
bypassing admission: the block was just asked for) as pending entries, visible only once the tier has
verified the bytes; a block that fails is aborted (its LOAD reports it failed, the engine recomputes).
A slot is never freed while a read into it is in flight: the entry keeps its store ref until the tier
resolves the read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kvoffd.cache.checksum import block_sum
from kvoffd.cache.deferral import AHEAD_SHARE
from kvoffd.cache.index import Entry, Hits, Index, StorePlan, Table
from kvoffd.cache.tiers.base import Held, SpillResult, TableRef, Tier, TierEvents, TierStats
from kvoffd.cache.tiers.spill import SPILL_BUFFER_BYTES, Spill, Spills, views
from kvoffd.cache.tiers.stack import NOWHERE, Stack
from kvoffd.runtime import UnsafePath
from kvoffd_client.protocol import KEY_SIZE, split_keys

if TYPE_CHECKING:
    from kvoffd.cache.restart.keeper import Keeper

log = logging.getLogger(__name__)

_K = KEY_SIZE
PROMOTE_WAIT_S = 10.0  # a LOAD waits at most this long for a promotion (then those blocks fail)


@dataclass
class _Walk:
    """One rank's leading keys past the pool's hits, exactly (``Tiers._walk``): its entry (pool or
    promotion under way) or None for a tier block, and the positions of the tier blocks to promote."""

    table: Table
    keys: list[bytes]  # the leading keys walked
    lead: list[Entry | None]
    wanted: list[int]
    source: list[int]  # per wanted position: the tier (``Stack``'s position) it is read from


@dataclass
class Below:
    """What a LOOKUP found below the pool's leading hits (``Tiers.find_below``), nothing taken yet:
    ``n`` leading keys in all if every promotion gets a pool slot (the answer), the pool's hits, and
    each rank's table."""

    namespace: str
    keys: bytes
    hits: Hits
    n: int
    tables: list[Table]


class Tiers:
    """``keeper``: the pool file's keeper (kvoffd/cache/restart/keeper.py), for the spills of adopted
    blocks (``Spills``); None: a pool without one (nothing adopted). ``spill_buffer_bytes``: what spills
    may hold of the pool's slots and of staging copies."""

    def __init__(self, index: Index, tiers: Sequence[Tier], verify: bool = False,
                 spill_buffer_bytes: int = SPILL_BUFFER_BYTES, keeper: Keeper | None = None):
        self.index = index
        self.tiers = list(tiers)
        self.verify = verify
        self._refs: dict[Table, TableRef] = {}
        self._promoting: dict[Entry, asyncio.Future] = {}
        self.stack = Stack(self.tiers)  # the order a LOOKUP asks them in: local first
        self.spills = Spills(index, self.tiers, self._ref, spill_buffer_bytes, keeper) if self.tiers else None
        self.staged_hits = 0
        self.no_room = 0  # blocks a LOOKUP answered before their promotion that no pool slot was found for
        self.hits: dict[str, int] = {t.name: 0 for t in self.tiers}
        self.disabled = ""  # why a configured tier is not running (kvoffctl status shows it)

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for t in self.tiers:
            t.start(loop)

    def publish(self, events: TierEvents) -> None:
        """KV events (--kv-events-address): each tier tells ``events`` what it now holds and no longer
        holds, rank 0's blocks only (as for the pool), under its own medium; and the blocks it found at
        start are announced. On the loop, after ``start``."""
        for tier in self.tiers:
            def changed(ref: TableRef, stored: bytes, removed: bytes, medium: str = tier.medium) -> None:
                if ref.rank == 0:
                    events.tier_changed(medium, ref.namespace, split_keys(stored), split_keys(removed))

            tier.changed = changed
            tier.mark_reopened()
            events.reopened(tier)

    async def aclose(self, timeout: float = 30.0) -> None:
        """Let spills in flight land in the index (a clean stop keeps them), then close the tiers."""
        spilling = self.spills.in_flight if self.spills is not None else ()
        pending = [f for f in spilling if not f.done()] + [f for f in self._promoting.values() if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for t in self.tiers:
            t.close()

    def _ref(self, t: Table) -> TableRef:
        ref = self._refs.get(t)
        if ref is None:
            ns = self.index.namespaces[t.namespace]
            ref = self._refs[t] = TableRef(t.namespace, t.rank, ns.world_size, ns.layouts[t.rank])
        return ref

    # --- STORE and CLEAR --------------------------------------------------------------------------
    def after_store(self, plan: StorePlan, writes: list[Spill] | None = None) -> None:
        """A STORE (or a promotion) got its slots: its victims (``plan.victims``, handed over) are
        spilled or freed before its copy starts, and the next store's room is evicted ahead."""
        spills = self.spills
        assert spills is not None
        if plan.victims:
            spills.settle(plan.victims, writes)
        if plan.copy_idx or plan.dropped:
            spills.keep_ahead(plan.table.slot_bytes, len(plan.copy_idx) + len(plan.dropped), writes)

    def clear(self, namespace: str) -> dict[str, int]:
        """Forget ``namespace`` below the pool too ("" = every namespace, in one pass over each tier,
        those only a tier knows included: blocks left on disk from before a restart). Returns the
        blocks each tier forgot, by tier name. Called after the index's CLEAR."""
        removed = {t.name: t.clear(namespace) for t in self.tiers}
        self._refs = {t: r for t, r in self._refs.items() if namespace and r.namespace != namespace}
        if self.spills is not None:
            self.spills.forget(namespace)
        return removed

    def namespace_blocks(self) -> dict[str, dict[str, Held]]:
        """Namespace -> tier name -> what that tier holds of it (tiers that hold none of it left out)."""
        out: dict[str, dict[str, Held]] = {}
        for t in self.tiers:
            for ns, held in t.namespace_blocks().items():
                out.setdefault(ns, {})[t.name] = held
        return out

    # --- lookups and loads ------------------------------------------------------------------------
    def find_below(self, namespace: str, keys: bytes, hits: Hits) -> Below | None:
        """What follows the pool's ``hits.n`` leading keys: keys every rank holds in the pool, in a
        promotion under way, or in a tier. Nothing is taken or started yet: the LOOKUP can be answered
        with ``n`` before ``promote`` does the per-block work (pool slots, evictions, reads: 4-9 us a
        block on the loop). None when nothing past the pool's hits is found.

        The count is the tier's ``probe`` (the disk tier's fingerprints, "maybe held", one call of its
        compiled kernel) and, where the table has entries not ready yet, the pool's entries: for 1,024
        keys 28 us hot and ~100 us cold on the 2-core VM, where the exact walk before the answer cost
        1-2 ms (bench/index_scale.py). ``promote`` walks the keys exactly before it takes anything: a
        key the probe took for held (about 16 in 2^31 absent keys) ends the promotion there and is
        counted with ``no_room``: a shorter hit than answered, so a LOAD that fails that block, a
        miss, never a wrong byte."""
        ns = self.index.namespaces.get(namespace)
        total = len(keys) // _K
        n = hits.n
        if not self.tiers or ns is None or n >= total or len(ns.tables) < ns.world_size:
            return None
        rest = keys[n * _K:]
        limit = total - n
        tables = []
        for r in range(ns.world_size):
            t = ns.tables[r]
            limit = self._count(t, rest, limit)
            tables.append(t)
            if not limit:
                return None
        return Below(namespace, keys, hits, n + limit, tables)

    def fits(self, below: Below) -> bool:
        """Whether ``below``'s promotions surely all get pool slots: then none can fall short, and the
        LOOKUP may be answered before ``promote`` runs. Otherwise (a prefix longer than the pool can
        give, held blocks filling it) the promotions go first and the answer counts what got a slot.

        Surely: the slots free now, plus the ready blocks the policy may evict less every ref taken
        in the pool (``Index.evictable``: a held block is never evicted) and the blocks this answer
        itself holds, cover every key past the pool's hits. A full pool passes; one whose blocks are
        mostly leased does not."""
        need: dict[int, int] = {}
        ahead: dict[int, int] = {}
        per_rank = below.n - below.hits.n  # at most this many promotions per rank (some may be in the pool)
        index = self.index
        for i, t in enumerate(below.tables):
            size = t.slot_bytes
            need[size] = need.get(size, 0) + per_rank
            if i:  # each rank's store evicts ahead for the next (deferred slots: not free at once)
                ahead[size] = ahead.get(size, 0) + min(per_rank, index.pool.slots_share(size) // AHEAD_SHARE)
        held = (below.hits.n + per_rank) * len(below.tables)
        return all(index.pool.spare_slots(size, k) + index.evictable(size) - held - ahead.get(size, 0) >= k
                   for size, k in need.items())

    def promote(self, below: Below, answered: bool = False) -> Hits:
        """Pool slots and reads for ``below``'s tier blocks. Returns the hits: their count (fewer than
        ``below.n`` when the pool had no room for all, or the exact walk found fewer), the entries by
        rank (pool ones and pending promotions, for a lease to hold) and the first miss's reason. Blocks
        an answer already promised that were not promoted are counted in ``no_room`` (``fits`` keeps
        that from happening for want of room: the LOAD would fail them)."""
        namespace, keys, hits = below.namespace, below.keys, below.hits
        ns = self.index.namespaces[namespace]
        total = len(keys) // _K
        n, by_rank = hits.n, hits.by_rank
        rest = keys[n * _K:]
        limit = below.n - n
        walks = []
        for t in below.tables:
            w = self._walk(t, rest, limit)
            limit = len(w.lead)
            walks.append(w)
        if n and not by_rank:  # no lease asked: the pool's hits, to hold while the promotions evict
            by_rank = {r: [ns.tables[r].visible[keys[i * _K:(i + 1) * _K]] for i in range(n)]
                       for r in range(ns.world_size)}
        keep = {id(e) for e in self._lead_entries(by_rank)}
        held = [e for w in walks for e in w.lead if e is not None and id(e) not in keep]
        held += self._lead_entries(by_rank)
        # what this answer promises must survive the evictions the promotions cause
        self.index.hold_entries(held)
        # The promotions evict pool blocks, whose spills would take tier slots: one of them could be a
        # block about to be read. So the spills wait until every read is submitted (a read in flight
        # keeps its slot from reuse).
        writes: list[Spill] = []
        try:
            for w in walks:
                limit = min(limit, self._promote(w, limit, writes))
        finally:
            self.index.release(held)
            for sp in writes:
                self.spills.write(sp)
        if answered:
            self.no_room += below.n - n - limit
        if not limit:
            return hits
        out = {r: list(by_rank.get(r, ()))[:n] + walks[r].lead[:limit] for r in range(ns.world_size)}
        m = n + limit
        reason = self.index.misses.reason(namespace, keys[m * _K:(m + 1) * _K]) if m < total else None
        return Hits(m, out, reason, ns.world_size)

    @staticmethod
    def _lead_entries(by_rank: dict[int, list[Entry]]) -> list[Entry]:
        return [e for es in by_rank.values() for e in es]

    def _count(self, t: Table, rest: bytes, limit: int) -> int:
        """How many leading keys of ``rest`` (at most ``limit``) this rank can serve: each a pool entry
        that is ready or being promoted, or else a block some tier may hold or a spill still in flight
        (``find_below`` says why "may"). The first key is asked exactly, alone: the usual miss (a new
        prompt) costs one lookup of one key. The tiers are asked local first (``Stack.run``): a run the
        disk covers never reaches the cluster tier; past the end of one tier's run the next key is asked
        of every tier again, so a run may mix tiers."""
        get = t.entries.get
        staged = self.spills.staged
        promoting = self._promoting
        stack, ref = self.stack, self._ref(t)
        first = rest[:_K]
        e = get(first)
        if e is not None:
            if not (e.ready or e in promoting):
                return 0  # being stored by a STORE: not readable yet
        elif (t, first) not in staged and not stack.holds(ref, first):
            return 0
        if limit == 1:
            return 1
        lead = 1 + stack.run(ref, rest[_K:limit * _K])
        if lead == limit and len(t.entries) == len(t.visible):
            return limit  # the usual tier hit: all below, and every pool entry ready (a hit either way)
        # Some key is not below, or a key may be in the pool but not ready: the pool's entries decide,
        # a spill in flight serves, and past a key the tiers lack they are asked again from the next one.
        keys = split_keys(rest[:limit * _K])
        ents = list(map(get, keys))
        below = lead  # keys [i, below) may be held by a tier
        i = 1
        while i < limit:
            e = ents[i]
            if e is not None:
                if not (e.ready or e in promoting):
                    break  # being stored by a STORE: not readable yet
            elif i >= below and (t, keys[i]) not in staged:
                below = i + stack.run(ref, rest[i * _K:limit * _K])
                if below == i:
                    break
            i += 1
        return i

    def _walk(self, t: Table, rest: bytes, limit: int) -> _Walk:
        """The leading keys of ``rest`` (at most ``limit``) this rank serves, exactly: its entry (pool or
        promotion under way) or None for a tier block, the positions of the tier blocks to promote and,
        for each, the tier it is read from (the first that holds it, ``Stack.sources``; ``NOWHERE`` for
        a spill still in flight that no tier holds yet: copied back from its slot)."""
        get = t.entries.get
        staged = self.spills.staged
        keys = split_keys(rest[:limit * _K])
        src = self.stack.sources(self._ref(t), rest[:limit * _K])
        ents = list(map(get, keys))
        if ents.count(None) == limit and not (src == NOWHERE).any():  # the usual tier hit: none in the pool
            return _Walk(t, keys, [None] * limit, list(range(limit)), src.tolist())
        lead: list[Entry | None] = []
        wanted: list[int] = []
        on = src.tolist()
        for i, (k, e) in enumerate(zip(keys, ents, strict=True)):
            if e is not None:
                if e.ready or e in self._promoting:
                    lead.append(e)
                    continue
                break  # being stored by a STORE: not readable yet
            if on[i] == NOWHERE and (t, k) not in staged:
                break
            lead.append(None)
            wanted.append(i)
        return _Walk(t, keys, lead, wanted, [on[i] for i in wanted])

    def _promote(self, w: _Walk, limit: int, writes: list[Spill]) -> int:
        """Pool slots and reads for this rank's tier blocks among the first ``limit``; returns how many
        leading keys stay hits (fewer when the pool had no room for all). One plan takes the slots of
        them all; then blocks still in a spill's slot are copied back, and the rest are read, one batch
        per tier (disk and cluster reads run at once), each batch its own future: a LOAD waits for the
        batches its blocks are in."""
        t, lead = w.table, w.lead
        pos = [j for j, i in enumerate(w.wanted) if i < limit]
        if not pos:
            return limit
        wanted = [w.wanted[j] for j in pos]
        source = [w.source[j] for j in pos]
        keys = [w.keys[i] for i in wanted]
        plan = self.index.prepare_store(t, keys, admit=False, hand_over=True)
        self.after_store(plan, writes)  # before any byte lands in the slots it reused
        if plan.dropped:
            limit = min(limit, wanted[plan.dropped[0]])
        if not plan.copy_idx:
            return limit
        entries = self.index.add_pending(plan)
        for j, e in zip(plan.copy_idx, entries, strict=True):
            lead[wanted[j]] = e
        src = np.asarray(source, dtype=np.int64)[plan.copy_idx]
        # hits by tier; a spill in flight counts as the first tier's (it was being spilled there)
        per_tier = np.bincount(np.maximum(src, 0), minlength=len(self.stack)).tolist()
        for tier, k in zip(self.stack.tiers, per_tier, strict=False):
            self.hits[tier.name] += k
        rest = self._from_staging(plan, entries)
        if not rest:
            return limit
        if src.min() == src.max():  # the usual case: every block from one tier
            by_tier = {int(src[0]): rest}
        else:  # a mixed run: each block to the first tier that holds it
            tier_of = {id(e): i for e, i in zip(entries, src.tolist(), strict=True)}
            by_tier = {}
            for e in rest:
                by_tier.setdefault(tier_of[id(e)], []).append(e)
        lost = by_tier.pop(NOWHERE, [])  # a spill in flight that landed nowhere since the walk: a miss
        if lost:
            self._complete(plan, lost, False)
        dest_of = self.index.pool.buffer
        for i, es in by_tier.items():
            tier = self.stack.tiers[i]
            dest = views(dest_of, [e.slot for e in es], t.slot_bytes)
            fut = tier.read(self._ref(t), b"".join([e.key for e in es]), dest)
            for e in es:
                self._promoting[e] = fut
            fut.add_done_callback(lambda f, es=es: self._promoted(plan, es, f))
        return limit

    def _complete(self, plan: StorePlan, entries: list[Entry], ok: bool) -> None:
        """``complete_store`` for the part of a promotion's plan that is resolved now: its blocks come
        back in several pieces (from staging at once, from the tier when each read lands)."""
        if entries:
            self.index.complete_store(replace(plan, entries=entries), ok)

    def _from_staging(self, plan: StorePlan, entries: list[Entry]) -> list[Entry]:
        """Blocks spilled moments ago, whose write has not landed, are copied back from their deferred
        pool slot (the bytes of a committed block, untouched until the write gives it back) and made
        visible at once; returns the others."""
        staged = self.spills.staged
        if not staged:
            return entries
        t = plan.table
        size = t.slot_bytes
        buf = self.index.pool.buffer
        done: list[Entry] = []
        rest: list[Entry] = []
        for e in entries:
            v = staged.get((t, e.key))
            if v is None:
                rest.append(e)
                continue
            buf[e.slot:e.slot + size] = np.frombuffer(v, dtype=np.uint8)
            if self.verify:
                e.checksum = block_sum(buf[e.slot:e.slot + size])
            done.append(e)
        if done:
            self.staged_hits += len(done)
            self._complete(plan, done, True)
        return rest

    def _promoted(self, plan: StorePlan, entries: list[Entry], fut: asyncio.Future) -> None:
        for e in entries:
            self._promoting.pop(e, None)
        ok = fut.result() if not fut.cancelled() and fut.exception() is None else np.zeros(len(entries), bool)
        good = [e for e, g in zip(entries, ok.tolist(), strict=True) if g]
        bad = [e for e, g in zip(entries, ok.tolist(), strict=True) if not g]
        if self.verify and good:
            buf = self.index.pool.buffer
            for e in good:
                e.checksum = block_sum(buf[e.slot:e.slot + e.table.slot_bytes])
        self._complete(plan, good, True)
        self._complete(plan, bad, False)

    def promotions(self, t: Table, keys: list[bytes]) -> list[asyncio.Future]:
        """The promotions a LOAD of ``keys`` must wait for (none: the common case, one dict test)."""
        if not self._promoting:
            return []
        get = t.entries.get
        futs = {self._promoting.get(e) for e in map(get, keys) if e is not None}
        futs.discard(None)
        return list(futs)  # done ones too: until ``_promoted`` ran (a callback later), the blocks are not visible

    # --- figures --------------------------------------------------------------------------------
    def stats(self) -> list[TierStats]:
        """Each tier's own figures, and its hits. The spill path's (spills dropped for the budget, the
        loop's copies, deferred bytes, spills in flight, blocks served from one, answered hits that got
        no slot) belong to the pool's evictions, not to one tier: the first tier shows them (the disk
        tier when there is one; the cluster tier keeps its own queue's figures)."""
        out = []
        sp = self.spills
        for i, t in enumerate(self.tiers):
            assert sp is not None
            st = t.stats()
            st = replace(st, spills_dropped=dict(st.spills_dropped), notes=dict(st.notes))  # not the tier's own
            st.hits = self.hits[t.name]
            raised = sp.errors.get(t.name, 0)
            if raised:  # the tier raised (its own I/O errors are in its count already)
                st.spills_dropped[SpillResult.ERROR.value] = st.spills_dropped.get(SpillResult.ERROR.value, 0) + raised
            if i == 0:
                st.promotions += self.staged_hits  # served from a spill still in flight
                if sp.busy:
                    st.spills_dropped[SpillResult.BUSY.value] = st.spills_dropped.get(SpillResult.BUSY.value, 0) \
                        + sp.busy
                if sp.corrupt:
                    st.spills_dropped[SpillResult.CORRUPT.value] = sp.corrupt
                st.staged_hits = self.staged_hits
                st.spill_copies = sp.copies  # the fallback that copies on the loop
                st.promotions_no_room = self.no_room
                st.spill_deferred_bytes = self.index.deferral.deferred_bytes  # pool slots spills still read
                st.spills_in_flight = len(sp.staged)
            out.append(st)
        return out


def make_tiers(index: Index, disk_path: str, disk_size: int, verify: bool, disk_policy: str = "clock2-ghost",
               keeper: Keeper | None = None, remote: Tier | None = None) -> Tiers:
    """The tiers the configuration asks for, local first: the disk tier (``--disk-path``), then the
    cluster tier (``remote``, made from ``--remote`` by the keyspace). A disk tier that cannot start (an
    unusable ``--disk-path``, or one another user could write) is logged and left out: the daemon
    serves from the pool (and the cluster) rather than not at all."""
    tiers: list[Tier] = []
    disabled = ""
    if disk_path:
        from kvoffd.cache.tiers.disk import DiskTier
        try:
            tiers.append(DiskTier(disk_path, disk_size, policy=disk_policy))
        except (OSError, UnsafePath) as e:
            disabled = f"disk tier disabled: {e}"
            log.error("%s; serving from the pool%s", disabled, " and the cluster" if remote is not None else " alone")
    if remote is not None:
        tiers.append(remote)
    out = Tiers(index, tiers, verify, keeper=keeper)
    out.disabled = disabled
    return out

