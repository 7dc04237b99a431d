"""The disk (NVMe) tier: fixed-size slots in one file per block size, a compact persistent index beside it.

Layout of ``--disk-path``: ``LOCK`` (one daemon per directory), ``tables.json`` (table id -> namespace,
rank, world size and layout: kvoffd/cache/tiers/disktables.py), and per block size ``blocks-<bytes>.dat``
(slot ``i`` at ``i * stride``, ``stride`` = the block size rounded up to 4 KiB, the file sparse until
written) with ``index-<bytes>.kvx`` (:class:`~kvoffd.cache.tiers.diskindex.DiskIndex`, its space reserved
when made). ``--disk-size`` bounds each block size's file (a daemon serves one model, so one block size,
in the usual case).

Trust: the directory must be the daemon's user's (or root's) and writable by no one else, and is not a
symlink (kvoffd/runtime.py ``open_private_dir``; else the tier is disabled with the reason): whoever
can write there could plant blocks with matching checksums, or a symlink that makes the daemon write
over another file. Every file is opened under the directory's descriptor with O_NOFOLLOW and kept
0600. What the files say is checked as data, not trusted: a ``tables.json`` of the wrong shape, a
damaged index or a stray ``index-*.kvx.old`` costs the blocks it describes (a colder tier, one log
line), never the start, and a block is served only once its bytes match the checksum of its key and
data, verified on the I/O thread that read it (``diskio.read_blocks``).

The parts, each owning its state: ``TableIds`` (the tables, kvoffd/cache/tiers/disktables.py), one
``SizeClass`` per block size (its slots and the CLOCK that reuses them, kvoffd/cache/tiers/diskslots.py,
which also says how the ghost filter of ``--disk-policy clock2-ghost`` raises returning blocks) and
``DiskEvents`` (the KV events of medium DISK and the blocks found at start, kvoffd/cache/tiers/diskevents.py).
A record is removed before its slot is rewritten and inserted only after the write completed, so a
SIGKILL mid-spill leaves the old record gone and the new one absent, never a record naming half-written
bytes. Everything here runs on the loop thread except the functions of ``diskio``, run by ``IoPool``.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvoffd.cache.identity import MEDIUM_STORAGE
from kvoffd.cache.policy import DISK_POLICIES
from kvoffd.cache.tiers import diskio
from kvoffd.cache.tiers.base import Held, SpillResult, TableRef, TierStats
from kvoffd.cache.tiers.diskevents import Changed, DiskEvents
from kvoffd.cache.tiers.diskindex import FEW, KERNEL, DiskIndex, keys_u64
from kvoffd.cache.tiers.diskslots import GHOST_REF, NONE, SizeClass, close_files
from kvoffd.cache.tiers.disktables import TableIds
from kvoffd.cache.tiers.ghost import GhostFilter
from kvoffd.cache.tiers.iopool import READ, WRITE, IoPool
from kvoffd.runtime import open_private_dir

log = logging.getLogger(__name__)

TASK_BYTES = 8 << 20  # a batch is split into tasks of about this many bytes, spread over the threads
GHOST_SEGMENT = 1.0  # keys per filter segment, x the slots: a victim is remembered for 1-2 x slots evictions
DISK_THREADS = max(2, min(8, os.cpu_count() or 2))  # reads verify a crc32 each: the threads are also the checksum cores
INDEX_WAIT_S = 30.0  # a spill waits at most this long for its slots' old records to leave the index file
_KEY = 32
_INDEX_NAME = re.compile(r"index-([1-9][0-9]{0,11})\.kvx")


@dataclass
class _Batch:
    """One read or write call: its tasks complete in any order; the future resolves after the last."""

    fut: asyncio.Future
    left: int
    results: list = field(default_factory=list)


class DiskTier:
    name = "disk"
    medium = MEDIUM_STORAGE

    def __init__(self, path: str, size: int, threads: int = DISK_THREADS, policy: str = DISK_POLICIES[0]):
        if policy not in DISK_POLICIES:
            raise ValueError(f"disk policy {policy!r} is not one of {DISK_POLICIES}")
        self.path = path
        self.size = size
        self.policy = policy
        self._dir = open_private_dir(path, "--disk-path")  # every file below is opened under it
        try:
            self._lock = os.open("LOCK", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=self._dir)
        except OSError:
            os.close(self._dir)
            raise
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            os.close(self._dir)
            raise OSError(f"--disk-path {path} is in use by another kvoffd") from None
        self.st = TierStats(self.name, capacity_bytes=size)
        self._tables = TableIds(path, self._dir, self.st)
        self.events = DiskEvents(self._tables.refs)
        self._classes: dict[int, SizeClass] = {}
        self._broken: dict[int, str] = {}  # slot size -> why it cannot be opened
        self._index_locked: dict[int, str] = {}  # slot size -> "yes", or "no (why)" (DiskIndex.lock_in_memory)
        self._lock_warned = False
        self._io = IoPool(threads, "kvoffd-disk")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._direct_note = ""
        self._index_errors = 0  # of the index files' failed writes, those counted in ``st.io_errors``
        for f in sorted(os.listdir(self._dir)):  # the block sizes kept before a restart: found again at open
            m = _INDEX_NAME.fullmatch(f)
            if m:
                self._cls(int(m.group(1)))

    @property
    def changed(self) -> Changed | None:
        """Told of each record inserted and removed (KV events: ``DiskEvents``)."""
        return self.events.changed

    @changed.setter
    def changed(self, fn: Changed | None) -> None:
        self.events.changed = fn

    # --- size classes ---------------------------------------------------------------------------------
    def _cls(self, slot_bytes: int) -> SizeClass | None:
        c = self._classes.get(slot_bytes)
        if c is not None or slot_bytes in self._broken:
            return c
        stride = -(-slot_bytes // diskio.ALIGN) * diskio.ALIGN
        nslots = min(self.size // stride, int(NONE) - 1) if slot_bytes > 0 else 0  # slot numbers are 32-bit
        files = index = None
        try:
            if nslots < 1:
                raise OSError(f"--disk-size {self.size} holds no block of {slot_bytes} bytes")
            files, why = diskio.open_files(f"blocks-{slot_bytes}.dat", stride, self._dir)
            index = DiskIndex(nslots, f"index-{slot_bytes}.kvx", dir_fd=self._dir)
            if index.note:
                log.error("disk tier %s: %s", self.path, index.note)
            ghost = GhostFilter(int(nslots * GHOST_SEGMENT)) if self.policy == "clock2-ghost" else None
            c = SizeClass(slot_bytes, nslots, files, index, ghost, self.st, self.events.removing)
            kept, dropped = c.reopen(self._tables.known())
            if kept or dropped:
                log.info("disk tier: %d blocks of %d bytes found in %s (%d dropped)", kept, slot_bytes,
                         self.path, dropped)
        except Exception as e:  # a size class that cannot be opened is left out, never the tier or the daemon
            self.st.io_errors += 1
            self._broken[slot_bytes] = str(e)
            log.error("disk tier %s: blocks of %d bytes cannot be kept: %s", self.path, slot_bytes, e,
                      exc_info=not isinstance(e, OSError))
            if index is not None:
                index.close()
            if files is not None:
                close_files(files)
            return None
        if why and not self._direct_note:
            log.warning("disk tier %s: %s", self.path, why)  # once per tier
        self._direct_note = self._direct_note or why
        self._classes[slot_bytes] = c
        threading.Thread(target=self._lock_index, args=(slot_bytes, index), name="kvoffd-index-lock",
                         daemon=True).start()
        return c

    def _lock_index(self, slot_bytes: int, index: DiskIndex) -> None:
        """``DiskIndex.lock_in_memory`` in a thread (it reads every page of the index: seconds at 100M);
        the outcome goes to the tier's notes, a failure to the log once."""
        why = index.lock_in_memory()
        self._index_locked[slot_bytes] = f"no ({why})" if why else "yes"
        if why and not self._lock_warned:
            self._lock_warned = True
            log.warning("disk tier %s: its index is not locked in memory, %s: under memory pressure a LOOKUP "
                        "may wait for a page of it to be read back", self.path, why)

    # --- KV events (``DiskEvents``) -------------------------------------------------------------------
    def mark_reopened(self) -> None:
        self.events.mark_reopened(self._classes.values())

    def reopened_namespaces(self) -> set[str]:
        return self.events.reopened_namespaces()

    def take_reopened(self, namespace: str, n: int) -> tuple[bytes, bool]:
        return self.events.take_reopened(namespace, n)

    # --- the Tier interface -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._io.start(loop)

    def _held_by(self, ref: TableRef) -> tuple[SizeClass | None, int]:
        """The size class holding ``ref``'s blocks and its table id (None, 0: it holds none)."""
        tid = self._tables.tid(ref, create=False)
        return (self._cls(ref.slot_bytes) if tid else None), tid

    def _find(self, ref: TableRef, keys: bytes) -> tuple[SizeClass | None, int, np.ndarray]:
        c, tid = self._held_by(ref)
        if c is None:
            return None, 0, np.full(len(keys) // _KEY, -1, dtype=np.int64)
        if len(keys) <= FEW * _KEY:  # the usual miss: one key, no numpy until the answer
            return c, tid, np.array(c.index.find(tid, keys), dtype=np.int64)
        return c, tid, c.index.lookup(tid, keys_u64(keys))

    def contains(self, table: TableRef, keys: bytes, touch: bool = False) -> np.ndarray:
        c, _, pos = self._find(table, keys)
        found = pos >= 0
        if touch and c is not None and found.any():  # used again above: CLOCK keeps it longer
            c.used_again(c.index.recs["slot"][pos[found]])
        return found

    def probe(self, table: TableRef, keys: bytes) -> int:
        c, tid = self._held_by(table)
        return c.index.probe(tid, keys) if c is not None else 0

    def read(self, table: TableRef, keys: bytes, dest: Sequence[memoryview]) -> asyncio.Future:
        fut = self._loop.create_future()
        c, _, pos = self._find(table, keys)
        n = len(pos)
        found = np.flatnonzero(pos >= 0)
        gone = n - len(found)
        if gone:  # removed since the caller's ``contains`` (a CLEAR; never the tier's own eviction)
            self.st.promotion_failures += gone
            log.warning("disk tier: %d of %d blocks to read are no longer held", gone, n)
        if not found.size:
            fut.set_result(np.zeros(n, dtype=bool))
            return fut
        recs = c.index.recs
        at = pos[found]
        slots = recs["slot"][at].astype(np.int64)
        if gone:
            blocks = diskio.Blocks(slots.tolist(), keys_u64(keys)[found].tobytes(), [dest[i] for i in found.tolist()],
                                   found.tolist(), recs["crc"][at].tolist())
        else:  # the usual case: every block still held, in order
            blocks = diskio.Blocks(slots.tolist(), keys, list(dest), list(range(n)), recs["crc"][at].tolist())
        c.busy[slots] += 1  # distinct keys, distinct records, distinct slots
        c.used_again(slots)  # a use: CLOCK keeps it longer
        tasks = blocks.split(_per_task(c.slot_bytes))
        batch = _Batch(fut, len(tasks))
        for part in tasks:
            self._io.submit(READ, lambda p=part: diskio.read_blocks(c.files, p),
                            lambda res, p=part: self._read_done(c, batch, n, p, res))
        return fut

    def _read_done(self, c: SizeClass, batch: _Batch, n: int, part: diskio.Blocks, res) -> None:
        """One task of a read landed. The future resolves once all have (never before: a task still
        running writes into its destination), whatever the bookkeeping raises (then those blocks fail)."""
        try:
            oks = self._read_landed(c, part, res)
        except Exception:
            log.exception("disk tier: a read's bookkeeping failed; its %d blocks are misses", len(part))
            oks = [False] * len(part)
        batch.results.append((part, oks))
        batch.left -= 1
        if batch.left:
            return
        out = np.zeros(n, dtype=bool)
        for p, ok in batch.results:
            out[p.at] = ok
        self.st.promotions += int(out.sum())
        self.st.promotion_failures += sum(len(p) for p, _ in batch.results) - int(out.sum())
        if not batch.fut.done():
            batch.fut.set_result(out)

    def _read_landed(self, c: SizeClass, part: diskio.Blocks, res) -> list[bool]:
        if isinstance(res, Exception):
            res = diskio.ReadResult(ok=[False] * len(part), io_errors=len(part), first_error=str(res))
        c.busy[np.array(part.slots, dtype=np.int64)] -= 1
        st = self.st
        st.read_bytes += res.nbytes
        st.io_errors += res.io_errors
        st.checksum_failures += res.checksum_failures
        if res.first_error or res.checksum_failures:
            log.warning("disk tier: %s%d blocks failed their checksum (%d blocks of this batch are misses)",
                        res.first_error + "; " if res.first_error else "", res.checksum_failures,
                        res.ok.count(False))
        bad = [j for j, ok in enumerate(res.ok) if not ok]
        if bad:  # never served again: forget the records that still name these bytes
            c.forget_slots([part.slots[j] for j in bad], [part.crcs[j] for j in bad])
        return res.ok

    def write(self, table: TableRef, keys: bytes, src: Sequence[memoryview],
              sums: Sequence[int] | None = None) -> asyncio.Future:  # sums: unused (records hold a crc32)
        fut = self._loop.create_future()
        n = len(keys) // _KEY
        out = [SpillResult.ERROR] * n
        tid = self._tables.tid(table, create=True)
        c = self._cls(table.slot_bytes)
        if c is None:
            self._count_spills(out)
            fut.set_result(out)
            return fut
        pos = c.index.lookup(tid, keys_u64(keys))
        todo = np.flatnonzero(pos < 0).tolist()
        for i in np.flatnonzero(pos >= 0).tolist():
            out[i] = SpillResult.PRESENT
        slots = c.alloc(len(todo))
        for i in todo[len(slots):]:
            out[i] = SpillResult.FULL
        if c.ghost is not None and len(slots):  # evicted lately and back: reused, so it starts higher
            back = c.ghost.contains(keys_u64(keys)[todo[:len(slots)]])
            c.ref[slots[back]] = GHOST_REF
        if not len(slots):
            self._count_spills(out)
            fut.set_result(out)
            return fut
        todo = todo[:len(slots)]
        if len(todo) == n:  # the usual spill: none held already, a slot for each
            blocks = diskio.Blocks(slots.tolist(), keys, list(src), todo)
        else:
            blocks = diskio.Blocks(slots.tolist(), keys_u64(keys)[todo].tobytes(), [src[i] for i in todo], todo)
        tasks = blocks.split(_per_task(c.slot_bytes))
        batch = _Batch(fut, len(tasks), results=[out, tid, self._tables.generation(tid)])
        mark = c.index.mark()  # the evicted slots' records removed above: out in the file before their bytes change

        def ready() -> bool:
            return c.index.wait(mark, INDEX_WAIT_S)

        for part in tasks:
            self._io.submit(WRITE, lambda p=part: diskio.write_blocks(c.files, p, ready),
                            lambda res, p=part: self._write_done(c, batch, p, res))
        return fut

    def _write_done(self, c: SizeClass, batch: _Batch, part: diskio.Blocks, res) -> None:
        """One task of a spill landed. The future resolves once all have (never before: a task still
        running reads its source slots), whatever the bookkeeping raises (then those blocks are dropped)."""
        out = batch.results[0]
        try:
            self._write_landed(c, batch, part, res)
        except Exception:
            log.exception("disk tier: a spill's bookkeeping failed; its %d blocks are dropped", len(part))
            for i in part.at:
                if out[i] is SpillResult.WRITTEN:
                    out[i] = SpillResult.ERROR
        batch.left -= 1
        if not batch.left:
            self._count_spills(out)
            if not batch.fut.done():
                batch.fut.set_result(out)

    def _write_landed(self, c: SizeClass, batch: _Batch, part: diskio.Blocks, res) -> None:
        out, tid, gen = batch.results
        if isinstance(res, Exception):
            res = diskio.WriteResult(crcs=[0] * len(part), ok=[False] * len(part), full=[False] * len(part),
                                     io_errors=len(part), first_error=str(res))
        slots = np.array(part.slots, dtype=np.int64)
        c.landed(slots, any(res.full))
        self.st.write_bytes += res.nbytes
        self.st.io_errors += res.io_errors
        if res.first_error:
            log.warning("disk tier: %s (%d blocks of this spill dropped)", res.first_error, res.ok.count(False))
        ok = np.array(res.ok, dtype=bool)
        for i, good, full in zip(part.at, res.ok, res.full, strict=True):
            out[i] = SpillResult.WRITTEN if good else SpillResult.FULL if full else SpillResult.ERROR
        if ok.any() and self._tables.generation(tid) == gen:  # not cleared meanwhile
            k = keys_u64(part.keys)[ok]
            present = c.index.lookup(tid, k) >= 0  # the same key spilled twice at once: keep the first
            written = np.flatnonzero(ok)
            for j in written[present].tolist():
                out[part.at[j]] = SpillResult.PRESENT
            keep = ~present
            pos = c.index.insert(tid, k[keep], slots[ok][keep].astype(np.uint32),
                                 np.array(res.crcs, dtype=np.uint32)[ok][keep])
            placed = pos >= 0  # both of a key's buckets full (about never): that block is not kept
            c.owner[slots[ok][keep][placed]] = pos[placed]
            if placed.any():
                self.events.tell(c, pos[placed], removed=False)
            for j in written[keep][~placed].tolist():
                out[part.at[j]] = SpillResult.FULL

    def _count_spills(self, out: list[SpillResult]) -> None:
        for r in out:
            if r is SpillResult.WRITTEN:
                self.st.spills += 1
            elif r is not SpillResult.PRESENT:
                self.st.spills_dropped[r.value] = self.st.spills_dropped.get(r.value, 0) + 1

    def remove(self, table: TableRef, keys: bytes) -> None:
        c, _, pos = self._find(table, keys)
        pos = pos[pos >= 0]
        if c is not None and len(pos):
            c.drop(pos)

    def clear(self, namespace: str) -> int:
        tids = self._tables.of_namespace(namespace)
        self._tables.cleared(tids)
        removed = 0
        for c in self._classes.values():
            if not any(t in c.index.by_table for t in tids):
                continue  # holds none of them: no scan of its records
            pos = c.index.live()
            pos = pos[np.isin(c.index.recs["tid"][pos], np.array(tids, dtype=np.uint32))]
            removed += len(pos)
            c.owner[c.index.recs["slot"][pos].astype(np.int64)] = NONE
            if namespace:  # a CLEAR of all is one AllBlocksCleared on the stream: no removal per block
                self.events.removing(c, pos)
            else:
                self.events.unmark(c, pos)
            c.index.remove(pos)
        return removed

    def namespace_blocks(self) -> dict[str, Held]:
        """What each namespace has here, from the tables' live counts (no scan of the records)."""
        out: dict[str, Held] = {}
        for c in self._classes.values():
            for tid, n in c.index.by_table.items():
                ref = self._tables.refs.get(tid)
                if ref is None:
                    continue  # (records of unknown tables are dropped at open: none are live)
                h = out.setdefault(ref.namespace, Held(world_size=ref.world_size))
                h.blocks += n
                h.bytes += n * c.slot_bytes
                h.ranks.add(ref.rank)
        return out

    def stats(self) -> TierStats:
        st = self.st
        index_errors = sum(c.index.write_errors for c in self._classes.values())
        st.io_errors += index_errors - self._index_errors  # the index files' failed writes (their own thread)
        self._index_errors = index_errors
        st.resident_blocks = sum(c.index.used for c in self._classes.values())
        st.resident_bytes = sum(c.index.used * c.slot_bytes for c in self._classes.values())
        st.index_bytes = sum(c.index.memory_bytes + c.nslots * 7 + (c.ghost.nbytes if c.ghost else 0)
                             for c in self._classes.values())
        st.notes = {"path": self.path, "policy": self.policy, "index_kernel": KERNEL,
                    "direct_io": "off: " + self._direct_note if self._direct_note else "on"}
        st.notes.update({f"broken_{k}": v for k, v in self._broken.items()})
        st.notes.update({f"index_locked_{k}": v for k, v in self._index_locked.items()})
        return st

    def close(self) -> None:
        self._io.close()
        for c in self._classes.values():
            try:
                c.index.flush()
            except OSError as e:
                log.error("disk tier: cannot flush the index of %d-byte blocks: %s", c.slot_bytes, e)
            c.close()
        os.close(self._lock)
        os.close(self._dir)


def _per_task(slot_bytes: int) -> int:
    """Blocks per I/O task: about TASK_BYTES, so that the threads share a big batch."""
    return max(1, TASK_BYTES // max(slot_bytes, 1))
