"""The pool's geometry and its file's format: what the daemon (kvoffd/cache/pool.py,
kvoffd/cache/pool_file.py) and ``kvoffd doctor`` (kvoffd/ops/doctor_pool.py) both read.

Pure definitions (the standard library and the shared places of kvoffd_client.paths): ops reaches the
daemon only through the client library (the import contract of pyproject.toml), yet the doctor must
tell an operator, with no daemon running, whether a ``--pool-size`` is one the pool serves and what
an existing pool file holds. So the sizes and the file's layout and header live here, once.

The file (one ``Layout``): a 4 KiB header, two namespace-table areas (kvoffd/cache/slots_table.py),
the chunk table, the slot records, then the pool's data, 2 MiB-aligned (a huge page). The header says
what made the file (format version, pool and chunk sizes, page size, records per chunk); an adopter
that finds anything else starts cold.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import struct
import zlib
from dataclasses import dataclass

from kvoffd_client.paths import runtime_dir

DEFAULT_CHUNK = 64 << 20
# Smallest block (slot) the daemon accepts at REGISTER. The index spends about half a KiB of Python
# objects per resident block (entry, key, dict and LRU slots); below 256 bytes a block would cost
# more to remember than to hold. Real vLLM blocks are KiBs to MiBs; tests and trace replays that
# want many small blocks use 256-byte ones (8 keys' worth of bytes).
MIN_SLOT_BYTES = 256

# the pool file
FORMAT_VERSION = 1
MAGIC = b"KVOFFDPL"
HEADER_BYTES = 4096
NS_AREA_BYTES = 256 << 10  # one copy of the namespace table (there are two: one is always whole)
RECORD_BYTES = 64
RECORDS_PER_CHUNK = 4096  # slots of >= chunk/4096 (16 KiB in 64 MiB chunks) are all persisted
ALIGN = 2 << 20
# statfs f_type of the filesystems whose pages are memory: tmpfs/shmem, hugetlbfs, ramfs
MEMORY_FS = {0x01021994: "tmpfs", 0x958458F6: "hugetlbfs", 0x858458F6: "ramfs"}
_HEADER = struct.Struct("<8sIIQQIQdddQ")  # magic, version, page, pool, chunk, records/chunk, data_off,
#                                           created, updated (last written), adopted_from, writer pid


def exact_size(n: int) -> str:
    """A size an operator can paste back: whole GiB or MiB when it is one, else bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n} bytes"


def pool_geometry(nbytes: int, chunk_bytes: int = DEFAULT_CHUNK) -> tuple[int, int]:
    """(chunk bytes, chunks) of a pool of exactly ``nbytes``; ValueError, in one line an operator can act
    on, for a size that is not whole chunks (or, below one chunk, not whole pages)."""
    if nbytes <= 0:
        raise ValueError(f"a pool of {nbytes} bytes")
    if nbytes < chunk_bytes:
        if nbytes % mmap.PAGESIZE:
            raise ValueError(f"--pool-size {nbytes} bytes is not a whole number of {mmap.PAGESIZE}-byte pages; "
                             f"use {nbytes - nbytes % mmap.PAGESIZE or mmap.PAGESIZE} or "
                             f"{nbytes - nbytes % mmap.PAGESIZE + mmap.PAGESIZE}")
        return nbytes, 1
    if nbytes % chunk_bytes:
        down = nbytes - nbytes % chunk_bytes
        raise ValueError(f"--pool-size {exact_size(nbytes)} is not a whole number of {exact_size(chunk_bytes)} chunks; "
                         f"use {exact_size(down) if down else exact_size(nbytes - nbytes % mmap.PAGESIZE)} or "
                         f"{exact_size(down + chunk_bytes)}")
    return chunk_bytes, nbytes // chunk_bytes


