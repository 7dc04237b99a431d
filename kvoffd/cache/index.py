"""The index: (namespace, rank, key) -> slot, with an admission/eviction policy, refs and visibility.

A namespace whose runs of ``replicas`` consecutive ranks hold identical KV (MLA latents on every TP
rank) has one table per run, keyed by the run's first rank: that rank stores, every rank of the run
reads the same entries, and a lookup's entries are listed once per rank so each rank's LOAD consumes
its own ref.

Rules it keeps (docs/architecture.md):
  * an entry is visible to LOOKUP/LOAD only once its copy completed (``ready``);
  * a held entry (``refs`` > 0: read by a LOAD, held by a lease, being stored) is never evicted nor
    overwritten; refs are taken and dropped only here (``hold``, ``prepare_load``, ``release``);
  * ready entries are tracked by their slot size's policy (``--eviction-policy``,
    kvoffd/cache/policy.py; ``lru`` is one of them): it is asked ``admit`` for each new key of a STORE
    (a refused key gets no slot and no copy; a policy that ``admits_all`` is not asked) and
    ``victim()`` for each slot needed, and told every other event in the order its module docstring
    gives. ``Entry.in_lru`` means "tracked by the policy"; policy keys are ``(table, key)``. Eviction
    is O(1) per block and skips held entries (``Eviction``, eviction.py);
  * CLEAR unlinks entries at once; a slot still being copied is freed when its job ends;
  * a slot size below its fair share of the pool takes a chunk from the one furthest above it,
    evicting that chunk's unheld entries a bounded number per store (``Reclaimer``, reclaim.py);
  * a STORE's victims are returned to its caller when it asks (``hand_over``: ``StorePlan.victims``,
    as vLLM's ``PrepareStoreOutput.evicted_keys``), which spills them or frees them
    (``free_victims``; kvoffd/cache/keyspace.py decides); slots a spill still reads stay out of the
    pool until it is done (``DeferredSlots``, deferral.py);
  * observers (``IndexObserver``: the pool file's slot records, an event stream: mirrors, never drivers) are
    told of every entry that becomes visible and of every slot before it can be written again, in the
    same loop callback, so what they keep can never disagree with the index for longer than that callback.

Everything here runs on the event loop thread; nothing blocks.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable

from kvoffd.cache import index_views
from kvoffd.cache.deferral import DeferredSlots
from kvoffd.cache.entries import Entry, Hits, LoadPlan, Namespace, StorePlan, Table, Victims
from kvoffd.cache.eviction import Eviction
from kvoffd.cache.observer import IndexObserver
from kvoffd.cache.policy import LRU, EvictionPolicy
from kvoffd.cache.reclaim import Reclaimer
from kvoffd.cache.registry import Registry
from kvoffd.cache.runs import Run, leading
from kvoffd.pool.allocator import Pool
from kvoffd_client.protocol import KEY_SIZE, MissReason

__all__ = ["Entry", "Hits", "Index", "IndexObserver", "LoadPlan", "Namespace", "StorePlan", "Table", "Victims"]

_HISTORY = 100_000  # evicted/failed keys remembered for miss reasons and `kvoffctl explain`

log = logging.getLogger(__name__)


class Index:
    """Refs are lazy with respect to the policy: taking one is ``entry.refs += 1`` and nothing else
    (``hold`` takes thousands per step for leases, in one loop here); eviction skips held entries it
    meets and ``release`` hands them back as most recently used. Callers never touch ``refs``."""

    def __init__(self, pool: Pool, policy: str = LRU.name):
        self.pool = pool
        self.policy = policy
        self.registry = Registry(pool, policy)  # the namespaces, their tables, a policy per slot size
        self.namespaces = self.registry.namespaces
        self._policies = self.registry.policies
        self.check_table = self.registry.check_table
        self.table = self.registry.table
        self.forget_if_idle = self.registry.forget_if_idle
        self.policy_for = self._policies.get
        self.misses = MissHistory()
        self.slot_entry: dict[int, Entry] = {}  # slot -> the entry holding it (until the slot is freed); read-only outside
        self.resident = 0  # ready entries
        self.refs_taken = 0  # refs held on entries now (leases, loads, stores and promotions in flight)
        self.evictions = 0  # all evicted entries, including reclaim_evictions
        self.reclaim_evictions = 0  # evicted to hand their chunk to another slot size
        self.refused = 0  # new blocks the admission policy refused (never copied)
        self.observers: list[IndexObserver] = []
        self.deferral = DeferredSlots(pool)
        self.eviction = Eviction(self)
        self.reclaimer = Reclaimer(self)

    namespace_stats = index_views.namespace_stats  # STATS' per-namespace figures (read-only)
    explain = index_views.explain  # EXPLAIN: each key's state (read-only)

    # --- lookups ----------------------------------------------------------------------------------------
    def lookup(self, namespace: str, keys: bytes, *, with_entries: bool = False) -> Hits:
        """Leading keys ready on every rank; their entries by rank (if asked); the first miss's reason.

        ``keys`` is the message's binary of keys: this is the hot path of every step, and
        ``runs.leading`` mostly checks it without splitting it into keys. Takes no ref: a lease calls
        ``hold`` once it has answered (nothing runs on the loop in between). With replicas each table
        is probed once and its entries are listed under every rank that reads them (the same list).
        """
        ns = self.namespaces.get(namespace)
        if ns is None or len(ns.tables) * ns.replicas < ns.world_size:
            return Hits(0, {}, MissReason.NAMESPACE_MISMATCH, ns.world_size if ns else 0)
        for pol in ns.policies:  # a request starts (O(1): the keys are not passed, no policy needs them)
            pol.on_lookup_miss(())
        total = n = len(keys) // KEY_SIZE
        hits: dict[int, list[Entry]] = {}
        for r in range(0, ns.world_size, ns.replicas):
            n, hits[r] = leading(ns.tables[r].visible, keys, n, with_entries)
            if not n:
                break
        if ns.replicas > 1 and n:
            hits = {r: hits[ns.storing_rank(r)] for r in range(ns.world_size)}
        reason = self.misses.reason(namespace, keys[n * KEY_SIZE:(n + 1) * KEY_SIZE]) if n < total else None
        if not (with_entries and n):
            return Hits(n, {}, reason, ns.world_size)
        return Hits(n, {r: got if len(got) == n else got[:n] for r, got in hits.items()}, reason, ns.world_size)

    # --- refs ---------------------------------------------------------------------------------------------
    def hold(self, hits: Hits) -> int:
        """A lease: one ref on every entry of ``hits`` (thousands per step, one loop). Returns how many."""
        return sum(self.hold_entries(entries) for entries in hits.by_rank.values())

    def hold_entries(self, entries: Collection[Entry]) -> int:
        """One ref on each of ``entries`` (visible ones: a lease's, or blocks a tier reads from their slots
        after this callback, as the Publisher does), dropped by ``release``. Returns how many."""
        for e in entries:
            e.refs += 1
        self.refs_taken += len(entries)
        return len(entries)

    def release(self, entries: Iterable[Entry]) -> None:
        """Drop one ref of each entry (a LOAD ended, a lease was dropped): the one place a ref drops.
        An entry left unheld goes back to its policy as just used, or frees its slot if it was unlinked."""
        policies = self._policies
        dropped = 0
        for e in entries:
            e.refs -= 1
            dropped += 1
            if e.refs:
                continue
            if e.dead:
                self._free(e.table.slot_bytes, [e.slot])
            elif e.ready:  # read by a load, or handed back as a held victim: just used
                policies[e.table.slot_bytes].on_access((e.table, e.key))
                e.in_lru = True
        self.refs_taken -= dropped

    def evictable(self, slot_bytes: int) -> int:
        """At least how many slots of this size evicting could free now: the ready blocks the policy
        may evict, less every ref taken in the pool (a held block is skipped, so each ref may keep one
        from eviction; counted over all sizes and once per ref: never too many). For ``Tiers.fits``."""
        tracked = len(self._policies.get(slot_bytes, ()))
        return max(0, min(tracked, self.resident) - self.refs_taken)

    def prepare_load(self, table: Table, keys: list[bytes]) -> LoadPlan:
        """The entries a LOAD reads, each holding a ref until ``release`` (the copy's end)."""
        get = table.visible.get
        entries: list[Entry] = []
        found: list[int] = []
        missing: list[int] = []
        for i, k in enumerate(keys):
            e = get(k)
            if e is None:
                missing.append(i)
            else:
                e.refs += 1
                entries.append(e)
                found.append(i)
        self.refs_taken += len(entries)
        return LoadPlan(entries, found, missing)

    # --- stores -------------------------------------------------------------------------------------------
    def prepare_store(self, table: Table, keys: list[bytes], admit: bool = True, shard: int = -1,
                      hand_over: bool = False) -> StorePlan:
        """Slots for the keys not yet present that the policy admits, evicting the policy's victims as
        needed; no entries yet.

        Split from ``add_pending`` so the server can start the copy first and do the per-key
        bookkeeping while the bytes move. Keys beyond what the pool can hold are dropped from the
        end: the leading blocks of a prefix are the ones a later lookup can use. ``admit=False``
        skips the admission policy (a promotion from a lower tier: the block was just asked for).
        ``shard``: the pool shard the slots should come from (the storing engine's NUMA node; -1:
        none): a full one spills to the others before anything is evicted (Pool.alloc).
        ``hand_over``: the entries evicted are returned in ``plan.victims`` for the caller to spill or
        free with ``free_victims`` before this store's copy starts (else they are freed here).
        """
        entries = table.entries
        want = [i for i, k in enumerate(keys) if k not in entries]
        if len(want) > 1 and len(set(keys)) < len(keys):  # a key repeated within the batch: copy it once
            firsts = {keys[i]: i for i in reversed(want)}
            want = sorted(firsts.values())
        present = len(keys) - len(want)
        if present:
            self._touch(table, keys)
        refused: list[int] = []
        size = table.slot_bytes
        pol = self._policies[size]
        if want and admit and not pol.admits_all:
            cap = self.pool.slots_share(size)
            if cap != pol.capacity:
                pol.set_capacity(cap)  # this slot size's share of the pool moved
            want, refused = _admitted(pol, table, keys, want)
            self.refused += len(refused)
        if not want:
            return StorePlan(table, keys, [], [], present, [], refused)
        evictions = self.evictions
        victims: list[Victims] | None = [] if hand_over else None
        slots = self.pool.alloc(size, len(want), shard)
        if len(slots) < len(want):
            self.reclaimer.reclaim(size, victims)  # below its fair share: a chunk of another slot size comes this way
            slots += self.pool.alloc(size, len(want) - len(slots), shard)
        short = len(want) - len(slots)
        if short:
            self.eviction.evict_for(size, short, shard, victims)
            slots += self.pool.alloc(size, short, shard)
        dropped = want[len(slots):]
        for i in dropped:  # admitted, no room: the policy lets go of what it reserved
            pol.on_remove((table, keys[i]))
        return StorePlan(table, keys, want[: len(slots)], slots, present, dropped, refused,
                         self.evictions - evictions, victims=victims or [])

    def _touch(self, table: Table, keys: list[bytes]) -> None:
        """Keys an engine stores again are in use (it computed them itself): most recently used.
        (Called before the new keys get entries, so only the present ones are found.)"""
        get = table.entries.get
        on_access = self._policies[table.slot_bytes].on_access
        for k in keys:
            e = get(k)
            if e is not None and e.in_lru:
                on_access((table, k))

    def add_pending(self, plan: StorePlan) -> list[Entry]:
        """Pending (invisible) entries for a planned store, each held (one ref) by the store job."""
        table, keys, slots = plan.table, plan.keys, plan.slots
        out = [Entry(keys[i], table, s, 1) for i, s in zip(plan.copy_idx, slots, strict=True)]
        table.entries.update(zip([e.key for e in out], out, strict=True))
        self.slot_entry.update(zip(slots, out, strict=True))
        self.refs_taken += len(out)
        plan.entries = out
        return out

    def complete_store(self, plan: StorePlan, ok: bool) -> int:
        """The store's copy ended: commit its entries (``ok``) or abort them (a failed, partial or
        expired copy is never committed). Returns how many became visible."""
        if ok:
            return self._commit(plan.entries)
        self._abort(plan.entries)
        return 0

    def _free(self, slot_bytes: int, slots: list[int]) -> None:
        """Give slots back to the pool (their entries are gone for good), observers told first."""
        owner = self.slot_entry
        if self.observers:
            gone = [owner.pop(s) for s in slots]
            for o in self.observers:
                o.freeing(slot_bytes, gone)
        else:
            for s in slots:
                del owner[s]
        self.pool.free(slot_bytes, slots)

    def _commit(self, entries: list[Entry]) -> int:
        """The store copied these: make them visible (unless unlinked meanwhile). Returns how many."""
        if not entries:
            return 0
        now = time.time()
        shown: list[Entry] = []
        pol = self._policies[entries[0].table.slot_bytes]
        on_insert = pol.on_insert
        for e in entries:  # the store's refs are dropped here, not by ``release``
            if e.dead:  # cleared while copied: admitted, never placed
                _release_admission(pol, e)
            else:
                e.ready = True
                e.stored_at = now
                e.table.visible[e.key] = e
                shown.append(e)
                on_insert((e.table, e.key), None)
                e.in_lru = True
            e.refs -= 1
            if e.refs == 0 and e.dead:
                self._free(e.table.slot_bytes, [e.slot])
        self.refs_taken -= len(entries)
        if shown:  # the runs, one per table (a STORE writes one table; this runs before any lookup)
            tables = {e.table for e in shown}
            for t in tables:
                mine = shown if len(tables) == 1 else [e for e in shown if e.table is t]
                run = Run(b"".join([e.key for e in mine]), mine)
                for i, e in enumerate(mine):
                    e.run, e.run_at = run, i
        done = len(shown)
        self.resident += done
        for o in self.observers if shown else ():
            o.committed(shown)
        return done

    def _abort(self, entries: list[Entry]) -> None:
        """The store failed: forget the entries and remember the keys as failed."""
        now = time.time()
        pol = self._policies[entries[0].table.slot_bytes] if entries else None
        for e in entries:
            _release_admission(pol, e)
            if not e.dead:
                del e.table.entries[e.key]
                e.dead = True
                _remember(self.misses.failed, (e.table.namespace, e.key), now)
        self.release(entries)

    def discard(self, e: Entry) -> None:
        """Unlink a ready entry found corrupt; its slot is freed when its last ref drops."""
        if e.dead:
            return
        t = e.table
        del t.entries[e.key]
        if t.visible.pop(e.key, None) is not None:
            e.run.invalidate()
        if e.in_lru:
            self._untrack(e)
        e.dead = True
        if e.ready:
            self.resident -= 1
        _remember(self.misses.failed, (t.namespace, e.key), time.time())
        if e.refs == 0:
            self._free(t.slot_bytes, [e.slot])
        elif e.ready:
            for o in self.observers:
                o.unlinked([e])

    def place(self, entries: list[Entry], cold_end: bool = False) -> None:
        """Make ``entries`` visible at once, their bytes already in their slots, which the pool holds for
        them (a warm restart's blocks, kvoffd/cache/restart/adoption.py), tracked by their policy in
        order; ``cold_end``: as older than every block it tracks. Observers are not told."""
        by_size: dict[int, list[tuple[Table, bytes]]] = {}
        for e in entries:
            t = e.table
            t.entries[e.key] = t.visible[e.key] = self.slot_entry[e.slot] = e
            e.ready = e.in_lru = True
            by_size.setdefault(t.slot_bytes, []).append((t, e.key))
        for size, keys in by_size.items():
            pol = self._policies[size]
            if cold_end:
                pol.on_insert_oldest(keys)
            else:
                for k in keys:
                    pol.on_insert(k, None)
        self.resident += len(entries)

    # --- eviction and CLEAR -------------------------------------------------------------------------------
    def evict(self, slot_bytes: int, n: int) -> int:
        """Free up to ``n`` slots of this size, the policy's victims first, skipping held blocks."""
        return self.eviction.evict(slot_bytes, n)

    def take_victims(self, slot_bytes: int, n: int) -> Victims:
        """Evict up to ``n`` blocks of this size and hand them over, their slots held out of the pool
        until ``free_victims`` (a tier evicting ahead of the next STORE spills them from there)."""
        out: list[Victims] = []
        self.eviction.evict(slot_bytes, n, out)
        return out[0] if out else Victims(slot_bytes, [], True)

    def free_victims(self, v: Victims, keep: Collection[Entry] = ()) -> None:
        """The caller is done with victims handed over: observers hear ``freeing`` (the bytes are still
        in place), and held slots go back to the pool but those of ``keep``, which stay out of it until
        ``deferral.release`` (a spill still reads them). Victims not ``held`` are in the pool already."""
        slots = [e.slot for e in v.entries]
        for o in self.observers if slots else ():
            o.freeing(v.slot_bytes, v.entries)
        if keep and not v.held:
            log.error("free_victims: %d slots a STORE reuses cannot be kept; ignored", len(keep))
        elif keep:
            slots = self.deferral.keep(v.slot_bytes, slots, keep)
        if v.held:
            self.pool.free(v.slot_bytes, slots)

    def drop_victims(self, slot_bytes: int, victims: list[Entry], reclaim: bool = False,
                     out: list[Victims] | None = None, held: bool = True) -> int:
        """Unlink the unheld ``victims`` chosen to make room (by ``Eviction``, or by the ``Reclaimer``
        draining a chunk: ``reclaim``); their keys are remembered as evicted. Their slots are freed,
        unless ``out`` is given: then they are appended to it as one ``Victims`` for the caller to
        spill or free (``free_victims``), the slots out of the pool (``held``) or back in it for the
        STORE that evicted them. Returns how many."""
        now = time.time()
        history, shown = self.misses.evicted, 0
        for e in victims:
            t = e.table
            del t.entries[e.key]
            if t.visible.pop(e.key, None) is not None:
                e.run.invalidate()
                shown += 1
            if e.in_lru:
                self._untrack(e)
            e.dead = True
            _remember(history, (t.namespace, e.key), now)
        self.resident -= shown
        self.evictions += len(victims)
        if reclaim:
            self.reclaim_evictions += len(victims)
        slots = [e.slot for e in victims]
        if out is None:
            self._free(slot_bytes, slots)
            return len(victims)
        owner = self.slot_entry
        for s in slots:
            del owner[s]
        if not held:
            self.pool.free(slot_bytes, slots)
        out.append(Victims(slot_bytes, victims, held))
        return len(victims)

    def _untrack(self, e: Entry) -> None:
        """``e`` leaves for a reason of the index's own (CLEAR, corrupt, its chunk drained)."""
        self._policies[e.table.slot_bytes].on_remove((e.table, e.key))
        e.in_lru = False

    def clear(self, namespace: str = "", in_use: Collection[str] | None = None) -> int:
        """Unlink every entry of one namespace (or all) and forget the cleared namespaces no engine
        uses (``in_use``: those some engine is registered in; None: forget none), so that their world
        size and layouts bind nobody. Returns the blocks that were resident. One pass over the miss
        history whatever the number of namespaces (once per namespace stalled the loop for seconds)."""
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
        self.misses.forget(namespace)
        self.resident -= removed
        return removed


class MissHistory:
    """The keys evicted and failed lately (``_HISTORY`` of each), for a miss's reason and EXPLAIN."""

    def __init__(self) -> None:
        self.evicted: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self.failed: OrderedDict[tuple[str, bytes], float] = OrderedDict()

    def reason(self, namespace: str, key: bytes) -> MissReason:
        """Why ``key`` of ``namespace`` is not found (the first miss of a LOOKUP)."""
        miss = (namespace, key)
        return MissReason.EVICTED if miss in self.evicted else MissReason.FAILED if miss in self.failed \
            else MissReason.ABSENT

    def forget(self, namespace: str = "") -> None:
        """A CLEAR of ``namespace`` ("" = all): one pass over each history whatever the namespaces."""
        if namespace:
            self.evicted = OrderedDict((k, v) for k, v in self.evicted.items() if k[0] != namespace)
            self.failed = OrderedDict((k, v) for k, v in self.failed.items() if k[0] != namespace)
        else:
            self.evicted.clear()
            self.failed.clear()


def _admitted(pol: EvictionPolicy, table: Table, keys: list[bytes], want: list[int]) -> tuple[list[int], list[int]]:
    """Ask the policy about each new key, in key order: (admitted, refused) indices. A key's parent
    is present when the key before it is stored (or being stored) or admitted just now; the
    first key of a STORE counts as having its parent (the engine stores what follows a hit)."""
    entries = table.entries
    ok: list[int] = []
    refused: list[int] = []
    taken: set[bytes] = set()
    admit = pol.admit
    for i in want:
        k = keys[i]
        parent = keys[i - 1] if i else None
        if admit((table, k), parent is None or parent in entries or parent in taken):
            ok.append(i)
            taken.add(k)
        else:
            refused.append(i)
    return ok, refused


def _release_admission(pol: EvictionPolicy, e: Entry) -> None:
    """``e`` was admitted but never placed: the policy forgets it, unless its key was stored again
    since (a CLEAR came in between) and the policy tracks that newer entry."""
    cur = e.table.entries.get(e.key)
    if cur is None or cur is e or not cur.in_lru:
        pol.on_remove((e.table, e.key))


def _remember(history: OrderedDict, key: tuple[str, bytes], when: float) -> None:
    history[key] = when
    history.move_to_end(key)
    if len(history) > _HISTORY:
        history.popitem(last=False)
