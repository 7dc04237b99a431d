"""The disk tier's index: compact, persistent, vectorised, (table id, 32-byte key) -> (slot, checksum).

"Table" in kvoffd means one thing: one namespace x rank's blocks (kvoffd/cache/entries.py's ``Table``;
a tier names one by its ``TableRef`` and numbers it with a table id, kvoffd/cache/tiers/disktables.py).
A ``DiskIndex`` holds the blocks of every table of one block size, keyed by (table id, key).

Why not a dict of Entry objects: the DRAM index costs ~530 bytes per block, which at the
67M blocks of a 16 TiB disk tier would be 35 GB. Here a block is one 44-byte record in a numpy
structured array at a load factor of 0.6 (73 bytes per block), kept in private memory and mirrored
in a file next to the data (kvoffd/cache/tiers/indexfile.py: read once at open, each change written
back with ``pwrite`` by one thread, never a mapping of the file, which a full or truncated file system
would answer with SIGBUS), so it survives a restart and a SIGKILL without a write-ahead log.

Layout: buckets of ``BUCKET`` records; a key may live in either of two buckets (its first and second
key words, mixed with the table id, pick them: the key is already a hash) and goes to the emptier
one. With two choices a bucket overflows about never at this load factor; if both are full the
insert says so (-1) and the caller drops that block. There is no probing and so no tombstone: a
removal just empties its record, and nothing ever needs a rebuild (a rebuild would be an O(capacity)
stall of the event loop). ``lookup``, ``probe`` and ``insert`` take whole batches.

Beside the file, in memory only, each record position has a 32-bit fingerprint of its (table id,
key) (31 bits, odd; 0 = empty), rebuilt from the records when the index is opened (6.7 bytes per
block). A lookup reads the fingerprints of its keys' two buckets (2 x 32 bytes) and then only the
record a match names, instead of the 16 candidate records' fields (44-byte strides over a file
mapping of 4 KiB pages: 750 us for 1,024 keys of a 1M-block index on the 2-core VM). ``probe`` stops
at the fingerprints: "maybe held", never a false "no", a false "yes" for about 16 in 2^31 absent
keys; a LOOKUP of a disk hit is answered on it (kvoffd/cache/tiers/manager.py says why that is safe).
Both run in the compiled kernel (kvoffd/cache/tiers/_probe.c, one call per batch: 28 us for 1,024
keys) or, where it is not built, in numpy (a dozen calls, ~80 us hot and ~200 us cold) with ``find``
for a few keys in plain Python.

Crash safety: a record is published by writing its ``tid`` last (0 = empty) and removed by clearing
its ``tid`` alone; a torn record (SIGKILL between the field stores, or a file behind the memory) is
either invisible or names a slot whose bytes fail the checksum, which covers the key as well as the
data (``kvoffd/cache/tiers/disk.py``). The fingerprints are derived data and never reach the file.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import struct
import sys
import weakref
from array import array

import numpy as np

from kvoffd import libc
from kvoffd.cache.tiers.indexfile import RECORD, Damaged, IndexFile, anonymous, header_of, read_live

EMPTY = 0
BUCKET = 8
# At 3/4 a full index's churn (a disk tier always full: one removal, one insert per spill) found both
# buckets full for 0.4% of inserts (each a spill dropped "full", and its chain's later disk hits lost:
# 1,514 of 202,521 spills of the conversation trace replay); at 0.6, none in 208,000 (bench-free check:
# 3,000 rounds of 64 removals and 64 inserts at 16,000 blocks). 73 bytes per block instead of 59.
LOAD_FACTOR = 0.6
_MIX = 0x9E3779B97F4A7C15
_FP_MIX_INT = 0xD6E8FEB86659FD93  # an odd multiplier: the fingerprint is its product's top bits
_FP_MIX = np.uint64(_FP_MIX_INT)
_M64 = (1 << 64) - 1
_FP_CHUNK = 1 << 22  # records per step when the fingerprints are built at open (bounded temporaries)
_U32, _U1 = np.uint64(32), np.uint64(1)
_KEY = 32
_WORDS = struct.Struct("<3Q")  # a key's first three words (the fourth is compared as bytes)
_TID_AT = RECORD.fields["tid"][1]
_LANES = np.arange(BUCKET, dtype=np.int64)
FEW = 4  # lookups of at most this many keys take the scalar path (without the compiled kernel)

try:  # the compiled kernel (kvoffd/cache/tiers/_probe.c, built by setup.py); without it, numpy
    from kvoffd.cache.tiers import _probe
except ImportError:
    _probe = None
if sys.byteorder != "little":  # the kernel reads key words as little-endian integers
    _probe = None
KERNEL = "c" if _probe is not None else "numpy"  # the tier's notes say which one serves


def keys_u64(keys: bytes) -> np.ndarray:
    """The binary of 32-byte keys as an (n, 4) uint64 array (no copy)."""
    return np.frombuffer(keys, dtype="<u8").reshape(-1, 4)


def fingerprints(tids: np.ndarray | int, k2: np.ndarray) -> np.ndarray:
    """The fingerprint of keys whose third word is ``k2``, in table(s) ``tids``: 31 bits of the mixed
    word, and an odd number (0 is an empty record). The third word, since the first two choose the
    buckets."""
    return _fingerprint(k2 ^ (np.asarray(tids, dtype=np.uint64) * np.uint64(_MIX)))


def _fingerprint(mixed: np.ndarray) -> np.ndarray:
    """``fingerprints`` of a third key word already mixed with its table id (``_mixed``)."""
    return (((mixed * _FP_MIX) >> _U32) | _U1).astype(np.uint32)


def _tally(counts: dict[int, int], tids: np.ndarray, sign: int) -> None:
    """Count one record per entry of ``tids`` into ``counts`` (table id -> records; ``sign`` -1 takes
    them away, and a table left with none is dropped). A batch is usually of one table: one compare;
    else a bincount (table ids are small: the tier numbers its tables from 1), a sort past 2^20."""
    if not len(tids):
        return
    first = int(tids[0])
    if (tids == first).all():
        pairs = [(first, len(tids))]
    elif int(tids.max()) < 1 << 20:
        n = np.bincount(tids.astype(np.intp))
        ids = np.flatnonzero(n)
        pairs = list(zip(ids.tolist(), n[ids].tolist(), strict=True))
    else:
        ids, n = np.unique(tids, return_counts=True)
        pairs = list(zip(ids.tolist(), n.tolist(), strict=True))
    for tid, k in pairs:
        left = counts.get(tid, 0) + sign * k
        if left > 0:
            counts[tid] = left
        else:
            counts.pop(tid, None)


class DiskIndex:
    """Records for up to ``max_blocks`` blocks, in memory only or mirrored in the file ``path`` (a name
    under the directory ``dir_fd`` when given, opened without following symlinks). ``note`` says why
    the file was started over ("" when it was found whole, or imported)."""

    def __init__(self, max_blocks: int, path: str | None = None, dir_fd: int | None = None):
        self.max_blocks = max_blocks
        self.nbuckets = max(2, math.ceil(max_blocks / LOAD_FACTOR / BUCKET))
        self.cap = self.nbuckets * BUCKET
        self.path = path
        self.note = ""
        self._file: IndexFile | None = None
        if path is None:
            self.recs = np.zeros(self.cap, dtype=RECORD)
        else:
            opened = IndexFile.open(path, dir_fd, self.cap)
            self._file, self.note = opened.file, opened.note
            weakref.finalize(self, self._file.close)  # the writer thread and the descriptor go with the index
            self.recs = self._file.records
        self._tids = self.recs["tid"]
        self._fp = anonymous(self.cap * 4).view(np.uint32)
        self._fp_rows = self._fp.reshape(self.nbuckets, BUCKET)
        self._fp_view = memoryview(self._fp)  # read without numpy by ``find``
        self._raw = memoryview(self.recs.view(np.uint8))
        self._scratch = bytearray(1024)  # the kernel's per-key answers in ``probe``
        self.by_table: dict[int, int] = {}  # table id -> its live records (STATS per namespace: never a scan)
        self.used = self._build_fingerprints()
        if path is not None:
            self._import(path + ".old", dir_fd)

    def _build_fingerprints(self) -> int:
        """The fingerprints of the records found in the file, a bounded chunk at a time (at 100M blocks
        the index is 7 GB); returns how many records are live."""
        used = 0
        for lo in range(0, self.cap, _FP_CHUNK):
            tids = self._tids[lo:lo + _FP_CHUNK]
            live = np.flatnonzero(tids != EMPTY)
            if live.size:
                used += live.size
                self._fp[lo + live] = fingerprints(tids[live], self.recs["k"][lo + live, 2])
                _tally(self.by_table, tids[live], 1)
        return used

    def _import(self, old_name: str, dir_fd: int | None) -> None:
        """The records of an index of another capacity (``--disk-size`` changed), left as ``old_name`` by
        ``IndexFile.open`` (or by a daemon killed while importing), rehashed into this one and written
        in one pass; those that do not fit are dropped (their blocks become misses). A file there that
        is not an index's is a note, and removed: it never stops the tier."""
        try:
            sel = read_live(old_name, dir_fd, self.max_blocks)
        except FileNotFoundError:
            return
        except (OSError, Damaged) as e:
            self.note = f"{old_name} not imported ({e})"
            sel = None
        if sel is not None and len(sel):
            file, self._file = self._file, None  # filled in memory, then written once (not page by page)
            try:
                for tid in np.unique(sel["tid"]).tolist():
                    s = sel[sel["tid"] == tid]
                    self.insert(int(tid), s["k"], s["slot"], s["crc"])
            finally:
                self._file = file
            if file is not None:
                file.write_all()
        try:
            os.unlink(old_name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:  # (a directory by that name: left for the operator, said once per start)
            self.note = (self.note or f"{old_name} not imported") + f"; cannot remove it: {e.strerror}"

    @property
    def nbytes(self) -> int:
        """The records' bytes (the file's, less its header)."""
        return self.cap * RECORD.itemsize

    @property
    def memory_bytes(self) -> int:
        """What the index costs in memory: its records and their fingerprints."""
        return self.nbytes + self._fp.nbytes

    def _mixed(self, tid: int, k: np.ndarray, words: int = 3) -> np.ndarray:
        """The first ``words`` key words mixed with the table id: two pick the buckets, the third is
        the fingerprint's."""
        return k[:, :words] ^ np.uint64(tid * _MIX & _M64)

    def _pairs(self, mixed: np.ndarray) -> np.ndarray:
        """(n, 2) bucket numbers from mixed words: the key's two buckets (never the same one twice)."""
        b = (mixed[:, :2] % np.uint64(self.nbuckets)).astype(np.intp)
        same = b[:, 1] == b[:, 0]
        if same.any():
            b[same, 1] = (b[same, 0] + 1) % self.nbuckets
        return b

    def _candidates(self, tid: int, k: np.ndarray) -> np.ndarray:
        """(n, 2 * BUCKET) record positions: the key's two buckets."""
        return (self._pairs(self._mixed(tid, k, 2))[:, :, None] * BUCKET + _LANES).reshape(len(k), 2 * BUCKET)

    def _matches(self, mixed: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """(n, 2 * BUCKET) bools: the candidate records whose fingerprint is the key's."""
        rows = np.take(self._fp_rows, pairs, axis=0).reshape(len(pairs), 2 * BUCKET)
        return rows == _fingerprint(mixed[:, 2])[:, None]

    def lookup(self, tid: int, keys: np.ndarray) -> np.ndarray:
        """Record position of each key (``keys``: (n, 4) uint64), -1 where absent: the compiled kernel
        in one call, or vectorised over the fingerprints (module docstring), a few keys through
        ``find`` (the usual miss asks about one key)."""
        n = len(keys)
        if not n or not self.used:
            return np.full(n, -1, dtype=np.int64)
        if _probe is not None:
            out = np.empty(n, dtype=np.int64)
            _probe.lookup(self._fp_view, self._raw, self.nbuckets, tid, np.ascontiguousarray(keys), out)
            return out
        if n <= FEW:
            return np.array(self.find(tid, keys.tobytes()), dtype=np.int64)
        mixed = self._mixed(tid, keys)
        pairs = self._pairs(mixed)
        match = self._matches(mixed, pairs)
        found = match.any(axis=1)
        lane = match.argmax(axis=1)
        out = np.where(found, pairs[np.arange(n), lane // BUCKET] * BUCKET + lane % BUCKET, -1)
        hit = np.flatnonzero(found)
        if hit.size:  # the record a fingerprint names: the whole key, and the table
            at = out[hit]
            same = (self._tids[at] == tid) & (self.recs["k"][at] == keys[hit]).all(axis=1)
            odd = hit[~same]
            if odd.size:  # a collision (another lane may hold the key): the exact probe
                out[odd] = self.find(tid, keys[odd].tobytes())
        return out

    def probe(self, tid: int, keys: bytes) -> int:
        """How many of the leading keys (their binary) may be held: a fingerprint matched, exact for at
        most FEW keys without the kernel. Never short of the held ones; past them by an absent key
        about 16 times in 2^31. Cheaper than ``lookup`` by the records it does not read: what answers
        a LOOKUP (the exact ``lookup`` follows, off the answer's path). One call of the kernel;
        without it a dozen numpy calls."""
        n = len(keys) // _KEY
        if not n or not self.used:
            return 0
        if _probe is not None:
            if len(self._scratch) < n:
                self._scratch = bytearray(max(n, 2 * len(self._scratch)))
            return _probe.probe(self._fp_view, None, self.nbuckets, tid, keys, self._scratch)
        if n <= FEW:
            return next((i for i, p in enumerate(self.find(tid, keys)) if p < 0), n)
        mixed = self._mixed(tid, keys_u64(keys))
        words = self._matches(mixed, self._pairs(mixed)).view(np.uint64)  # a key's 16 bools = 2 words
        held = (words[:, 0] | words[:, 1]) != 0
        return n if held.all() else int(held.argmin())

    def find(self, tid: int, keys: bytes) -> list[int]:
        """``lookup`` of a few keys (their binary) without numpy: the kernel, or the same two buckets in
        Python, their fingerprints read through a memoryview, the record a match names compared as
        bytes. Why: each numpy call costs microseconds, tens of them when the daemon wakes up cold on
        the 2-core VM; a LOOKUP that misses the pool asks the disk about its first key only, so this
        is every new prompt's cost."""
        n = len(keys) // _KEY
        if not self.used:
            return [-1] * n
        if _probe is not None:
            out = array("q", bytes(8 * n))
            _probe.lookup(self._fp_view, self._raw, self.nbuckets, tid, keys, out)
            return out.tolist()
        mix = tid * _MIX & _M64
        nb = self.nbuckets
        fps, raw, size = self._fp_view, self._raw, RECORD.itemsize
        out = []
        for i in range(0, len(keys), _KEY):
            key = keys[i:i + _KEY]
            k0, k1, k2 = _WORDS.unpack_from(key)
            b0 = (k0 ^ mix) % nb
            b1 = (k1 ^ mix) % nb
            if b1 == b0:
                b1 = (b0 + 1) % nb
            fp = ((((k2 ^ mix) * _FP_MIX_INT) & _M64) >> 32) | 1
            at = -1
            for b in (b0, b1):
                lo = b * BUCKET
                row = fps[lo:lo + BUCKET].tolist()
                if fp not in row:
                    continue
                for j, f in enumerate(row):
                    off = (lo + j) * size
                    if (f == fp and raw[off:off + _KEY] == key
                            and int.from_bytes(raw[off + _TID_AT:off + _TID_AT + 4], "little") == tid):
                        at = lo + j
                        break
                if at >= 0:
                    break
            out.append(at)
        return out

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
            free = self._fp[pos] == EMPTY
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
            self._fp[wp] = fingerprints(tid, keys[w, 2])
            self._tids[wp] = tid
            out[w] = wp
            self.used += len(w)
            self.by_table[tid] = self.by_table.get(tid, 0) + len(w)
            keep = np.ones(active.size, dtype=bool)
            keep[first] = False
            active = active[keep]
        if self._file is not None:
            self._file.changed(out[out >= 0])
        return out

    def save(self, path: str) -> None:
        """Write this index (usually an in-memory one) as the file ``path`` in one sequential pass.

        Why: filling a big index through its memmap dirties every page of the file at each batch of
        random inserts, and the kernel writes them back over and over (a 100M-block index, 5.9 GB,
        had written 2 TB after 7 minutes on a small VM). Built in memory and saved once, it is written
        once. Atomic (a temporary file, renamed)."""
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(header_of(self.cap))
            self.recs.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def remove(self, positions: np.ndarray) -> None:
        """Empty these records (positions of live records)."""
        if len(positions):
            _tally(self.by_table, self._tids[positions], -1)
            self._tids[positions] = EMPTY
            self._fp[positions] = EMPTY
            self.used -= len(positions)
            if self._file is not None:
                self._file.changed(positions)

    def live(self) -> np.ndarray:
        """Positions of the live records."""
        return np.flatnonzero(self._tids != EMPTY)

    def lock_in_memory(self) -> str:
        """Lock the file's pages and the fingerprints in memory (mlock): "" once locked, else why not (a
        index in memory has nothing to lock). Why: the index is read at random, a few pages per LOOKUP,
        so most of it looks cold to the kernel, which may drop its clean page-cache pages (memory
        pressure, or a proactive reclaimer: the 2-core VM's DAMON pages out memory idle for a minute);
        the next LOOKUP then waits on the event loop for a disk read. Locked, it stays at its 80 bytes
        per block of RAM (73.3 of records, 6.7 of fingerprints). Takes seconds for a big index (every page is read): call it off the loop."""
        if self.path is None or not self.nbytes:
            return ""
        for arr in (self.recs, self._fp):
            addr = arr.ctypes.data
            lo = addr - addr % mmap.PAGESIZE
            if libc.mlock(lo, addr + arr.nbytes - lo) != 0:
                err = ctypes.get_errno()
                hint = " (raise RLIMIT_MEMLOCK: LimitMEMLOCK=infinity)" if err in (errno.EPERM, errno.ENOMEM) else ""
                return f"mlock: {os.strerror(err)}{hint}"
        return ""

    # --- the file ------------------------------------------------------------------------------------
    def mark(self) -> int:
        """A point in this index's changes (0 without a file): see ``wait``."""
        return self._file.mark() if self._file is not None else 0

    def wait(self, mark: int, timeout: float | None = None) -> bool:
        """Block (an I/O thread) until the changes before ``mark`` are in the file: a slot's data is
        rewritten only once the removal of the record that named it is out."""
        return self._file.wait(mark, timeout) if self._file is not None and mark else True

    @property
    def write_errors(self) -> int:
        """Writes to the file that failed (a full, failing or truncated file: those changes may be lost
        at a restart, never served wrong: the checksum decides)."""
        return self._file.write_errors if self._file is not None else 0

    def flush(self) -> None:
        """Every change in the file, and the file durable."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Write what is pending and release the file (the index stays readable in memory)."""
        if self._file is not None:
            self._file.close()
