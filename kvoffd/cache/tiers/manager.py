"""``Tiers``: what sits between the index and the tiers below the pool (today: the disk tier).

With KV events on, ``publish`` connects each tier to the stream: what it writes and drops is
published under its medium, and what it found at start is announced (kvoffd/events/announce.py).

It is an index observer (a subclass of kvoffd/cache/index.py's ``IndexObserver``): blocks evicted from
the pool are spilled (``evicted``), a CLEAR clears the tiers (``cleared``, per namespace; the server
wraps every CLEAR in ``clearing``, which counts what each tier forgot for the reply, makes a CLEAR of
all one pass over the tiers, and clears a namespace the index does not know: blocks left on disk from
before a restart). And it is the one object the server calls
for the rest, at two places: ``find_below`` after the pool's leading hits (the blocks found below are
hits too; ``fits`` says whether the LOOKUP may be answered before ``promote`` takes their pool slots
and starts their reads) and ``promotions`` before a LOAD (which then waits for them, so the LOAD itself
is an ordinary pool -> engine copy).

Spilled bytes are never copied on the loop: the tier's I/O threads write them straight from the pool
slot, which the index keeps out of the pool meanwhile (a deferred free, kvoffd/cache/deferral.py)
and which ``evicted``'s write gives back once it has read it. At most ``spill_buffer_bytes`` are
deferred; past it a spill is dropped (counted ``busy``), never waited for, so a slow disk cannot
stall stores or the loop. One fallback copies: a STORE that needs more slots at once than the index
kept free ahead of it (kvoffd/cache/deferral.py) has its victims copied out on the loop into a
staging buffer (within the same budget, counted in ``spill_copies``) rather than dropped.

A promotion takes pool slots the way a STORE does (evicting as needed, bypassing admission: the block
was just asked for) as pending entries, visible only once the tier has verified the bytes; a block that
fails is aborted (its LOAD reports it failed, the engine recomputes). A slot is never freed while a
read into it is in flight: the entry keeps its store ref until the tier resolves the read.

A block adopted at a warm restart whose checksum the keeper has not verified yet (kvoffd/cache/restart/verifier.py)
is checked against it before it is spilled, on a thread, and dropped (counted ``corrupt``) when it
fails: the tier would otherwise give the corrupt bytes a fresh checksum of its own and serve them.
Until its check is done such a block is neither staged nor written. And a tier that raises is a
dropped spill (counted ``error``, logged), never an error in the eviction that called it: the index
must stay whole whatever a tier does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from kvoffd.cache.checksum import block_sum
from kvoffd.cache.deferral import AHEAD_SHARE
from kvoffd.cache.index import Entry, Hits, Index, IndexObserver, StorePlan, Table
from kvoffd.cache.tiers.base import Held, SpillResult, TableRef, Tier, TierEvents, TierStats
from kvoffd.runtime import UnsafePath
from kvoffd_client.protocol import KEY_SIZE, split_keys

if TYPE_CHECKING:
    from kvoffd.cache.restart.keeper import Keeper

log = logging.getLogger(__name__)

_K = KEY_SIZE
PROMOTE_WAIT_S = 10.0  # a LOAD waits at most this long for a promotion (then those blocks fail)
SPILL_BUFFER_BYTES = 256 << 20
_POPULATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
FAULT_LOG_S = 60.0  # a tier that keeps raising: its traceback once, then a line at most this often


@dataclass
class _Spill:
    """One write to a tier of blocks evicted together: ``src`` are views of their deferred pool slots."""

    tier: Tier
    table: Table
    slot_bytes: int
    keys: list[bytes]
    slots: list[int]  # deferred pool slots, given back when the write resolves ([] once copied out)
    src: list[memoryview] = field(default_factory=list)
    copied: int = 0  # bytes in a staging copy (the fallback), counted against the budget
    unchecked: list[tuple[int, int]] = field(default_factory=list)  # (position, checksum): adopted, not verified yet


@dataclass
class _Clearing:
    """A CLEAR under way (``Tiers.clearing``): its namespace ("" = all), the blocks each tier forgot,
    and whether the tiers were cleared yet."""

    namespace: str
    removed: dict[str, int]
    done: bool = False


@dataclass
class _Walk:
    """One rank's leading keys past the pool's hits, exactly (``Tiers._walk``): its entry (pool or
    promotion under way) or None for a tier block, and the positions of the tier blocks to promote."""

    table: Table
    keys: list[bytes]  # the leading keys walked
    lead: list[Entry | None]
    wanted: list[int]


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


class Tiers(IndexObserver):
    """``keeper``: the pool file's keeper (kvoffd/cache/restart/keeper.py), asked which evicted blocks are adopted
    and not verified yet (``must_check``) and whether their bytes still match (``intact``); None: a
    pool without one (nothing adopted)."""

    def __init__(self, index: Index, tiers: Sequence[Tier], verify: bool = False,
                 spill_buffer_bytes: int = SPILL_BUFFER_BYTES, keeper: Keeper | None = None):
        self.index = index
        self.tiers = list(tiers)
        self.verify = verify
        self.keeper = keeper
        self.spill_corrupt = 0  # adopted blocks not spilled: their bytes failed the checksum they were adopted with
        self.spill_errors = 0  # blocks not spilled because the tier raised (a bug: logged)
        self._fault_logged = -FAULT_LOG_S
        self.spill_buffer_bytes = spill_buffer_bytes
        self._refs: dict[Table, TableRef] = {}
        self._promoting: dict[Entry, asyncio.Future] = {}
        self._spilling: set[asyncio.Future] = set()
        self._copied_bytes = 0  # staging copies in flight (the fallback when a STORE needs the slots now)
        self.spill_copies = 0  # blocks copied on the loop by that fallback
        self._held: list[_Spill] | None = None  # spills begun during a LOOKUP's promotions, written after them
        self._staged: dict[tuple[Table, bytes], memoryview] = {}  # spilled, write not done: its pool slot
        self.staged_hits = 0
        self.no_room = 0  # blocks a LOOKUP answered before their promotion that no pool slot was found for
        self.hits: dict[str, int] = {t.name: 0 for t in self.tiers}
        self.spill_busy = 0
        self._clearing: _Clearing | None = None  # inside ``clearing``
        self.disabled = ""  # why a configured tier is not running (kvoffctl status shows it)
        if self.tiers:
            index.observers.append(self)
            index.deferral.budget = spill_buffer_bytes  # spills read their (deferred) pool slots

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
        pending = [f for f in self._spilling if not f.done()] + [f for f in self._promoting.values() if not f.done()]
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

    # --- the observer seam ------------------------------------------------------------------------
    # ``committed`` and ``freeing`` stay no-ops: a tier is written when a block leaves the pool (the
    # ``evicted`` moment, just before its ``freeing``), not when it enters; other frees are not kept.
    def cleared(self, namespace: str) -> None:
        """Forget ``namespace`` below the pool too ("" = every namespace: the server's CLEAR of all)."""
        c = self._clearing
        if c is not None and not c.namespace:
            return  # one pass over the tiers for all of them, when the CLEAR of all ends
        self._clear_tiers(namespace, c)

    def _clear_tiers(self, namespace: str, c: _Clearing | None) -> None:
        for t in self.tiers:
            n = t.clear(namespace)
            if c is not None:
                c.removed[t.name] += n
        if c is not None:
            c.done = True
        self._refs = {t: r for t, r in self._refs.items() if namespace and r.namespace != namespace}
        self._staged = {k: v for k, v in self._staged.items() if namespace and k[0].namespace != namespace}

    @contextlib.contextmanager
    def clearing(self, namespace: str) -> Iterator[dict[str, int]]:
        """Around the index's CLEAR of ``namespace`` ("" = all); yields the blocks each tier forgot, by
        tier name, filled in when the block ends (the CLEAR's reply says them beside the pool's).

        Of all: the index's per-namespace ``cleared`` moments become one clear of the tiers at the end
        (a tier's clear walks its whole index), which also takes the namespaces only the tiers
        know. Of one: the index tells ``cleared`` if it knows the namespace; if it does not (blocks left
        on disk from before a restart, no engine registered since), the tiers are cleared here."""
        c = self._clearing = _Clearing(namespace, {t.name: 0 for t in self.tiers})
        try:
            yield c.removed
        finally:
            self._clearing = None
            if not c.done:
                self._clear_tiers(namespace, c)

    def namespace_blocks(self) -> dict[str, dict[str, Held]]:
        """Namespace -> tier name -> what that tier holds of it (tiers that hold none of it left out)."""
        out: dict[str, dict[str, Held]] = {}
        for t in self.tiers:
            for ns, held in t.namespace_blocks().items():
                out.setdefault(ns, {})[t.name] = held
        return out

    def evicted(self, slot_bytes: int, entries: Sequence[Entry]) -> list[Entry]:
        """Spill what the pool evicts (visible blocks, admitted once), unless a tier holds it already.
        Returns the entries spilled: their slots stay out of the pool (deferred) until the write has
        read them. When the index needs the slots now (``index.deferral.ok`` off: a STORE larger than the
        reserve kept ahead) the blocks are copied out instead. Past the budget a spill is dropped
        (counted ``busy``), never waited for."""
        tier = self.tiers[0]
        index = self.index
        groups: dict[Table, list[Entry]] = {}
        for e in entries:
            if e.ready:
                groups.setdefault(e.table, []).append(e)
        kept: list[Entry] = []
        for t, es in groups.items():
            sp: _Spill | None = None
            try:
                keys = b"".join([e.key for e in es])
                have_it = tier.contains(self._ref(t), keys, touch=True).tolist()  # used in the pool since
                todo = [e for e, have in zip(es, have_it, strict=True)
                        if not have and (t, e.key) not in self._staged]
                room = max(0, index.deferral.budget - index.deferral.deferred_bytes - self._copied_bytes
                           - len(kept) * slot_bytes) // slot_bytes
                if len(todo) > room:
                    self.spill_busy += len(todo) - room
                    todo = todo[:room]
                if not todo:
                    continue
                sp = _Spill(tier, t, slot_bytes, [e.key for e in todo], [e.slot for e in todo],
                            unchecked=self._unchecked(todo))
                if not index.deferral.ok:  # the STORE needs these slots now: the one case the loop still copies (bounded)
                    self._copy_out(sp)
                self._spill(sp)
            except Exception:  # the index must stay whole whatever a tier does: these blocks are just not spilled
                self._fault("a spill", len(es))
                if sp is not None:
                    sp.slots = []  # not deferred: the index frees them itself
                    self._spilled(sp)
                continue
            if index.deferral.ok:
                kept += todo
        return kept

    def _unchecked(self, entries: list[Entry]) -> list[tuple[int, int]]:
        """The adopted blocks among ``entries`` that the keeper has not verified yet, with the checksum
        they were adopted with (asked now: the keeper forgets them at their ``freeing``, just after)."""
        k = self.keeper
        if k is None or not k.must_check(entries):
            return []
        return [(i, e.checksum) for i, e in enumerate(entries) if k.must_check((e,))]

    def _fault(self, what: str, blocks: int) -> None:
        """A tier raised: ``blocks`` dropped (counted ``error``); the traceback once, then a line a minute."""
        self.spill_errors += blocks
        now = time.monotonic()
        if now - self._fault_logged >= FAULT_LOG_S:
            first = self._fault_logged < 0
            self._fault_logged = now
            log.error("disk tier: %s failed (%d blocks dropped, %d in all); the daemon goes on without them",
                      what, blocks, self.spill_errors, exc_info=first)

    def _copy_out(self, sp: _Spill) -> None:
        """Copy the blocks out of their slots into a page-aligned staging buffer (O_DIRECT writes
        straight from it); the slots are then free at once (``sp.slots`` emptied: nothing deferred)."""
        size = sp.slot_bytes
        # MAP_POPULATE: the kernel faults the pages in at once; touched one page at a time by the copy
        # they cost most of it (~5 µs per 4 KiB page on the VM: bench/index_scale.py, disk hits)
        staging = mmap.mmap(-1, len(sp.slots) * size, flags=_POPULATE)
        dst = np.frombuffer(staging, dtype=np.uint8)
        buf = self.index.pool.buffer
        for i, s in enumerate(sp.slots):
            dst[i * size:(i + 1) * size] = buf[s:s + size]
        view = memoryview(staging)
        sp.src = [view[i * size:(i + 1) * size] for i in range(len(sp.slots))]
        sp.copied = len(sp.slots) * size
        sp.slots = []
        self._copied_bytes += sp.copied
        self.spill_copies += len(sp.src)

    def _spill(self, sp: _Spill) -> None:
        if not sp.src:
            sp.src = _views(self.index.pool.buffer, sp.slots, sp.slot_bytes)  # the pool's memory: no copy
        if sp.unchecked:  # adopted blocks not verified yet: checked first, off the loop
            self._check_then_spill(sp)
            return
        for k, v in zip(sp.keys, sp.src, strict=True):  # until the write lands, a lookup is served from here
            self._staged[(sp.table, k)] = v
        if self._held is not None:  # a LOOKUP is promoting: its reads go first (see ``promote``)
            self._held.append(sp)
        else:
            self._write(sp)

    def _check_then_spill(self, sp: _Spill) -> None:
        """Compare the unverified adopted blocks of ``sp`` with their checksums on a thread (their bytes
        stay put meanwhile: deferred slots, or the staging copy), then spill those that match."""
        keeper = self.keeper
        assert keeper is not None
        todo, src = list(sp.unchecked), sp.src

        def check() -> list[int]:
            return [i for i, want in todo if not keeper.intact(src[i], want)]

        fut = asyncio.get_running_loop().run_in_executor(None, check)
        self._spilling.add(fut)

        def checked(f: asyncio.Future) -> None:
            self._spilling.discard(f)
            bad = set(f.result()) if not f.cancelled() and f.exception() is None else {i for i, _ in todo}
            if bad:
                self.spill_corrupt += len(bad)
                log.warning("%d blocks adopted at the restart failed their checksum as they left the pool: "
                            "not spilled", len(bad))
                sp.keys = [k for i, k in enumerate(sp.keys) if i not in bad]
                sp.src = [v for i, v in enumerate(sp.src) if i not in bad]
            sp.unchecked = []
            if sp.keys:
                self._spill(sp)
            else:
                self._spilled(sp)

        fut.add_done_callback(checked)

    def _write(self, sp: _Spill) -> None:
        try:
            fut = sp.tier.write(self._ref(sp.table), b"".join(sp.keys), sp.src)
        except Exception:  # a tier that raises: the spill is dropped, its slots given back as if written
            self._fault("a spill", len(sp.keys))
            asyncio.get_running_loop().call_soon(self._spilled, sp)  # (after ``evicted`` deferred them)
            return
        self._spilling.add(fut)

        def done(f: asyncio.Future) -> None:  # every task of the write has read its slots
            self._spilling.discard(f)
            self._spilled(sp)

        fut.add_done_callback(done)

    def _spilled(self, sp: _Spill) -> None:
        """The spill's bytes are read (written, or dropped): unstaged, its slots back to the pool."""
        for k, v in zip(sp.keys, sp.src, strict=True):
            if self._staged.get((sp.table, k)) is v:
                del self._staged[(sp.table, k)]
        sp.src = []
        self._copied_bytes -= sp.copied
        sp.copied = 0
        if sp.slots:
            slots, sp.slots = sp.slots, []
            self.index.deferral.release(sp.slot_bytes, slots)

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
        itself pins, cover every key past the pool's hits. A full pool passes; one whose blocks are
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
        pinned = (below.hits.n + per_rank) * len(below.tables)
        return all(index.pool.spare_slots(size, k) + index.evictable(size) - pinned - ahead.get(size, 0) >= k
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
        pinned = [e for w in walks for e in w.lead if e is not None and id(e) not in keep]
        pinned += self._lead_entries(by_rank)
        # what this answer promises must survive the evictions the promotions cause
        self.index.hold(Hits(len(pinned), {0: pinned}, None, ns.world_size))
        # The promotions evict pool blocks, whose spills would take tier slots: one of them could be a
        # block about to be read. So the spills wait until every read is submitted (a read in flight
        # keeps its slot from reuse).
        self._held = []
        try:
            for w in walks:
                limit = min(limit, self._promote(w, limit))
        finally:
            held, self._held = self._held, None
            self.index.release(pinned)
            for sp in held:
                self._write(sp)
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
        that is ready or being promoted, or else a block the tier may hold or a spill still in flight
        (``find_below`` says why "may"). The first key is asked exactly, alone: the usual miss (a new
        prompt) costs one lookup of one key."""
        get = t.entries.get
        staged = self._staged
        promoting = self._promoting
        tier, ref = self.tiers[0], self._ref(t)
        first = rest[:_K]
        e = get(first)
        if e is not None:
            if not (e.ready or e in promoting):
                return 0  # being stored by a STORE: not readable yet
        elif (t, first) not in staged and not tier.contains(ref, first)[0]:
            return 0
        if limit == 1:
            return 1
        lead = 1 + tier.probe(ref, rest[_K:limit * _K])
        if lead == limit and len(t.entries) == len(t.visible):
            return limit  # the usual disk hit: all below, and every pool entry ready (a hit either way)
        # Some key is not below, or a key may be in the pool but not ready: the pool's entries decide,
        # a spill in flight serves, and past a key the tier lacks it is asked again from the next one.
        keys = split_keys(rest[:limit * _K])
        ents = list(map(get, keys))
        below = lead  # keys [i, below) may be held by the tier
        i = 1
        while i < limit:
            e = ents[i]
            if e is not None:
                if not (e.ready or e in promoting):
                    break  # being stored by a STORE: not readable yet
            elif i >= below and (t, keys[i]) not in staged:
                below = i + tier.probe(ref, rest[i * _K:limit * _K])
                if below == i:
                    break
            i += 1
        return i

    def _walk(self, t: Table, rest: bytes, limit: int) -> _Walk:
        """The leading keys of ``rest`` (at most ``limit``) this rank serves, exactly: its entry (pool or
        promotion under way) or None for a tier block, and the positions of the tier blocks to promote."""
        get = t.entries.get
        staged = self._staged
        keys = split_keys(rest[:limit * _K])
        on = self.tiers[0].contains(self._ref(t), rest[:limit * _K]).tolist()
        ents = list(map(get, keys))
        if all(on) and ents.count(None) == limit:  # the usual disk hit: all on disk, none in the pool
            return _Walk(t, keys, [None] * limit, list(range(limit)))
        lead: list[Entry | None] = []
        wanted: list[int] = []
        for i, (k, e) in enumerate(zip(keys, ents, strict=True)):
            if e is not None:
                if e.ready or e in self._promoting:
                    lead.append(e)
                    continue
                break  # being stored by a STORE: not readable yet
            if not on[i] and (t, k) not in staged:
                break
            lead.append(None)
            wanted.append(i)
        return _Walk(t, keys, lead, wanted)

    def _promote(self, w: _Walk, limit: int) -> int:
        """Pool slots and reads for this rank's tier blocks among the first ``limit``; returns how many
        leading keys stay hits (fewer when the pool had no room for all)."""
        t, lead = w.table, w.lead
        wanted = [i for i in w.wanted if i < limit]
        if not wanted:
            return limit
        keys = [w.keys[i] for i in wanted]
        plan = self.index.prepare_store(t, keys, admit=False)
        if plan.dropped:
            limit = min(limit, wanted[plan.dropped[0]])
        if not plan.copy_idx:
            return limit
        entries = self.index.add_pending(plan)
        for j, e in zip(plan.copy_idx, entries, strict=True):
            lead[wanted[j]] = e
        tier = self.tiers[0]
        self.hits[tier.name] += len(entries)
        entries = self._from_staging(plan, entries)
        if not entries:
            return limit
        dest = _views(self.index.pool.buffer, [e.slot for e in entries], t.slot_bytes)
        fut = tier.read(self._ref(t), b"".join([e.key for e in entries]), dest)
        for e in entries:
            self._promoting[e] = fut
        fut.add_done_callback(lambda f: self._promoted(plan, entries, f))
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
        if not self._staged:
            return entries
        t = plan.table
        size = t.slot_bytes
        buf = self.index.pool.buffer
        done: list[Entry] = []
        rest: list[Entry] = []
        for e in entries:
            v = self._staged.get((t, e.key))
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
        out = []
        for t in self.tiers:
            st = t.stats()
            st = replace(st, spills_dropped=dict(st.spills_dropped), notes=dict(st.notes))  # not the tier's own
            st.hits = self.hits[t.name]
            st.promotions += self.staged_hits  # served from a spill still in flight
            if self.spill_busy:
                st.spills_dropped[SpillResult.BUSY.value] = self.spill_busy
            if self.spill_errors:  # the tier raised (its own I/O errors are in its count already)
                st.spills_dropped[SpillResult.ERROR.value] = st.spills_dropped.get(SpillResult.ERROR.value, 0) \
                    + self.spill_errors
            if self.spill_corrupt:
                st.spills_dropped[SpillResult.CORRUPT.value] = self.spill_corrupt
            st.staged_hits = self.staged_hits
            st.spill_copies = self.spill_copies  # the fallback that copies on the loop
            st.promotions_no_room = self.no_room
            st.spill_deferred_bytes = self.index.deferral.deferred_bytes  # pool slots spills still read
            st.spills_in_flight = len(self._staged)
            out.append(st)
        return out


def _views(buf: np.ndarray, slots: Sequence[int], size: int) -> list[memoryview]:
    """One memoryview per slot of the pool's buffer. Sliced from one view of the whole buffer: a slice of
    a memoryview is ~0.2 µs where ``memoryview(buf[a:b])`` (a numpy slice, then a view of it) is ~3 µs,
    a third of a 1,024-block promotion's loop time (bench/index_scale.py, disk hits). The parent view is
    local: the slices keep the pool's mapping exported only as long as they live, as before."""
    mv = memoryview(buf)
    return [mv[s:s + size] for s in slots]


def make_tiers(index: Index, disk_path: str, disk_size: int, verify: bool, disk_policy: str = "clock2-ghost",
               keeper: Keeper | None = None) -> Tiers:
    """The tiers the configuration asks for. A tier that cannot start (an unusable ``--disk-path``, or
    one another user could write) is logged and left out: the daemon serves from the pool alone rather
    than not at all."""
    tiers: list[Tier] = []
    disabled = ""
    if disk_path:
        from kvoffd.cache.tiers.disk import DiskTier
        try:
            tiers.append(DiskTier(disk_path, disk_size, policy=disk_policy))
        except (OSError, UnsafePath) as e:
            disabled = f"disk tier disabled: {e}"
            log.error("%s; serving from the pool alone", disabled)
    out = Tiers(index, tiers, verify, keeper=keeper)
    out.disabled = disabled
    return out

