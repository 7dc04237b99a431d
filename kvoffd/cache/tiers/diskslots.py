"""One block size of the disk tier: its slots, their owners, and the CLOCK that hands them out.

Slots are reused by CLOCK with a 2-bit count (raised by each read and each re-spill, lowered by each
pass of the hand): a block found again n times survives n more sweeps (up to ``REF_MAX``). With the
ghost filter (``--disk-policy clock2-ghost``) the hand's victims are remembered and a block spilled
again while remembered starts at ``GHOST_REF`` instead of 0 (bench/tier_sim.py, docs/benchmarks.md). A
slot being read or written is never handed out (``busy``), and a record is removed before its slot is
rewritten. Loop thread only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from kvoffd.cache.tiers import diskio
from kvoffd.cache.tiers.base import TierStats
from kvoffd.cache.tiers.diskindex import DiskIndex
from kvoffd.cache.tiers.ghost import GhostFilter

NONE = np.uint32(0xFFFFFFFF)
REF_MAX = 3  # CLOCK with a 2-bit count: 77.5% vs 75.7% of unbounded for 1 bit (simulated, conversation trace)
GHOST_REF = 2  # the count a returning block starts at (simulated with an exact ghost: 79.0% at 2, 79.4% at 3 = the cap)
#: after a spill into a never-written slot found the file system full: this long, slots are taken only
#: from blocks already on disk (their space is allocated), then free ones are tried again
DISK_FULL_RETRY_S = 10.0

#: records at these positions of this class's index are about to be removed (KV events, marks)
Removing = Callable[["SizeClass", np.ndarray], None]


class SizeClass:
    """The slots of one block size: ``files`` (the data), ``index`` (their records), which record owns
    each slot, the CLOCK counts and hand, and what is in flight."""

    def __init__(self, slot_bytes: int, nslots: int, files: diskio.Files, index: DiskIndex,
                 ghost: GhostFilter | None, st: TierStats, removing: Removing):
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self.files = files
        self.index = index
        self.ghost = ghost  # the hand's recent victims (clock2-ghost)
        self._st = st  # the hand's evictions are counted here
        self._removing = removing
        self.owner = np.full(nslots, NONE, dtype=np.uint32)  # slot -> record position (NONE: free)
        self.ref = np.zeros(nslots, dtype=np.uint8)  # CLOCK counts (0..REF_MAX)
        self.busy = np.zeros(nslots, dtype=np.uint16)  # reads and writes in flight per slot
        self.hand = 0
        self.writing = 0  # slots handed out to spills that have not landed (no record yet)
        self.free_hand = 0  # where the search for free slots goes on
        self.full_until = 0.0  # the file system was full (monotonic): reuse occupied slots only until then

    def reopen(self, known: np.ndarray) -> tuple[int, int]:
        """The records found at start: each live one owns its slot; records of unknown tables (not in
        ``known``), slots past the file's new size and slots claimed twice are dropped (their blocks
        become misses). Returns (kept, dropped)."""
        t = self.index
        pos = t.live()
        slots = t.recs["slot"][pos].astype(np.int64)
        ok = np.isin(t.recs["tid"][pos], known) & (slots < self.nslots)
        uniq, counts = np.unique(slots[ok], return_counts=True)
        ok &= ~np.isin(slots, uniq[counts > 1])
        t.remove(pos[~ok])
        self.owner[slots[ok]] = pos[ok]
        self.ref[slots[ok]] = 1  # they earned their place before the restart: not the hand's first victims
        return int(ok.sum()), int((~ok).sum())

    def used_again(self, slots: np.ndarray) -> None:
        """A use (a read, a touch): CLOCK keeps these longer."""
        self.ref[slots] = np.minimum(self.ref[slots], REF_MAX - 1) + 1

    def drop(self, pos: np.ndarray) -> None:
        """The records at ``pos`` go (told first), their slots free."""
        slots = self.index.recs["slot"][pos].astype(np.int64)
        self._removing(self, pos)
        self.index.remove(pos)
        self.owner[slots] = NONE

    def forget_slots(self, slots: list[int], crcs: list[int]) -> None:
        """Reads of these slots failed: the records that still name those bytes (same checksum) go."""
        s = np.array(slots, dtype=np.int64)
        own = self.owner[s]
        live = own != NONE
        pos = own[live].astype(np.int64)
        same = self.index.recs["crc"][pos] == np.array(crcs, dtype=np.uint32)[live]
        self._removing(self, pos[same])
        self.index.remove(pos[same])
        self.owner[s[live][same]] = NONE

    def alloc(self, k: int) -> np.ndarray:
        """Up to ``k`` slots: free ones first, then by CLOCK, ones whose count the hand has worn down to
        0 (its record removed here, before the slot is rewritten). Busy slots are skipped; the slots
        returned are busy (the caller's write) until it lands. No block is evicted while a slot is free:
        a reopened tier's hand and counts start over, and taking victims before free slots would throw
        away the blocks found at start. While the file system is full (``full_until``) only occupied
        slots are taken: a free slot may be a hole the disk has no room for, an occupied one has its
        space already."""
        reuse_only = time.monotonic() < self.full_until
        got = [self._take_free(0 if reuse_only else min(k, self.nslots - self.index.used - self.writing))]
        need, scanned = k - len(got[0]), 0
        # Each pass lowers every count it crosses, so within REF_MAX + 1 passes any slot not busy is
        # taken: fewer passes would drop spills as "full" while every block held a count of 2 or 3 (a
        # dropped head loses its whole chain's disk hits). The step grows with what was scanned in vain,
        # so even that worst case is a few dozen numpy steps per pass, not nslots / 1,024.
        while need and scanned < (REF_MAX + 1) * self.nslots + 1:
            lo = self.hand
            hi = min(self.nslots, lo + max(need * 4, 1024, scanned))
            idx = np.arange(lo, hi)
            occupied = self.owner[lo:hi] != NONE
            ok = (self.busy[lo:hi] == 0) & ((self.ref[lo:hi] == 0) & occupied if reuse_only else
                                            ~occupied | (self.ref[lo:hi] == 0))
            sel = idx[ok][:need]
            end = int(sel[-1]) + 1 if len(sel) == need else hi
            passed = self.ref[lo:end]
            passed -= passed > 0  # one chance spent per pass (a block asked for n times survives n passes)
            self.busy[sel] += 1  # taken: a sweep that wraps around must not hand them out twice
            self.ref[sel] = 0  # the new block starts unreferenced
            ev = sel[self.owner[sel] != NONE]
            if len(ev):
                if self.ghost is not None:
                    self.ghost.add(self.index.recs["k"][self.owner[ev].astype(np.int64)])
                self._removing(self, self.owner[ev].astype(np.int64))
                self.index.remove(self.owner[ev].astype(np.int64))
                self.owner[ev] = NONE
                self._st.evictions += len(ev)
            got.append(sel)
            need -= len(sel)
            scanned += end - lo
            self.hand = end % self.nslots
        out = np.concatenate(got)
        self.writing += len(out)
        return out

    def _take_free(self, n: int) -> np.ndarray:
        """Up to ``n`` slots no record owns and no read or write holds, searched from where the last
        search stopped (``n``: how many the counts say are free; a slot being read when its record went
        is counted but skipped, so the search ends after one lap)."""
        got: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        scanned, h = 0, self.free_hand
        while n > 0 and scanned < self.nslots:
            hi = min(self.nslots, h + max(n * 4, 4096))
            sel = (np.flatnonzero((self.owner[h:hi] == NONE) & (self.busy[h:hi] == 0)) + h)[:n]
            self.busy[sel] += 1
            self.ref[sel] = 0
            got.append(sel)
            n -= len(sel)
            scanned += hi - h
            h = int(sel[-1]) + 1 if n == 0 and len(sel) else hi
            h %= self.nslots
        self.free_hand = h
        return np.concatenate(got)

    def landed(self, slots: np.ndarray, full: bool) -> None:
        """A write task of these slots landed (``full``: the file system had no room for some)."""
        self.busy[slots] -= 1
        self.writing -= len(slots)
        if full:
            self.full_until = time.monotonic() + DISK_FULL_RETRY_S

    def close(self) -> None:
        self.index.close()
        close_files(self.files)


def close_files(files: diskio.Files) -> None:
    os.close(files.fd)
    if files.dfd >= 0:
        os.close(files.dfd)
