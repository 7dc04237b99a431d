"""A compact, persistent, vectorised hash table of blocks: (table id, 32-byte key) -> (slot, checksum).

Why not a dict of Entry objects: the DRAM index costs ~530 bytes per block (issue 15), which at the
67M blocks of a 16 TiB disk tier would be 35 GB. Here a block is one 44-byte record in a numpy
structured array at a load factor of 0.6 (73 bytes per block), and the array *is* the file: it is a
``numpy.memmap`` next to the data, so it survives a restart and a SIGKILL (the kernel keeps the dirty
pages) without a write-ahead log.

Layout: buckets of ``BUCKET`` records; a key may live in either of two buckets (its first and second
key words, mixed with the table id, pick them: the key is already a hash) and goes to the emptier
one. With two choices a bucket overflows about never at this load factor; if both are full the
insert says so (-1) and the caller drops that block. There is no probing and so no tombstone: a
removal just empties its record, and nothing ever needs a rebuild (a rebuild would be an O(capacity)
stall of the event loop). ``lookup`` and ``insert`` take whole batches: a LOOKUP of 1,024 keys is a
few numpy gathers over their 2 x 8 candidate records, not 1,024 Python probes.

Crash safety: a record is published by writing its ``tid`` last (0 = empty); a torn record (SIGKILL
between the field stores) is either invisible or names a slot whose bytes fail the checksum, which
covers the key as well as the data (``kvoffd/cache/tiers/disk.py``).
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os

import numpy as np

RECORD = np.dtype([("k", "<u8", (4,)), ("tid", "<u4"), ("slot", "<u4"), ("crc", "<u4")])
EMPTY = 0
BUCKET = 8
# At 3/4 a full table's churn (a disk tier always full: one removal, one insert per spill) found both
# buckets full for 0.4% of inserts (each a spill dropped "full", and its chain's later disk hits lost:
# 1,514 of 202,521 spills of the conversation trace replay); at 0.6, none in 208,000 (bench-free check:
# 3,000 rounds of 64 removals and 64 inserts at 16,000 blocks). 73 bytes per block instead of 59.
LOAD_FACTOR = 0.6
_HEADER = 64
_MAGIC = b"KVOFFTB2"
_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
_LANES = np.arange(BUCKET, dtype=np.int64)
FEW = 4  # lookups of at most this many keys take the scalar path


def keys_u64(keys: bytes) -> np.ndarray:
    """The binary of 32-byte keys as an (n, 4) uint64 array (no copy)."""
    return np.frombuffer(keys, dtype="<u8").reshape(-1, 4)


class BlockTable:
    """Records for up to ``max_blocks`` blocks, in memory or in the file ``path``."""

    def __init__(self, max_blocks: int, path: str | None = None):
        self.max_blocks = max_blocks
        self.nbuckets = max(2, math.ceil(max_blocks / LOAD_FACTOR / BUCKET))
        self.cap = self.nbuckets * BUCKET
        self.path = path
        self._mm = self._open(path, self.cap)
        self.recs = np.asarray(self._mm)  # a plain ndarray on the same pages: memmap's subclass hooks cost µs per op
        self._tids = self.recs["tid"]
        self._k0 = self.recs["k"][:, 0]
        self.used = int(np.count_nonzero(self._tids != EMPTY))
        if path is not None and os.path.exists(path + ".old"):
            self._import(path + ".old")

    @staticmethod
    def _open(path: str | None, cap: int) -> np.ndarray:
        if path is None:
            return np.zeros(cap, dtype=RECORD)
        size = _HEADER + cap * RECORD.itemsize
        if not os.path.exists(path) or os.path.getsize(path) != size:
            if os.path.exists(path):
                os.replace(path, path + ".old")  # another capacity: imported by __init__
            with open(path + ".tmp", "wb") as f:
                f.write(_MAGIC + cap.to_bytes(8, "little") + bytes(_HEADER - 16))
                f.truncate(size)
            os.replace(path + ".tmp", path)
        with open(path, "rb") as f:
            if f.read(8) != _MAGIC:
                raise ValueError(f"{path} is not a kvoffd block table")
        return np.memmap(path, dtype=RECORD, mode="r+", offset=_HEADER, shape=(cap,))

    def _import(self, old_path: str) -> None:
        """The records of a table of another capacity (``--disk-size`` changed), rehashed into this one;
        those that do not fit are dropped (their blocks become misses)."""
        with open(old_path, "rb") as f:
            head = f.read(16)
        if head[:8] == _MAGIC:
            cap = int.from_bytes(head[8:16], "little")
            old = np.memmap(old_path, dtype=RECORD, mode="r", offset=_HEADER, shape=(cap,))
            sel = np.array(old[old["tid"] != EMPTY])[: self.max_blocks]
            del old
            for tid in np.unique(sel["tid"]):
                s = sel[sel["tid"] == tid]
                self.insert(int(tid), s["k"], s["slot"], s["crc"])
            self.flush()
        os.unlink(old_path)

    @property
    def nbytes(self) -> int:
        return self.cap * RECORD.itemsize

    def _candidates(self, tid: int, k: np.ndarray) -> np.ndarray:
        """(n, 2 * BUCKET) record positions: the key's two buckets."""
        b = ((k[:, :2] ^ np.uint64(tid * _MIX & _M64)) % np.uint64(self.nbuckets)).astype(np.int64)
        same = b[:, 1] == b[:, 0]
        if same.any():
            b[same, 1] = (b[same, 0] + 1) % self.nbuckets
        return (b[:, :, None] * BUCKET + _LANES).reshape(len(k), 2 * BUCKET)

    def lookup(self, tid: int, keys: np.ndarray) -> np.ndarray:
        """Record position of each key (``keys``: (n, 4) uint64), -1 where absent. Vectorised; a few
        keys go through ``_lookup_one`` instead (the usual miss asks about one key)."""
        n = len(keys)
        if not n or not self.used:
            return np.full(n, -1, dtype=np.int64)
        if n <= FEW:
            return np.array([self._lookup_one(tid, k) for k in keys.tolist()], dtype=np.int64)
        pos = self._candidates(tid, keys)
        match = (self._tids[pos] == tid) & (self._k0[pos] == keys[:, :1])
        found = match.any(axis=1)
        out = np.where(found, pos[np.arange(n), match.argmax(axis=1)], -1)
        hit = np.flatnonzero(found)
        if hit.size:  # the whole key, for those whose first word matched
            same = (self.recs["k"][out[hit]] == keys[hit]).all(axis=1)
            out[hit[~same]] = -1
        return out

    def _lookup_one(self, tid: int, key: list[int]) -> int:
        """``lookup`` of one key (its four words) in Python integers: the same two buckets, read as two
        small slices. Why: the vectorised path is ~20 numpy calls whatever n, ~20 us for one key on
        the 2-core VM, where this takes a few; a LOOKUP that misses the pool asks the disk about its
        first key only, so this is every new prompt's cost."""
        mix = tid * _MIX & _M64
        nb = self.nbuckets
        b0 = (key[0] ^ mix) % nb
        b1 = (key[1] ^ mix) % nb
        if b1 == b0:
            b1 = (b0 + 1) % nb
        for b in (b0, b1):
            lo = b * BUCKET
            tids = self._tids[lo:lo + BUCKET].tolist()
            if tid not in tids:
                continue
            firsts = self._k0[lo:lo + BUCKET].tolist()
            for j in range(BUCKET):
                if tids[j] == tid and firsts[j] == key[0] and self.recs["k"][lo + j].tolist() == key:
                    return lo + j
        return -1

    def insert(self, tid: int, keys: np.ndarray, slots: np.ndarray, crcs: np.ndarray) -> np.ndarray:
        """Records for keys not present (the caller checked; keys unique); returns their positions, -1
        where both buckets were full. Fields first, ``tid`` last: see the module docstring."""
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        active = np.arange(n)
        recs = self.recs
        for _ in range(2 * BUCKET + 1):
            if not active.size:
                break
            pos = self._candidates(tid, keys[active])
            free = self._tids[pos] == EMPTY
            f1, f2 = free[:, :BUCKET].sum(axis=1), free[:, BUCKET:].sum(axis=1)
            half = np.where(f2 > f1, BUCKET, 0)
            lane = np.argmax(np.take_along_axis(free, half[:, None] + _LANES, axis=1), axis=1)
            room = np.maximum(f1, f2) > 0
            target = pos[np.arange(active.size), half + lane]
            active, target = active[room], target[room]  # both buckets full: stays -1
            _, first = np.unique(target, return_index=True)  # one key per record per round
            w, wp = active[first], target[first]
            recs["k"][wp] = keys[w]
            recs["slot"][wp] = slots[w]
            recs["crc"][wp] = crcs[w]
            self._tids[wp] = tid
            out[w] = wp
            self.used += len(w)
            keep = np.ones(active.size, dtype=bool)
            keep[first] = False
            active = active[keep]
        return out

    def save(self, path: str) -> None:
        """Write this table (usually an in-memory one) as the file ``path`` in one sequential pass.

        Why: filling a big table through its memmap dirties every page of the file at each batch of
        random inserts, and the kernel writes them back over and over (a 100M-block table, 5.9 GB,
        had written 2 TB after 7 minutes on a small VM). Built in memory and saved once, it is written
        once. Atomic (a temporary file, renamed)."""
        with open(path + ".tmp", "wb") as f:
            f.write(_MAGIC + self.cap.to_bytes(8, "little") + bytes(_HEADER - 16))
            self.recs.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def remove(self, positions: np.ndarray) -> None:
        """Empty these records (positions of live records)."""
        if len(positions):
            self._tids[positions] = EMPTY
            self.used -= len(positions)

    def live(self) -> np.ndarray:
        """Positions of the live records."""
        return np.flatnonzero(self._tids != EMPTY)

    def lock_in_memory(self) -> str:
        """Lock the file's pages in memory (mlock): "" once locked, else why not (a table in memory has
        nothing to lock). Why: the table is read at random, a few pages per LOOKUP, so most of it looks
        cold to the kernel, which may drop its clean page-cache pages (memory pressure, or a proactive
        reclaimer: the 2-core VM's DAMON pages out memory idle for a minute); the next LOOKUP then waits
        on the event loop for a disk read. Locked, it stays at its 73 bytes per block of RAM.
        Takes seconds for a big table (every page is read): call it off the loop."""
        if self.path is None or not self.nbytes:
            return ""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        addr = self.recs.ctypes.data
        lo = addr - addr % mmap.PAGESIZE
        if libc.mlock(lo, addr + self.nbytes - lo) != 0:
            err = ctypes.get_errno()
            hint = " (raise RLIMIT_MEMLOCK: LimitMEMLOCK=infinity)" if err in (errno.EPERM, errno.ENOMEM) else ""
            return f"mlock: {os.strerror(err)}{hint}"
        return ""

    def flush(self) -> None:
        if self.path is not None:
            self._mm.flush()