def fs_type(path: str) -> str:
    """``tmpfs``, ``hugetlbfs``, ``ramfs``, or ``other`` for the filesystem holding ``path``."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field (a long)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), buf) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), path)
    return MEMORY_FS.get(ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF, "other")


def default_pool_path(address: str) -> str:
    """Beside the socket when its directory is memory-backed (``/run/...``), else in /dev/shm, named
    by the uid and the address so two daemons of one host never share a pool. Never a disk
    filesystem: a pool there would be written back to disk."""
    sock_dir = os.path.dirname(address[6:]) if address.startswith("ipc://") else runtime_dir()
    try:
        if fs_type(sock_dir) != "other":
            return os.path.join(sock_dir, "kvoffd.pool")
    except OSError:
        pass
    tag = hashlib.sha256(address.encode()).hexdigest()[:12]
    return f"/dev/shm/kvoffd-{os.getuid()}-{tag}.pool"


@dataclass(frozen=True)
class Layout:
    """Where each part of the file lies, for a pool of ``pool_bytes`` in ``chunk_bytes`` chunks."""

    pool_bytes: int
    chunk_bytes: int
    records_per_chunk: int

    @classmethod
    def of(cls, pool_bytes: int, chunk_bytes: int) -> Layout:
        return cls(pool_bytes, chunk_bytes, min(RECORDS_PER_CHUNK, chunk_bytes // MIN_SLOT_BYTES))

    @property
    def num_chunks(self) -> int:
        return self.pool_bytes // self.chunk_bytes

    ns_offset = HEADER_BYTES

    @property
    def chunks_offset(self) -> int:
        """The chunk table: one 64-bit word per chunk, the slot size of its sealed records."""
        return HEADER_BYTES + 2 * NS_AREA_BYTES

    @property
    def records_offset(self) -> int:
        return self.chunks_offset + -(-self.num_chunks * 8 // 4096) * 4096

    @property
    def num_records(self) -> int:
        return self.num_chunks * self.records_per_chunk

    @property
    def data_offset(self) -> int:
        end = self.records_offset + self.num_records * RECORD_BYTES
        return -(-end // ALIGN) * ALIGN

    @property
    def file_bytes(self) -> int:
        return -(-(self.data_offset + self.pool_bytes) // ALIGN) * ALIGN


@dataclass(frozen=True)
class Header:
    version: int
    page_size: int
    pool_bytes: int
    chunk_bytes: int
    records_per_chunk: int
    data_offset: int
    created: float
    updated: float
    adopted_from: float  # when the pool's first daemon created it (survives adoptions)
    pid: int

    def pack(self) -> bytes:
        body = _HEADER.pack(MAGIC, self.version, self.page_size, self.pool_bytes, self.chunk_bytes,
                            self.records_per_chunk, self.data_offset, self.created, self.updated,
                            self.adopted_from, self.pid)
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def unpack(cls, raw: bytes) -> Header | None:
        """None for anything that is not a whole header of this format's family."""
        n = _HEADER.size
        if len(raw) < n + 4 or struct.unpack_from("<I", raw, n)[0] != zlib.crc32(raw[:n]):
            return None
        magic, *fields = _HEADER.unpack_from(raw)
        return cls(*fields) if magic == MAGIC else None

    def mismatch(self, layout: Layout, file_bytes: int) -> str:
        """Why a pool of ``layout`` cannot adopt this file ("" if it can)."""
        want = (FORMAT_VERSION, mmap.PAGESIZE, layout.pool_bytes, layout.chunk_bytes, layout.records_per_chunk,
                layout.data_offset)
        have = (self.version, self.page_size, self.pool_bytes, self.chunk_bytes, self.records_per_chunk,
                self.data_offset)
        names = ("format version", "page size", "pool size", "chunk size", "records per chunk", "data offset")
        for name, h, w in zip(names, have, want, strict=True):
            if h != w:
                shown = (exact_size(h), exact_size(w)) if name in ("pool size", "chunk size") else (h, w)
                return f"its {name} is {shown[0]}, this daemon's {shown[1]}"
        if file_bytes != layout.file_bytes:
            return f"it is {file_bytes} bytes long, not {layout.file_bytes}"
        return ""
