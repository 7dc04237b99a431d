"""``Spills``: the blocks the pool evicts, written to the tiers below it (held by ``Tiers``).

The index returns what it evicts (``StorePlan.victims``, ``Index.take_victims``); ``settle`` spills
the visible blocks and gives every victim back to the index (``Index.free_victims``), keeping out of
the pool the slots a write still reads. Each tier is given the victims it does not hold yet: with a
disk tier and the cluster tier, a block goes to the disk unless the disk holds it, and to the cluster
unless this node knows the cluster holds it (the cluster is normally written at admission,
kvoffd/cache/tiers/remote/publisher.py; what the publisher could not take, its held share or its queue
full, is published here, as with the cluster tier alone). One slot serves every tier's write and
goes back to the pool once the last of them has read it.

Spilled bytes are never copied on the loop: the tier's I/O threads write them straight from the pool
slot, which stays out of the pool meanwhile (a deferred free, kvoffd/cache/deferral.py) and which the
write gives back once it has read it. At most ``budget`` bytes are deferred; past it a spill is
dropped (counted ``busy``), never waited for, so a slow disk cannot stall stores or the loop. One
fallback copies: a STORE's own victims, whose slots that store reuses (``Victims.held`` off), are
copied out on the loop into a staging buffer (within the same budget, counted in ``spill_copies``)
rather than dropped. ``keep_ahead`` keeps that fallback rare: after a STORE it evicts, deferred, what
the next one would need.

A block adopted at a warm restart whose checksum the keeper has not verified yet
(kvoffd/cache/restart/verifier.py) is checked against it before it is spilled, on a thread, and
dropped (counted ``corrupt``) when it fails: the tier would otherwise give the corrupt bytes a fresh
checksum of its own and serve them. Until its check is done such a block is neither staged nor
written. And a tier that raises is a dropped spill (counted ``error``, logged), never an error in the
eviction: the index must stay whole whatever a tier does.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvoffd.cache.deferral import AHEAD_SHARE
from kvoffd.cache.index import Entry, Index, Table, Victims
from kvoffd.cache.tiers.base import TableRef, Tier

if TYPE_CHECKING:
    from kvoffd.cache.restart.keeper import Keeper

log = logging.getLogger(__name__)

SPILL_BUFFER_BYTES = 256 << 20
_POPULATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
FAULT_LOG_S = 60.0  # a tier that keeps raising: its traceback once, then a line at most this often


@dataclass
class Spill:
    """The writes of blocks evicted together: ``src`` are views of their deferred pool slots, ``parts``
    each tier's share (positions in ``keys``)."""

    parts: list[tuple[Tier, list[int]]]
    table: Table
    slot_bytes: int
    keys: list[bytes]
    slots: list[int]  # deferred pool slots, given back when the write resolves ([] once copied out)
    src: list[memoryview] = field(default_factory=list)
    copied: int = 0  # bytes in a staging copy (the fallback), counted against the budget
    unchecked: list[tuple[int, int]] = field(default_factory=list)  # (position, checksum): adopted, not verified yet
    pending: int = 0  # tiers' writes not resolved yet (the slots go back after the last)
    sums: list[int] = field(default_factory=list)  # the blocks' pool checksums (Entry.checksum; -1: none)

    def keep(self, good: list[int]) -> None:
        """Only the blocks at positions ``good`` (ascending) are written."""
        at = {p: i for i, p in enumerate(good)}
        self.keys = [self.keys[p] for p in good]
        self.src = [self.src[p] for p in good]
        if self.sums:
            self.sums = [self.sums[p] for p in good]
        self.parts = [(tier, [at[p] for p in pos if p in at]) for tier, pos in self.parts]


