"""The blocking half of the disk tier: batches of ``preadv``/``pwritev`` run on an I/O thread.

Every function here takes plain values (descriptors, offsets, buffers) and returns a result object; it
never touches the tier's tables (those belong to the loop thread). The checksum is computed here, off
the loop, over the key and the bytes, so a record that names the wrong slot (a torn index entry, a
slot rewritten since) fails as surely as a torn block.

Why not crc32 of the bytes: on the 2-core VM zlib's crc32 runs at 1.3-1.7 GB/s per core, below the
disk, and a promotion is checked on every read. The check used for blocks whose length is a multiple
of 8 (all real layouts) is two numpy reductions over the block's 64-bit words, the plain sum and the
sum weighted by position (4x crc32's speed measured here, and numpy releases the GIL), folded to 32
bits with the key's crc32: any single changed word, any two changed words, a stale or torn sector
and a sector written in the wrong place all change it (but for a 2^-32 chance from the fold); a
crafted collision is not the threat here (the file is the daemon's own, 0600).
"""

from __future__ import annotations

import errno
import os
import zlib
from dataclasses import dataclass, field

import numpy as np

ALIGN = 4096
_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


_WEIGHTS: dict[int, np.ndarray] = {}  # words per block -> 1..n (one per block size, never written)
_M64 = (1 << 64) - 1


def block_crc(key: bytes, data: memoryview) -> int:
    if len(data) % 8:
        return zlib.crc32(data, zlib.crc32(key))
    a = np.frombuffer(data, dtype=np.uint64)
    w = _WEIGHTS.get(len(a))
    if w is None:
        w = _WEIGHTS.setdefault(len(a), np.arange(1, len(a) + 1, dtype=np.uint64))
    x = (int(a.sum()) * 0x9E3779B97F4A7C15 ^ int((a * w).sum())) & _M64  # sums wrap mod 2^64
    return (x ^ (x >> 32) ^ zlib.crc32(key)) & 0xFFFFFFFF


def _addr(buf: memoryview) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


@dataclass
class Files:
    """A size class's descriptors: ``dfd`` is the O_DIRECT one (-1 where the file system refuses it)."""

    fd: int
    dfd: int
    stride: int

    def pick(self, buf: memoryview) -> int:
        """O_DIRECT only for whole aligned pages at aligned addresses; the page cache otherwise."""
        if self.dfd >= 0 and len(buf) % ALIGN == 0 and _addr(buf) % ALIGN == 0:
            return self.dfd
        return self.fd


@dataclass
class Blocks:
    """A batch of blocks for one read or write task, as parallel lists: block ``j`` is ``slots[j]``,
    key ``keys[32 j: 32 j + 32]``, buffer ``bufs[j]`` (the read's destination or the write's source),
    ``crcs[j]`` its expected checksum (reads), ``at[j]`` its index in the caller's request. No object
    per block: the loop builds these for 1,024-block promotions and spills."""

    slots: list[int]
    keys: bytes
    bufs: list[memoryview]
    at: list[int]
    crcs: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.slots)

    def key(self, j: int) -> bytes:
        return self.keys[j * 32:(j + 1) * 32]

    def split(self, per: int) -> list[Blocks]:
        """Tasks of at most ``per`` blocks (the threads share a big batch)."""
        if len(self) <= per:
            return [self]
        return [Blocks(self.slots[i:i + per], self.keys[i * 32:(i + per) * 32], self.bufs[i:i + per],
                       self.at[i:i + per], self.crcs[i:i + per]) for i in range(0, len(self), per)]


@dataclass
class ReadResult:
    ok: list[bool]
    nbytes: int = 0
    io_errors: int = 0
    checksum_failures: int = 0
    first_error: str = ""


def read_blocks(files: Files, blocks: Blocks) -> ReadResult:
    """Read each block into its destination and verify it; a failure is that block's miss."""
    res = ReadResult(ok=[False] * len(blocks))
    for j, (slot, dest, crc) in enumerate(zip(blocks.slots, blocks.bufs, blocks.crcs, strict=True)):
        want = len(dest)
        try:
            n = os.preadv(files.pick(dest), [dest], slot * files.stride)
        except OSError as e:
            res.io_errors += 1
            res.first_error = res.first_error or f"read: {e}"
            continue
        if n != want:
            res.io_errors += 1
            res.first_error = res.first_error or f"short read: {n} of {want} bytes"
            continue
        res.nbytes += n
        if block_crc(blocks.key(j), dest) != crc:
            res.checksum_failures += 1
            continue
        res.ok[j] = True
    return res


@dataclass
class WriteResult:
    crcs: list[int]
    ok: list[bool]
    full: list[bool] = field(default_factory=list)  # the file system had no room (ENOSPC, EFBIG)
    nbytes: int = 0
    io_errors: int = 0
    first_error: str = ""


def write_blocks(files: Files, blocks: Blocks) -> WriteResult:
    n_blocks = len(blocks)
    res = WriteResult(crcs=[0] * n_blocks, ok=[False] * n_blocks, full=[False] * n_blocks)
    for j, (slot, src) in enumerate(zip(blocks.slots, blocks.bufs, strict=True)):
        res.crcs[j] = block_crc(blocks.key(j), src)
        try:
            n = os.pwritev(files.pick(src), [src], slot * files.stride)
        except OSError as e:
            if e.errno in _FULL_ERRNOS:
                res.full[j] = True
            else:
                res.io_errors += 1
            res.first_error = res.first_error or f"write: {e}"
            continue
        if n != len(src):
            res.io_errors += 1
            res.first_error = res.first_error or f"short write: {n} of {len(src)} bytes"
            continue
        res.nbytes += n
        res.ok[j] = True
    return res


def open_files(path: str, stride: int) -> tuple[Files, str]:
    """The data file, buffered and (where supported) O_DIRECT; the second value says why direct I/O is
    off ("" when on)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    why = ""
    dfd = -1
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        why = "O_DIRECT is not available on this platform"
    else:
        try:
            dfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | flag)
        except OSError as e:
            why = f"the file system refuses O_DIRECT ({e.strerror}); using the page cache"
    return Files(fd, dfd, stride), why
