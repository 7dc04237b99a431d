"""A compact, persistent, vectorised hash table of blocks: (table id, 32-byte key) -> (slot, checksum).

Why not a dict of Entry objects: the DRAM index costs ~530 bytes per block (issue 15), which at the
67M blocks of a 16 TiB disk tier would be 35 GB. Here a block is one 44-byte record in a numpy
structured array at a load factor of 3/4 (59 bytes per block), and the array *is* the file: it is a
``numpy.memmap`` next to the data, so it survives a restart and a SIGKILL (the kernel keeps the dirty
pages) without a write-ahead log.

Open addressing with linear probing; the key is already a hash, so its first word (mixed with the
table id) is the probe start. ``lookup`` and ``insert`` take whole batches and run the probe sequence
for all keys at once (one numpy pass per probe step, a handful of steps at this load factor): a
LOOKUP of 1,024 keys is a few array operations, not 1,024 Python dict probes.

Crash safety: a record is published by writing its ``tid`` last (0 = empty, TOMB = removed); a torn
record (SIGKILL between the field stores) is either invisible or names a slot whose bytes fail the
checksum, which covers the key as well as the data (``kvoffd/cache/tiers/disk.py``). Tombstones are
swept by rebuilding into a new file and renaming it over the old one.
"""

from __future__ import annotations

import math
import os

import numpy as np

RECORD = np.dtype([("k", "<u8", (4,)), ("tid", "<u4"), ("slot", "<u4"), ("crc", "<u4")])
EMPTY = 0
TOMB = 0xFFFFFFFF
LOAD_FACTOR = 0.75
_HEADER = 64
_MAGIC = b"KVOFFTB1"
_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def keys_u64(keys: bytes) -> np.ndarray:
    """The binary of 32-byte keys as an (n, 4) uint64 array (no copy)."""
    return np.frombuffer(keys, dtype="<u8").reshape(-1, 4)