class Spills:
    """Writes of evicted blocks to ``tiers`` (local first; the figures here are the first one's).
    ``ref``: the tiers' name for an index table. ``keeper``: the pool file's keeper, asked which evicted
    blocks are adopted and not verified yet (``must_check``) and whether their bytes still match
    (``intact``); None: nothing adopted."""

    def __init__(self, index: Index, tiers: Sequence[Tier], ref: Callable[[Table], TableRef],
                 budget: int = SPILL_BUFFER_BYTES, keeper: Keeper | None = None):
        self.index = index
        self.tiers = list(tiers)
        self.ref = ref
        self.budget = budget  # bytes of pool slots (deferred) and staging copies spills may hold
        self.keeper = keeper
        self.staged: dict[tuple[Table, bytes], memoryview] = {}  # spilled, write not done: its bytes
        self.in_flight: set[asyncio.Future] = set()  # writes and checks not resolved yet
        self.copied_bytes = 0  # staging copies in flight (the fallback when a STORE needs the slots now)
        self.copies = 0  # blocks copied on the loop by that fallback
        self.busy = 0  # spills dropped: past the budget
        self.errors: dict[str, int] = {}  # by tier name: blocks not spilled because the tier raised (a bug: logged)
        self.corrupt = 0  # adopted blocks not spilled: their bytes failed the checksum they were adopted with
        self._fault_logged = -FAULT_LOG_S

    def settle(self, victims: Sequence[Victims], writes: list[Spill] | None = None) -> None:
        """Spill what the index evicted, then give each group back (``Index.free_victims``), the slots
        spilled from kept out of the pool until their write has read them. ``writes``: the writes
        wait there (a LOOKUP's promotions submit their reads first); None: written now."""
        for v in victims:
            self.index.free_victims(v, self._spill_victims(v, writes))

    def keep_ahead(self, slot_bytes: int, n: int, writes: list[Spill] | None = None) -> None:
        """After a STORE of ``n`` slots: evict now, deferred and within the budget, what the next one
        would need (kvoffd/cache/deferral.py), at most 1/``AHEAD_SHARE`` of the slots this size holds
        (a small pool keeps most of its blocks)."""
        index = self.index
        room = (self.budget - index.deferral.deferred_bytes) // slot_bytes
        want = min(n, index.pool.slots_share(slot_bytes) // AHEAD_SHARE, room)
        if want <= 0:
            return
        missing = want - index.pool.spare_slots(slot_bytes, want)
        if missing > 0:
            self.settle([index.take_victims(slot_bytes, missing)], writes)

    def _spill_victims(self, v: Victims, writes: list[Spill] | None) -> list[Entry]:
        """Spill the visible victims (admitted once) to each tier that does not hold them already;
        returns those spilled from their slots (to keep out of the pool). Victims whose slots a STORE
        reuses are copied out."""
        tiers = self.tiers
        slot_bytes = v.slot_bytes
        groups: dict[Table, list[Entry]] = {}
        for e in v.entries:
            if e.ready:
                groups.setdefault(e.table, []).append(e)
        kept: list[Entry] = []
        for t, es in groups.items():
            sp: Spill | None = None
            try:
                keys = b"".join([e.key for e in es])
                ref = self.ref(t)
                have = np.stack([np.asarray(tier.contains(ref, keys, touch=True), dtype=bool)  # touch: used in the pool since
                                 for tier in tiers])
                want = (~have).any(axis=0).tolist()
                pick = [i for i, (e, w) in enumerate(zip(es, want, strict=True))
                        if w and (t, e.key) not in self.staged]
                room = max(0, self.budget - self.index.deferral.deferred_bytes - self.copied_bytes
                           - len(kept) * slot_bytes) // slot_bytes
                if len(pick) > room:
                    self.busy += len(pick) - room
                    pick = pick[:room]
                if not pick:
                    continue
                todo = [es[i] for i in pick]
                lacks = ~have[:, pick]
                parts = [(tier, np.flatnonzero(lacks[j]).tolist()) for j, tier in enumerate(tiers)]
                sp = Spill(parts, t, slot_bytes, [e.key for e in todo], [e.slot for e in todo],
                           unchecked=self._unchecked(todo), sums=[e.checksum for e in todo])
                if not v.held:  # the STORE reuses these slots: the one case the loop still copies (bounded)
                    self._copy_out(sp)
                self._spill(sp, writes)
            except Exception:  # the index must stay whole whatever a tier does: these blocks are just not spilled
                self._fault(tiers[0], "a spill", len(es))
                if sp is not None:
                    sp.slots = []  # not deferred: the index frees them itself
                    self._spilled(sp)
                continue
            if v.held:
                kept += todo
        return kept

    def _unchecked(self, entries: list[Entry]) -> list[tuple[int, int]]:
        """The adopted blocks among ``entries`` that the keeper has not verified yet, with the checksum
        they were adopted with (asked now: the keeper forgets them at their ``freeing``, just after)."""
        k = self.keeper
        if k is None or not k.must_check(entries):
            return []
        return [(i, e.checksum) for i, e in enumerate(entries) if k.must_check((e,))]

    def _fault(self, tier: Tier, what: str, blocks: int) -> None:
        """A tier raised: ``blocks`` dropped (counted ``error``); the traceback once, then a line a minute."""
        self.errors[tier.name] = self.errors.get(tier.name, 0) + blocks
        now = time.monotonic()
        if now - self._fault_logged >= FAULT_LOG_S:
            first = self._fault_logged < 0
            self._fault_logged = now
            log.error("%s tier: %s failed (%d blocks dropped, %d in all); the daemon goes on without them",
                      tier.name, what, blocks, self.errors[tier.name], exc_info=first)

    def _copy_out(self, sp: Spill) -> None:
        """Copy the blocks out of their slots into a page-aligned staging buffer (O_DIRECT writes
        straight from it); the slots are then free at once (``sp.slots`` emptied: nothing deferred)."""
        size = sp.slot_bytes
        # MAP_POPULATE: the kernel faults the pages in at once; touched one page at a time by the copy
        # they cost most of it (bench/index_scale.py, disk hits)
        staging = mmap.mmap(-1, len(sp.slots) * size, flags=_POPULATE)
        dst = np.frombuffer(staging, dtype=np.uint8)
        buf = self.index.pool.buffer
        for i, s in enumerate(sp.slots):
            dst[i * size:(i + 1) * size] = buf[s:s + size]
        view = memoryview(staging)
        sp.src = [view[i * size:(i + 1) * size] for i in range(len(sp.slots))]
        sp.copied = len(sp.slots) * size
        sp.slots = []
        self.copied_bytes += sp.copied
        self.copies += len(sp.src)

    def _spill(self, sp: Spill, writes: list[Spill] | None = None) -> None:
        if not sp.src:
            sp.src = views(self.index.pool.buffer, sp.slots, sp.slot_bytes)  # the pool's memory: no copy
        if sp.unchecked:  # adopted blocks not verified yet: checked first, off the loop
            self._check_then_spill(sp)
            return
        for k, v in zip(sp.keys, sp.src, strict=True):  # until the write lands, a lookup is served from here
            self.staged[(sp.table, k)] = v
        if writes is not None:  # a LOOKUP is promoting: its reads go first (``Tiers.promote``)
            writes.append(sp)
        else:
            self.write(sp)

    def _check_then_spill(self, sp: Spill) -> None:
        """Compare the unverified adopted blocks of ``sp`` with their checksums on a thread (their bytes
        stay put meanwhile: deferred slots, or the staging copy), then spill those that match."""
        keeper = self.keeper
        assert keeper is not None
        todo, src = list(sp.unchecked), sp.src

        def check() -> list[int]:
            return [i for i, want in todo if not keeper.intact(src[i], want)]

        fut = asyncio.get_running_loop().run_in_executor(None, check)
        self.in_flight.add(fut)

        def checked(f: asyncio.Future) -> None:
            self.in_flight.discard(f)
            bad = set(f.result()) if not f.cancelled() and f.exception() is None else {i for i, _ in todo}
            if bad:
                self.corrupt += len(bad)
                log.warning("%d blocks adopted at the restart failed their checksum as they left the pool: "
                            "not spilled", len(bad))
                sp.keep([i for i in range(len(sp.keys)) if i not in bad])
            sp.unchecked = []
            if sp.keys:
                self._spill(sp)
            else:
                self._spilled(sp)

        fut.add_done_callback(checked)

    def write(self, sp: Spill) -> None:
        """Each tier's share of ``sp`` written (at once, in parallel); its slots go back to the pool when
        the last write resolved (``_spilled``, never before ``settle`` deferred them: a loop turn later)."""
        loop = asyncio.get_running_loop()
        parts = [(tier, pos) for tier, pos in sp.parts if pos]
        sp.pending = len(parts)
        if not parts:
            loop.call_soon(self._spilled, sp)
            return
        ref = self.ref(sp.table)
        for tier, pos in parts:
            whole = len(pos) == len(sp.keys)
            try:
                fut = tier.write(ref, b"".join(sp.keys if whole else [sp.keys[p] for p in pos]),
                                 sp.src if whole else [sp.src[p] for p in pos],
                                 sums=(sp.sums if whole else [sp.sums[p] for p in pos]) if sp.sums else None)
            except Exception:  # a tier that raises: its share is dropped, the slots given back as if written
                self._fault(tier, "a spill", len(pos))
                loop.call_soon(self._part_done, sp)
                continue
            self.in_flight.add(fut)

            def done(f: asyncio.Future) -> None:  # every task of this tier's write has read its slots
                self.in_flight.discard(f)
                self._part_done(sp)

            fut.add_done_callback(done)

    def _part_done(self, sp: Spill) -> None:
        sp.pending -= 1
        if sp.pending <= 0:
            self._spilled(sp)

    def _spilled(self, sp: Spill) -> None:
        """The spill's bytes are read (written, or dropped): unstaged, its slots back to the pool."""
        for k, v in zip(sp.keys, sp.src, strict=True):
            if self.staged.get((sp.table, k)) is v:
                del self.staged[(sp.table, k)]
        sp.src = []
        self.copied_bytes -= sp.copied
        sp.copied = 0
        if sp.slots:
            slots, sp.slots = sp.slots, []
            self.index.deferral.release(sp.slot_bytes, slots)

    def forget(self, namespace: str) -> None:
        """A CLEAR of ``namespace`` ("" = all): its spills in flight serve no lookup any more."""
        self.staged = {k: v for k, v in self.staged.items() if namespace and k[0].namespace != namespace}


def views(buf: np.ndarray, slots: Sequence[int], size: int) -> list[memoryview]:
    """One memoryview per slot of the pool's buffer. Sliced from one view of the whole buffer: a slice of
    a memoryview is ~0.2 µs where ``memoryview(buf[a:b])`` (a numpy slice, then a view of it) is ~3 µs,
    a third of a 1,024-block promotion's loop time (bench/index_scale.py, disk hits). The parent view is
    local: the slices keep the pool's mapping exported only as long as they live."""
    mv = memoryview(buf)
    return [mv[s:s + size] for s in slots]
