"""The blocking half of the disk tier: batches of ``preadv``/``pwritev`` run on an I/O thread.

Every function here takes plain values (descriptors, offsets, buffers) and returns a result object; it
never touches the tier's tables (those belong to the loop thread). The checksum is computed here, off
the loop: crc32 over the key and then the bytes, so a record that names the wrong slot (a torn index
entry, a slot rewritten since) fails as surely as a torn block.
"""

from __future__ import annotations

import errno
import os
import zlib
from dataclasses import dataclass, field

import numpy as np

ALIGN = 4096
_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def block_crc(key: bytes, data: memoryview) -> int:
    return zlib.crc32(data, zlib.crc32(key))


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
class ReadItem:
    slot: int
    crc: int
    key: bytes
    dest: memoryview


@dataclass
class ReadResult:
    ok: list[bool]
    nbytes: int = 0
    io_errors: int = 0
    checksum_failures: int = 0
    first_error: str = ""


def read_blocks(files: Files, items: list[ReadItem]) -> ReadResult:
    """Read each block into its destination and verify it; a failure is that block's miss."""
    res = ReadResult(ok=[False] * len(items))
    for i, it in enumerate(items):
        want = len(it.dest)
        try:
            n = os.preadv(files.pick(it.dest), [it.dest], it.slot * files.stride)
        except OSError as e:
            res.io_errors += 1
            res.first_error = res.first_error or f"read: {e}"
            continue
        if n != want:
            res.io_errors += 1
            res.first_error = res.first_error or f"short read: {n} of {want} bytes"
            continue
        res.nbytes += n
        if block_crc(it.key, it.dest) != it.crc:
            res.checksum_failures += 1
            continue
        res.ok[i] = True
    return res


@dataclass
class WriteItem:
    slot: int
    key: bytes
    src: memoryview


@dataclass
class WriteResult:
    crcs: list[int]
    ok: list[bool]
    full: list[bool] = field(default_factory=list)  # the file system had no room (ENOSPC, EFBIG)
    nbytes: int = 0
    io_errors: int = 0
    first_error: str = ""


def write_blocks(files: Files, items: list[WriteItem]) -> WriteResult:
    res = WriteResult(crcs=[0] * len(items), ok=[False] * len(items), full=[False] * len(items))
    for i, it in enumerate(items):
        res.crcs[i] = block_crc(it.key, it.src)
        try:
            n = os.pwritev(files.pick(it.src), [it.src], it.slot * files.stride)
        except OSError as e:
            if e.errno in _FULL_ERRNOS:
                res.full[i] = True
            else:
                res.io_errors += 1
            res.first_error = res.first_error or f"write: {e}"
            continue
        if n != len(it.src):
            res.io_errors += 1
            res.first_error = res.first_error or f"short write: {n} of {len(it.src)} bytes"
            continue
        res.nbytes += n
        res.ok[i] = True
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
