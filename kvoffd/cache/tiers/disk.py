"""The disk (NVMe) tier: fixed-size slots in one file per block size, a compact persistent index beside it.

Layout of ``--disk-path``: ``LOCK`` (one daemon per directory), ``tables.json`` (table id -> namespace,
rank, world size and layout), and per block size ``blocks-<bytes>.dat`` (slot ``i`` at ``i * stride``,
``stride`` = the block size rounded up to 4 KiB, the file sparse until written) with
``index-<bytes>.kvx`` (:class:`~kvoffd.cache.tiers.table.BlockTable`, its space reserved when made).
``--disk-size`` bounds each block size's file (a daemon serves one model, so one block size, in the
usual case).

Trust: the directory must be the daemon's user's (or root's) and writable by no one else, and is not a
symlink (kvoffd/runtime.py ``open_private_dir``; else the tier is disabled with the reason): whoever
can write there could plant blocks with matching checksums, or a symlink that makes the daemon write
over another file. Every file is opened under the directory's descriptor with O_NOFOLLOW and kept
0600. What the files say is checked as data, not trusted: a ``tables.json`` of the wrong shape, a
damaged index or a stray ``index-*.kvx.old`` costs the blocks it describes (a colder tier, one log
line), never the start, and a block is served only once its bytes match the checksum of its key and
data, verified on the I/O thread that read it (``diskio.read_blocks``).

Slots are reused by CLOCK with a 2-bit count (raised by each read and each re-spill, lowered by each
pass of the hand): a block found again n times survives n more sweeps (up to 3). With ``--disk-policy
clock2-ghost`` (the default) the hand's victims are remembered in a ghost filter
(kvoffd/cache/tiers/ghost.py) and a block spilled again while remembered starts at count 2 instead of
0: it came back, so it is reused (bench/tier_sim.py, docs/benchmarks.md: 79.0% vs 77.4% of the
unbounded hit ratio simulated, pool of 2,000 + disk of 16,000, conversation trace). A slot being read or written is never handed out, and a
record is removed before its slot is rewritten and inserted only after the write completed — so a
SIGKILL mid-spill leaves the old record gone and the new one absent, never a record naming half-written
bytes. Everything here runs on the loop thread except the functions of ``diskio``, run by ``IoPool``.

KV events (medium DISK): ``changed`` (set by kvoffd/cache/tiers/manager.py when the daemon publishes
events) hears of every record inserted (a spill written) and every record removed (evicted by the
hand, forgotten after a failed read, removed, cleared by namespace; a CLEAR of all is one
``AllBlocksCleared`` already), with the keys, on the loop. The blocks found at start are the tier's
own to announce, since no spill of this daemon wrote them: ``mark_reopened`` marks their records, and
``take_reopened`` hands them out a slice at a time (kvoffd/events/announce.py), each only while its
record is still the one found at start (a removal clears its mark), and once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvoffd.cache.identity import MEDIUM_STORAGE
from kvoffd.cache.policy import DISK_POLICIES
from kvoffd.cache.tiers import diskio
from kvoffd.cache.tiers.base import Held, SpillResult, TableRef, TierStats
from kvoffd.cache.tiers.ghost import GhostFilter
from kvoffd.cache.tiers.iopool import READ, WRITE, IoPool
from kvoffd.cache.tiers.table import FEW, KERNEL, BlockTable, keys_u64
from kvoffd.runtime import open_private_dir

log = logging.getLogger(__name__)

NONE = np.uint32(0xFFFFFFFF)
TASK_BYTES = 8 << 20  # a batch is split into tasks of about this many bytes, spread over the threads
REF_MAX = 3  # CLOCK with a 2-bit count: 77.5% vs 75.7% of unbounded for 1 bit (simulated, conversation trace)
GHOST_REF = 2  # the count a returning block starts at (simulated with an exact ghost: 79.0% at 2, 79.4% at 3 = the cap)
GHOST_SEGMENT = 1.0  # keys per filter segment, x the slots: a victim is remembered for 1-2 x slots evictions
DISK_THREADS = max(2, min(8, os.cpu_count() or 2))  # reads verify a crc32 each: the threads are also the checksum cores
#: after a spill into a never-written slot found the file system full: this long, slots are taken only
#: from blocks already on disk (their space is allocated), then free ones are tried again
DISK_FULL_RETRY_S = 10.0
INDEX_WAIT_S = 30.0  # a spill waits at most this long for its slots' old records to leave the index file
MAX_TID = 0xFFFFFFFF  # table ids are 32-bit in the index (0: an empty record)
_KEY = 32
_INDEX_NAME = re.compile(r"index-([1-9][0-9]{0,11})\.kvx")


@dataclass
class _SizeClass:
    slot_bytes: int
    nslots: int
    files: diskio.Files
    table: BlockTable
    owner: np.ndarray  # slot -> record position (NONE: free)
    ref: np.ndarray  # CLOCK counts (0..REF_MAX)
    busy: np.ndarray  # reads and writes in flight per slot: never handed out meanwhile
    ghost: GhostFilter | None = None  # the hand's recent victims (clock2-ghost)
    hand: int = 0
    reopened: np.ndarray | None = None  # record position -> found at start, not yet announced nor removed
    writing: int = 0  # slots handed out to spills that have not landed (no record yet)
    free_hand: int = 0  # where the search for free slots goes on
    full_until: float = 0.0  # the file system was full (monotonic): reuse occupied slots only until then


@dataclass
class _Batch:
    """One read or write call: its tasks complete in any order; the future resolves after the last."""

    fut: asyncio.Future
    left: int
    results: list = field(default_factory=list)


#: a tier's blocks changed: (table, keys stored, keys removed), keys concatenated (32 bytes each)
Changed = Callable[[TableRef, bytes, bytes], None]


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
        self._tids: dict[TableRef, int] = {}
        self._refs: dict[int, TableRef] = {}  # tid -> its table
        self._namespaces: dict[int, str] = {}
        self.changed: Changed | None = None  # KV events (see the module doc)
        self._reopened: dict[str, list[tuple[_SizeClass, np.ndarray]]] = {}  # namespace -> rank 0's, found at start
        self._gen: dict[int, int] = {}  # tid -> CLEAR generation (a spill that straddles a CLEAR is dropped)
        self._load_tables()
        self._classes: dict[int, _SizeClass] = {}
        self._broken: dict[int, str] = {}  # slot size -> why it cannot be opened
        self._index_locked: dict[int, str] = {}  # slot size -> "yes", or "no (why)" (BlockTable.lock_in_memory)
        self._lock_warned = False
        self._io = IoPool(threads, "kvoffd-disk")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.st = TierStats(self.name, capacity_bytes=size)
        self._direct_note = ""
        self._index_errors = 0  # of the index files' failed writes, those counted in ``st.io_errors``
        for f in sorted(os.listdir(self._dir)):  # the block sizes kept before a restart: found again now
            m = _INDEX_NAME.fullmatch(f)
            if m:
                self._cls(int(m.group(1)))

    # --- tables and size classes ------------------------------------------------------------------
    def _load_tables(self) -> None:
        """The tables of ``tables.json``. What is not a table of the right shape is left out (its blocks
        are then dropped as unknown: a colder tier), with one log line, never an error at start."""
        p = os.path.join(self.path, "tables.json")
        try:
            fd = os.open("tables.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir)
            with os.fdopen(fd, "rb") as f:
                doc = json.loads(f.read(64 << 20))
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as e:
            log.error("disk tier: %s unreadable (%s): its blocks are not served", p, e)
            return
        rows = doc.get("tables") if isinstance(doc, dict) else None
        if not isinstance(rows, list):
            log.error("disk tier: %s is not {\"tables\": [...]}: its blocks are not served", p)
            return
        parsed = [_table_row(r) for r in rows]
        ids = [g[0] for g in parsed if g is not None]
        twice = {t for t in ids if ids.count(t) > 1} if len(set(ids)) < len(ids) else set()
        refs: dict[int, TableRef] = {}
        for got in parsed:  # a table id said twice: none of its rows can be trusted
            if got is not None and got[0] not in twice and got[1] not in refs.values():
                refs[got[0]] = got[1]
        bad = len(rows) - len(refs)
        if bad:
            log.error("disk tier: %s: %d of %d tables are not of the right shape or repeat another; their "
                      "blocks are not served", p, bad, len(rows))
        for tid, ref in refs.items():
            self._tids[ref] = tid
            self._refs[tid] = ref
            self._namespaces[tid] = ref.namespace

    def _save_tables(self) -> None:
        rows = [{"tid": t, "namespace": r.namespace, "rank": r.rank, "world_size": r.world_size,
                 "layout": list(r.layout)} for r, t in self._tids.items()]
        p = os.path.join(self.path, "tables.json")
        try:
            with contextlib.suppress(FileNotFoundError):  # a leftover (or anything else by that name) goes
                os.unlink("tables.json.tmp", dir_fd=self._dir)
            fd = os.open("tables.json.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=self._dir)
            with os.fdopen(fd, "w") as f:
                json.dump({"tables": rows}, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename("tables.json.tmp", "tables.json", src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError as e:  # the table works until the restart; its blocks are then not found
            self.st.io_errors += 1
            log.error("disk tier: cannot save %s: %s", p, e)

    def _tid(self, ref: TableRef, create: bool) -> int:
        tid = self._tids.get(ref)
        if tid is None and create:
            tid = max(self._refs, default=0) + 1
            if tid > MAX_TID:  # ids are never reused while known, so this takes a free one below
                tid = next(t for t in itertools.count(1) if t not in self._refs)
            self._tids[ref] = tid
            self._refs[tid] = ref
            self._namespaces[tid] = ref.namespace
            self._save_tables()
        return tid or 0

    def _cls(self, slot_bytes: int) -> _SizeClass | None:
        c = self._classes.get(slot_bytes)
        if c is not None or slot_bytes in self._broken:
            return c
        stride = -(-slot_bytes // diskio.ALIGN) * diskio.ALIGN
        nslots = min(self.size // stride, int(NONE) - 1) if slot_bytes > 0 else 0  # slot numbers are 32-bit
        files = table = None
        try:
            if nslots < 1:
                raise OSError(f"--disk-size {self.size} holds no block of {slot_bytes} bytes")
            files, why = diskio.open_files(f"blocks-{slot_bytes}.dat", stride, self._dir)
            table = BlockTable(nslots, f"index-{slot_bytes}.kvx", dir_fd=self._dir)
            if table.note:
                log.error("disk tier %s: %s", self.path, table.note)
            ghost = GhostFilter(int(nslots * GHOST_SEGMENT)) if self.policy == "clock2-ghost" else None
            c = _SizeClass(slot_bytes, nslots, files, table, np.full(nslots, NONE, dtype=np.uint32),
                           np.zeros(nslots, dtype=np.uint8), np.zeros(nslots, dtype=np.uint16), ghost)
            self._adopt(c)
        except Exception as e:  # a size class that cannot be opened is left out, never the tier or the daemon
            self.st.io_errors += 1
            self._broken[slot_bytes] = str(e)
            log.error("disk tier %s: blocks of %d bytes cannot be kept: %s", self.path, slot_bytes, e,
                      exc_info=not isinstance(e, OSError))
            if table is not None:
                table.close()
            if files is not None:
                _close_files(files)
            return None
        if why and not self._direct_note:
            log.warning("disk tier %s: %s", self.path, why)  # once per tier
        self._direct_note = self._direct_note or why
        self._classes[slot_bytes] = c
        threading.Thread(target=self._lock_index, args=(slot_bytes, table), name="kvoffd-index-lock",
                         daemon=True).start()
        return c

    def _lock_index(self, slot_bytes: int, table: BlockTable) -> None:
        """``BlockTable.lock_in_memory`` in a thread (it reads every page of the index: seconds at 100M);
        the outcome goes to the tier's notes, a failure to the log once."""
        why = table.lock_in_memory()
        self._index_locked[slot_bytes] = f"no ({why})" if why else "yes"
        if why and not self._lock_warned:
            self._lock_warned = True
            log.warning("disk tier %s: its index is not locked in memory, %s: under memory pressure a LOOKUP "
                        "may wait for a page of it to be read back", self.path, why)

    def _adopt(self, c: _SizeClass) -> None:
        """The records found at start: each live one owns its slot; records of unknown tables, slots
        past the file's new size and slots claimed twice are dropped (their blocks become misses)."""
        t = c.table
        pos = t.live()
        slots = t.recs["slot"][pos].astype(np.int64)
        known = np.isin(t.recs["tid"][pos], np.fromiter(self._namespaces, dtype=np.uint32))
        ok = known & (slots < c.nslots)
        uniq, counts = np.unique(slots[ok], return_counts=True)
        ok &= ~np.isin(slots, uniq[counts > 1])
        t.remove(pos[~ok])
        c.owner[slots[ok]] = pos[ok]
        c.ref[slots[ok]] = 1  # they earned their place before the restart: not the hand's first victims
        if len(pos):
            log.info("disk tier: %d blocks of %d bytes found in %s (%d dropped)", int(ok.sum()), c.slot_bytes,
                     self.path, int((~ok).sum()))

    # --- KV events ------------------------------------------------------------------------------------
    def mark_reopened(self) -> None:
        """Mark the rank-0 blocks found at start, to be announced (``take_reopened``). Called once, by
        ``Tiers.publish`` before the daemon serves (nothing changed since the index was opened), and only
        when the daemon publishes events: otherwise the marks would cost memory for nothing."""
        for c in self._classes.values():
            self._mark(c, c.table.live())

    def _mark(self, c: _SizeClass, pos: np.ndarray) -> None:
        """Rank 0's records at ``pos``, by namespace (positions as uint32: 4 bytes a block, plus a byte a
        record for the marks, freed once all are handed out). O(records x namespaces), no sort: the
        daemon is about to serve."""
        if not len(pos) or not self._refs:
            return
        names = sorted({r.namespace for r in self._refs.values() if r.rank == 0})
        ns_of = np.full(max(self._refs) + 1, -1, dtype=np.int32)  # tid -> namespace number (-1: not rank 0)
        for tid, r in self._refs.items():
            if r.rank == 0:
                ns_of[tid] = names.index(r.namespace)
        tids = c.table.recs["tid"][pos].astype(np.int64)
        of = np.where(tids < len(ns_of), ns_of[np.minimum(tids, len(ns_of) - 1)], -1)
        for k, name in enumerate(names):
            mine = pos[of == k].astype(np.uint32)
            if not len(mine):
                continue
            if c.reopened is None:
                c.reopened = np.zeros(c.table.cap, dtype=bool)
            c.reopened[mine] = True
            self._reopened.setdefault(name, []).append((c, mine))

    def reopened_namespaces(self) -> set[str]:
        return set(self._reopened)

    def take_reopened(self, namespace: str, n: int) -> tuple[bytes, bool]:
        """Up to ``n`` of ``namespace``'s rank-0 blocks found at start, still held by the same record and
        not handed out before (keys concatenated; fewer, or none, when some went since), and whether
        more remain. Looks at ``n`` positions at most: O(n) per call whatever the tier's size."""
        parts = self._reopened.get(namespace)
        if not parts:
            self._reopened.pop(namespace, None)
            return b"", False
        c, pos = parts[0]
        take, rest = pos[:n], pos[n:]
        if len(rest):
            parts[0] = (c, rest)
        else:
            parts.pop(0)
        live = take[c.reopened[take]]
        c.reopened[live] = False
        out = c.table.recs["k"][live].tobytes()
        more = bool(parts)
        if not more:
            self._reopened.pop(namespace, None)
            if not any(c is c2 for ps in self._reopened.values() for c2, _ in ps):
                c.reopened = None  # every mark of this class handed out
        return out, more

    def _removing(self, c: _SizeClass, pos: np.ndarray) -> None:
        """Records at ``pos`` are about to be removed: told (their keys, by table), unmarked."""
        if not len(pos):
            return
        if c.reopened is not None:
            c.reopened[pos] = False
        if self.changed is not None:
            self._tell(c, pos, removed=True)

    def _tell(self, c: _SizeClass, pos: np.ndarray, removed: bool) -> None:
        tids = c.table.recs["tid"][pos]
        keys = c.table.recs["k"][pos]
        for tid in np.unique(tids).tolist():
            ref = self._refs.get(tid)
            if ref is not None:
                k = keys[tids == tid].tobytes()
                if removed:
                    self.changed(ref, b"", k)
                else:
                    self.changed(ref, k, b"")

    # --- the Tier interface -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._io.start(loop)

    def _held_by(self, ref: TableRef) -> tuple[_SizeClass | None, int]:
        """The size class holding ``ref``'s blocks and its table id (None, 0: it holds none)."""
        tid = self._tid(ref, create=False)
        return (self._cls(ref.slot_bytes) if tid else None), tid

    def _find(self, ref: TableRef, keys: bytes) -> tuple[_SizeClass | None, int, np.ndarray]:
        c, tid = self._held_by(ref)
        if c is None:
            return None, 0, np.full(len(keys) // _KEY, -1, dtype=np.int64)
        if len(keys) <= FEW * _KEY:  # the usual miss: one key, no numpy until the answer
            return c, tid, np.array(c.table.find(tid, keys), dtype=np.int64)
        return c, tid, c.table.lookup(tid, keys_u64(keys))

    def contains(self, table: TableRef, keys: bytes, touch: bool = False) -> np.ndarray:
        c, _, pos = self._find(table, keys)
        found = pos >= 0
        if touch and c is not None and found.any():  # used again above: CLOCK keeps it longer
            s = c.table.recs["slot"][pos[found]]
            c.ref[s] = np.minimum(c.ref[s], REF_MAX - 1) + 1
        return found

    def probe(self, table: TableRef, keys: bytes) -> int:
        c, tid = self._held_by(table)
        return c.table.probe(tid, keys) if c is not None else 0

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
        recs = c.table.recs
        at = pos[found]
        slots = recs["slot"][at].astype(np.int64)
        if gone:
            blocks = diskio.Blocks(slots.tolist(), keys_u64(keys)[found].tobytes(), [dest[i] for i in found.tolist()],
                                   found.tolist(), recs["crc"][at].tolist())
        else:  # the usual case: every block still held, in order
            blocks = diskio.Blocks(slots.tolist(), keys, list(dest), list(range(n)), recs["crc"][at].tolist())
        c.busy[slots] += 1  # distinct keys, distinct records, distinct slots
        c.ref[slots] = np.minimum(c.ref[slots], REF_MAX - 1) + 1  # a use: CLOCK keeps it longer
        tasks = blocks.split(_per_task(c.slot_bytes))
        batch = _Batch(fut, len(tasks))
        for part in tasks:
            self._io.submit(READ, lambda p=part: diskio.read_blocks(c.files, p),
                            lambda res, p=part: self._read_done(c, batch, n, p, res))
        return fut

    def _read_done(self, c: _SizeClass, batch: _Batch, n: int, part: diskio.Blocks, res) -> None:
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

    def _read_landed(self, c: _SizeClass, part: diskio.Blocks, res) -> list[bool]:
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
            self._forget_slots(c, [part.slots[j] for j in bad], [part.crcs[j] for j in bad])
        return res.ok

    def _forget_slots(self, c: _SizeClass, slots: list[int], crcs: list[int]) -> None:
        s = np.array(slots, dtype=np.int64)
        own = c.owner[s]
        live = own != NONE
        pos = own[live].astype(np.int64)
        same = c.table.recs["crc"][pos] == np.array(crcs, dtype=np.uint32)[live]
        self._removing(c, pos[same])
        c.table.remove(pos[same])
        c.owner[s[live][same]] = NONE

    def write(self, table: TableRef, keys: bytes, src: Sequence[memoryview]) -> asyncio.Future:
        fut = self._loop.create_future()
        n = len(keys) // _KEY
        out = [SpillResult.ERROR] * n
        tid = self._tid(table, create=True)
        c = self._cls(table.slot_bytes)
        if c is None:
            self._count_spills(out)
            fut.set_result(out)
            return fut
        pos = c.table.lookup(tid, keys_u64(keys))
        todo = np.flatnonzero(pos < 0).tolist()
        for i in np.flatnonzero(pos >= 0).tolist():
            out[i] = SpillResult.PRESENT
        slots = self._alloc(c, len(todo))
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
        batch = _Batch(fut, len(tasks), results=[out, tid, self._gen.get(tid, 0)])
        mark = c.table.mark()  # the evicted slots' records removed above: out in the file before their bytes change

        def ready() -> bool:
            return c.table.wait(mark, INDEX_WAIT_S)

        for part in tasks:
            self._io.submit(WRITE, lambda p=part: diskio.write_blocks(c.files, p, ready),
                            lambda res, p=part: self._write_done(c, batch, p, res))
        return fut

    def _write_done(self, c: _SizeClass, batch: _Batch, part: diskio.Blocks, res) -> None:
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

    def _write_landed(self, c: _SizeClass, batch: _Batch, part: diskio.Blocks, res) -> None:
        out, tid, gen = batch.results
        if isinstance(res, Exception):
            res = diskio.WriteResult(crcs=[0] * len(part), ok=[False] * len(part), full=[False] * len(part),
                                     io_errors=len(part), first_error=str(res))
        slots = np.array(part.slots, dtype=np.int64)
        c.busy[slots] -= 1
        c.writing -= len(slots)
        self.st.write_bytes += res.nbytes
        self.st.io_errors += res.io_errors
        if res.first_error:
            log.warning("disk tier: %s (%d blocks of this spill dropped)", res.first_error, res.ok.count(False))
        ok = np.array(res.ok, dtype=bool)
        if any(res.full):
            c.full_until = time.monotonic() + DISK_FULL_RETRY_S
        for i, good, full in zip(part.at, res.ok, res.full, strict=True):
            out[i] = SpillResult.WRITTEN if good else SpillResult.FULL if full else SpillResult.ERROR
        if ok.any() and self._gen.get(tid, 0) == gen:  # not cleared meanwhile
            k = keys_u64(part.keys)[ok]
            present = c.table.lookup(tid, k) >= 0  # the same key spilled twice at once: keep the first
            written = np.flatnonzero(ok)
            for j in written[present].tolist():
                out[part.at[j]] = SpillResult.PRESENT
            keep = ~present
            pos = c.table.insert(tid, k[keep], slots[ok][keep].astype(np.uint32),
                                 np.array(res.crcs, dtype=np.uint32)[ok][keep])
            placed = pos >= 0  # both of a key's buckets full (about never): that block is not kept
            c.owner[slots[ok][keep][placed]] = pos[placed]
            if self.changed is not None and placed.any():
                self._tell(c, pos[placed], removed=False)
            for j in written[keep][~placed].tolist():
                out[part.at[j]] = SpillResult.FULL

    def _count_spills(self, out: list[SpillResult]) -> None:
        for r in out:
            if r is SpillResult.WRITTEN:
                self.st.spills += 1
            elif r is not SpillResult.PRESENT:
                self.st.spills_dropped[r.value] = self.st.spills_dropped.get(r.value, 0) + 1

    def _alloc(self, c: _SizeClass, k: int) -> np.ndarray:
        """Up to ``k`` slots: free ones first, then by CLOCK, ones whose count the hand has worn down to
        0 (its record removed now, before the slot is rewritten). Busy slots are skipped; the slots
        returned are busy (the caller's write) until ``_write_done``. No block is evicted while a slot
        is free: a restarted tier's hand and counts start over, and taking victims before free slots
        threw away every adopted block of a tier 2% full. While the file system is full
        (``full_until``) only occupied slots are taken: a free slot may be a hole the disk has no room
        for, an occupied one has its space already."""
        reuse_only = time.monotonic() < c.full_until
        got = [self._take_free(c, 0 if reuse_only else min(k, c.nslots - c.table.used - c.writing))]
        need, scanned = k - len(got[0]), 0
        # Each pass lowers every count it crosses, so within REF_MAX + 1 passes any slot not busy is
        # taken: stopping after two (as before) dropped spills as "full" while every block held a
        # count of 2 or 3 (1,514 of 202,521 spills of the conversation trace replay; a dropped head
        # loses its whole chain's disk hits). The step grows with what was scanned in vain, so even
        # that worst case is a few dozen numpy steps per pass, not nslots / 1,024.
        while need and scanned < (REF_MAX + 1) * c.nslots + 1:
            lo = c.hand
            hi = min(c.nslots, lo + max(need * 4, 1024, scanned))
            idx = np.arange(lo, hi)
            occupied = c.owner[lo:hi] != NONE
            ok = (c.busy[lo:hi] == 0) & ((c.ref[lo:hi] == 0) & occupied if reuse_only else
                                         ~occupied | (c.ref[lo:hi] == 0))
            sel = idx[ok][:need]
            end = int(sel[-1]) + 1 if len(sel) == need else hi
            passed = c.ref[lo:end]
            passed -= passed > 0  # one chance spent per pass (a block asked for n times survives n passes)
            c.busy[sel] += 1  # taken now: a sweep that wraps around must not hand them out twice
            c.ref[sel] = 0  # the new block starts unreferenced
            ev = sel[c.owner[sel] != NONE]
            if len(ev):
                if c.ghost is not None:
                    c.ghost.add(c.table.recs["k"][c.owner[ev].astype(np.int64)])
                self._removing(c, c.owner[ev].astype(np.int64))
                c.table.remove(c.owner[ev].astype(np.int64))
                c.owner[ev] = NONE
                self.st.evictions += len(ev)
            got.append(sel)
            need -= len(sel)
            scanned += end - lo
            c.hand = end % c.nslots
        out = np.concatenate(got)
        c.writing += len(out)
        return out

    def _take_free(self, c: _SizeClass, n: int) -> np.ndarray:
        """Up to ``n`` slots no record owns and no read or write holds, searched from where the last
        search stopped (``n``: how many the counts say are free; a slot being read when its record went
        is counted but skipped, so the search ends after one lap)."""
        got: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        scanned, h = 0, c.free_hand
        while n > 0 and scanned < c.nslots:
            hi = min(c.nslots, h + max(n * 4, 4096))
            sel = (np.flatnonzero((c.owner[h:hi] == NONE) & (c.busy[h:hi] == 0)) + h)[:n]
            c.busy[sel] += 1
            c.ref[sel] = 0
            got.append(sel)
            n -= len(sel)
            scanned += hi - h
            h = int(sel[-1]) + 1 if n == 0 and len(sel) else hi
            h %= c.nslots
        c.free_hand = h
        return np.concatenate(got)

    def remove(self, table: TableRef, keys: bytes) -> None:
        c, _, pos = self._find(table, keys)
        pos = pos[pos >= 0]
        if c is not None and len(pos):
            slots = c.table.recs["slot"][pos].astype(np.int64)
            self._removing(c, pos)
            c.table.remove(pos)
            c.owner[slots] = NONE

    def clear(self, namespace: str) -> int:
        tids = [t for t, ns in self._namespaces.items() if not namespace or ns == namespace]
        for t in tids:
            self._gen[t] = self._gen.get(t, 0) + 1
        removed = 0
        for c in self._classes.values():
            if not any(t in c.table.by_table for t in tids):
                continue  # holds none of them: no scan of its records
            pos = c.table.live()
            pos = pos[np.isin(c.table.recs["tid"][pos], np.array(tids, dtype=np.uint32))]
            removed += len(pos)
            c.owner[c.table.recs["slot"][pos].astype(np.int64)] = NONE
            if namespace:  # a CLEAR of all is one AllBlocksCleared on the stream: no removal per block
                self._removing(c, pos)
            elif c.reopened is not None:
                c.reopened[pos] = False
            c.table.remove(pos)
        return removed

    def namespace_blocks(self) -> dict[str, Held]:
        """What each namespace has here, from the tables' live counts (no scan of the records)."""
        out: dict[str, Held] = {}
        for c in self._classes.values():
            for tid, n in c.table.by_table.items():
                ref = self._refs.get(tid)
                if ref is None:
                    continue  # (records of unknown tables are dropped at open: none are live)
                h = out.setdefault(ref.namespace, Held(world_size=ref.world_size))
                h.blocks += n
                h.bytes += n * c.slot_bytes
                h.ranks.add(ref.rank)
        return out

    def stats(self) -> TierStats:
        st = self.st
        index_errors = sum(c.table.write_errors for c in self._classes.values())
        st.io_errors += index_errors - self._index_errors  # the index files' failed writes (their own thread)
        self._index_errors = index_errors
        st.resident_blocks = sum(c.table.used for c in self._classes.values())
        st.resident_bytes = sum(c.table.used * c.slot_bytes for c in self._classes.values())
        st.index_bytes = sum(c.table.memory_bytes + c.nslots * 7 + (c.ghost.nbytes if c.ghost else 0)
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
                c.table.flush()
            except OSError as e:
                log.error("disk tier: cannot flush the index of %d-byte blocks: %s", c.slot_bytes, e)
            c.table.close()
            _close_files(c.files)
        os.close(self._lock)
        os.close(self._dir)


def _close_files(files: diskio.Files) -> None:
    os.close(files.fd)
    if files.dfd >= 0:
        os.close(files.dfd)


def _table_row(r: object) -> tuple[int, TableRef] | None:
    """A ``tables.json`` row as (table id, table), None unless it has the shape this daemon writes."""
    if not isinstance(r, dict):
        return None
    tid, ns, rank, world, layout = (r.get(k) for k in ("tid", "namespace", "rank", "world_size", "layout"))
    ints = all(type(v) is int for v in (tid, rank, world))  # (not bool)
    if not (ints and isinstance(ns, str) and isinstance(layout, list) and layout and 0 < tid <= MAX_TID
            and 0 <= rank < world <= 1 << 16 and all(type(x) is int and 0 < x < 1 << 40 for x in layout)):
        return None
    return tid, TableRef(ns, rank, world, tuple(layout))


def _per_task(slot_bytes: int) -> int:
    """Blocks per I/O task: about TASK_BYTES, so that the threads share a big batch."""
    return max(1, TASK_BYTES // max(slot_bytes, 1))