class BlockTable:
    """``capacity`` records for up to ``max_blocks`` blocks, in memory or in the file ``path``."""

    def __init__(self, max_blocks: int, path: str | None = None):
        self.max_blocks = max_blocks
        self.cap = max(16, math.ceil(max_blocks / LOAD_FACTOR))
        self.path = path
        self.recs = self._open(path, self.cap)
        live = (self.recs["tid"] != EMPTY) & (self.recs["tid"] != TOMB)
        self.used = int(np.count_nonzero(live))
        self.tombs = int(np.count_nonzero(self.recs["tid"] == TOMB))
        if path is not None and os.path.exists(path + ".old"):
            self._import(path + ".old")

    def _import(self, old_path: str) -> None:
        """The records of a table of another capacity (``--disk-size`` changed), rehashed into this one;
        those that do not fit are dropped (their blocks become misses)."""
        with open(old_path, "rb") as f:
            head = f.read(16)
        if head[:8] == _MAGIC:
            cap = int.from_bytes(head[8:16], "little")
            old = np.memmap(old_path, dtype=RECORD, mode="r", offset=_HEADER, shape=(cap,))
            t = old["tid"]
            sel = np.array(old[(t != EMPTY) & (t != TOMB)])[: self.max_blocks]
            for tid in np.unique(sel["tid"]):
                s = sel[sel["tid"] == tid]
                self.insert(int(tid), s["k"], s["slot"], s["crc"])
            del old
            self.flush()
        os.unlink(old_path)

    @staticmethod
    def _open(path: str | None, cap: int) -> np.ndarray:
        if path is None:
            return np.zeros(cap, dtype=RECORD)
        size = _HEADER + cap * RECORD.itemsize
        fresh = not os.path.exists(path) or os.path.getsize(path) != size
        if fresh:
            old = path + ".old"
            if os.path.exists(path):
                os.replace(path, old)  # another size: rehashed below by the caller (reopen)
            with open(path + ".tmp", "wb") as f:
                f.write(_MAGIC + cap.to_bytes(8, "little") + bytes(_HEADER - 16))
                f.truncate(size)
            os.replace(path + ".tmp", path)
        with open(path, "rb") as f:
            if f.read(8) != _MAGIC:
                raise ValueError(f"{path} is not a kvoffd block table")
        return np.memmap(path, dtype=RECORD, mode="r+", offset=_HEADER, shape=(cap,))

    @property
    def nbytes(self) -> int:
        return self.cap * RECORD.itemsize

    def _start(self, tid: int, k: np.ndarray) -> np.ndarray:
        return ((k[:, 0] ^ np.uint64(tid * _MIX & _M64)) % np.uint64(self.cap)).astype(np.int64)

    def lookup(self, tid: int, keys: np.ndarray) -> np.ndarray:
        """Record position of each key (``keys``: (n, 4) uint64), -1 where absent. Vectorised."""
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        if not n or not self.used:
            return out
        pos = self._start(tid, keys)
        active = np.arange(n)
        recs, cap = self.recs, self.cap
        for _ in range(cap):
            p = pos[active]
            tids = recs["tid"][p]
            match = (tids == tid) & (recs["k"][p] == keys[active]).all(axis=1)
            out[active[match]] = p[match]
            go = ~(match | (tids == EMPTY))
            active = active[go]
            if not active.size:
                break
            pos[active] = (pos[active] + 1) % cap
        return out

    def insert(self, tid: int, keys: np.ndarray, slots: np.ndarray, crcs: np.ndarray) -> np.ndarray:
        """Records for keys not present (the caller checked; keys unique); returns their positions.
        Fields first, ``tid`` last: see the module docstring."""
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        if self.used + self.tombs + n > 0.9 * self.cap:
            self.rebuild()
        if self.used + n > self.cap - 1:
            raise ValueError("block table full")
        pos = self._start(tid, keys)
        active = np.arange(n)
        recs, cap = self.recs, self.cap
        while active.size:
            p = pos[active]
            tids = recs["tid"][p]
            free = (tids == EMPTY) | (tids == TOMB)
            cand = np.flatnonzero(free)
            if cand.size:
                _, first = np.unique(p[cand], return_index=True)  # one key per free record per step
                win = cand[first]
                w, wp = active[win], p[win]
                self.tombs -= int(np.count_nonzero(recs["tid"][wp] == TOMB))
                recs["k"][wp] = keys[w]
                recs["slot"][wp] = slots[w]
                recs["crc"][wp] = crcs[w]
                recs["tid"][wp] = tid
                out[w] = wp
                keep = np.ones(active.size, dtype=bool)
                keep[win] = False
                active = active[keep]
            pos[active] = (pos[active] + 1) % cap
        self.used += n
        return out

    def remove(self, positions: np.ndarray) -> None:
        """Tombstone these records (positions of live records)."""
        if len(positions):
            self.recs["tid"][positions] = TOMB
            self.used -= len(positions)
            self.tombs += len(positions)

    def live(self) -> np.ndarray:
        """Positions of the live records."""
        t = self.recs["tid"]
        return np.flatnonzero((t != EMPTY) & (t != TOMB))

    def rebuild(self) -> None:
        """Sweep the tombstones: the live records rehashed into a fresh table (a new file renamed over
        the old one, so a crash leaves one or the other)."""
        pos = self.live()
        old = np.array(self.recs[pos])  # a copy: the memmap goes below
        if self.path is not None:
            self.recs.flush()
            del self.recs
            tmp = self.path + ".new"
            if os.path.exists(tmp):
                os.unlink(tmp)
            fresh = self._open(tmp, self.cap)
        else:
            fresh = np.zeros(self.cap, dtype=RECORD)
        self.recs, self.used, self.tombs = fresh, 0, 0
        for tid in np.unique(old["tid"]):
            sel = old[old["tid"] == tid]
            self.insert(int(tid), sel["k"], sel["slot"], sel["crc"])
        if self.path is not None:
            self.recs.flush()
            os.replace(self.path + ".new", self.path)

    def flush(self) -> None:
        if self.path is not None:
            self.recs.flush()
