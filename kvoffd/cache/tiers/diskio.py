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
crafted collision is not the threat here: the files are the daemon's own, 0600, in a directory only
its user can write (kvoffd/runtime.py ``open_private_dir``), so no one else can plant a block with a
matching sum.
"""

from __future__ import annotations

import errno
import os
import stat
import zlib
from collections.abc import Callable
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


def write_blocks(files: Files, blocks: Blocks, ready: Callable[[], bool] | None = None) -> WriteResult:
    """Write each block to its slot and return its checksum. ``ready`` is asked first: the slots' old
    records must be removed from the index file before their bytes change; False drops the batch."""
    n_blocks = len(blocks)
    res = WriteResult(crcs=[0] * n_blocks, ok=[False] * n_blocks, full=[False] * n_blocks)
    if ready is not None and not ready():
        res.io_errors = n_blocks
        res.first_error = "the index file is not written (its writer is stuck or closed)"
        return res
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


def open_own(name: str, dir_fd: int | None, flags: int) -> int:
    """``name`` under ``dir_fd``, never through a symlink, a regular file made private (0600)."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_files(name: str, stride: int, dir_fd: int | None = None) -> tuple[Files, str]:
    """The data file ``name`` (under ``dir_fd``), buffered and (where supported) O_DIRECT, never through a
    symlink, a regular file of mode 0600; the second value says why direct I/O is off ("" when on)."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = open_own(name, dir_fd, os.O_RDWR | os.O_CREAT)
    st = os.fstat(fd)
    why = ""
    dfd = -1
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        why = "O_DIRECT is not available on this platform"
    else:
        try:
            dfd = os.open(name, flags | flag, dir_fd=dir_fd)
            if not os.path.samestat(os.fstat(dfd), st):  # replaced between the two opens
                os.close(dfd)
                dfd = -1
                why = f"{name} changed while it was opened; using the page cache"
        except OSError as e:
            why = f"the file system refuses O_DIRECT ({e.strerror}); using the page cache"
    return Files(fd, dfd, stride), why
