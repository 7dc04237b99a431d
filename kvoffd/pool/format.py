"""The pool's geometry and its file's format: what the daemon (kvoffd/pool/allocator.py,
kvoffd/pool/file.py) and ``kvoffd doctor`` (kvoffd/ops/doctor_pool.py) both read.

Pure definitions (the standard library and the shared places of kvoffd_client.paths): ops reaches the
daemon only through the client library (the import contract of pyproject.toml), yet the doctor must
tell an operator, with no daemon running, whether a ``--pool-size`` is one the pool serves and what
an existing pool file holds. So the sizes and the file's layout and header live here, once.

The pool (one ``PoolLayout``) is a metadata file and data segment files beside it. The metadata file
(``--pool-path``): a 4 KiB header, two namespace-table areas (kvoffd/cache/restart/records.py), the chunk
table, the slot records. The data: ``segment_bytes`` segments (1 GiB, more for pools over 1 TiB), each
its own file ``<path>.ino<N>.0000``, ``<path>.ino<N>.0001``... mapped side by side into one address
range. The header says what made the pool (format version, pool and chunk sizes, page size, records
per chunk); an adopter that finds anything else, or a segment missing or of another size, starts cold.

Why the segments carry the metadata file's inode number ``N``: the daemon's lock is a ``flock`` of the
metadata file, and the lock must cover the data too. A metadata file removed under a live daemon and
made again by the next one is another inode, so the next daemon's segments are other files: it never
truncates or writes the segments a live daemon maps (which would zero them and put its own blocks
under the live daemon's entries: wrong bytes served). An inode number is not reused while the
live daemon holds its file open. Segments named ``<path>.0000`` (before the inode was in the name) are
renamed by the daemon that adopts them.

Why segments and not one file: tmpfs allocates a file's pages under that file's inode lock, so one
file is allocated by one thread at a time (``posix_fallocate`` 7-9 GiB/s on the H200 host), and page
faults on a file while it is being allocated contend with the allocation (2.9 GiB/s end to end).
Separate files allocate in parallel (8 threads: 32-33 GiB/s, ``bench/pool_pin.py``), and each segment
is touched and pinned after its own allocation, so a fresh pool file pins as fast as private memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import stat
import struct
import zlib
from dataclasses import dataclass

from kvoffd import libc
from kvoffd_client.paths import runtime_dir

DEFAULT_CHUNK = 64 << 20
# Smallest block (slot) the daemon accepts at REGISTER. The index spends about half a KiB of Python
# objects per resident block (entry, key, dict and LRU slots); below 256 bytes a block would cost
# more to remember than to hold. Real vLLM blocks are KiBs to MiBs; tests and trace replays that
# want many small blocks use 256-byte ones (8 keys' worth of bytes).
MIN_SLOT_BYTES = 256

# the pool file
FORMAT_VERSION = 2  # 2: the data in segment files (1: after the metadata, in one file)
MAGIC = b"KVOFFDPL"
HEADER_BYTES = 4096
NS_AREA_BYTES = 256 << 10  # one copy of the namespace area (there are two: one is always whole)
RECORD_BYTES = 64
RECORDS_PER_CHUNK = 4096  # slots of >= chunk/4096 (16 KiB in 64 MiB chunks) are all persisted
SEGMENT_BYTES = 1 << 30  # a data segment file (larger for pools of more than MAX_SEGMENTS GiB)
MAX_SEGMENTS = 1024
# statfs f_type of the filesystems whose pages are memory: tmpfs/shmem, hugetlbfs, ramfs
MEMORY_FS = {0x01021994: "tmpfs", 0x958458F6: "hugetlbfs", 0x858458F6: "ramfs"}
_HEADER = struct.Struct("<8sIIQQIQdddQ")  # magic, version, page, pool, chunk, records/chunk, meta bytes,
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
    if libc.statfs(os.fsencode(path), buf) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), path)
    return MEMORY_FS.get(ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF, "other")


SHM_DIR = "/dev/shm"
POOL_NAME = "kvoffd.pool"
RANDOM_PART = "XXXXXXXX"  # how a directory not made yet is shown: the daemon names it at random


def pool_socket_dir(address: str) -> str:
    """The daemon's private directory for ``address``: the ipc socket's, else the runtime directory."""
    return (os.path.dirname(address[6:]) or ".") if address.startswith("ipc://") else runtime_dir()


def shm_pool_prefix(address: str) -> str:
    """``kvoffd-<uid>-<address hash>``: how this daemon's pool directories in /dev/shm begin (the
    rest of each name is random, made by the daemon: a name another user could guess is never used)."""
    return f"kvoffd-{os.getuid()}-{hashlib.sha256(address.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class ShmPlaces:
    """The entries of /dev/shm named for one address: ``ours``, directories of this user that no one else
    can write (where its pool lives); ``foreign``, (path, owner) of entries that are not (another user
    made them, or can write them): never used; ``legacy``, the file the pool was kept in before its
    directory (``/dev/shm/kvoffd-<uid>-<address hash>.pool``), if that exists."""

    ours: tuple[str, ...]
    foreign: tuple[tuple[str, int], ...]
    legacy: str


def shm_pool_places(address: str) -> ShmPlaces:
    prefix = shm_pool_prefix(address)
    ours: list[str] = []
    foreign: list[tuple[str, int]] = []
    legacy = ""
    try:
        with os.scandir(SHM_DIR) as entries:
            for e in entries:
                if not (e.name.startswith(prefix + "-") or e.name == prefix + ".pool"):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if e.name == prefix + ".pool":
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
                        legacy = e.path
                    else:
                        foreign.append((e.path, st.st_uid))
                elif stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
                    ours.append(e.path)
                else:
                    foreign.append((e.path, st.st_uid))
    except OSError:
        pass
    return ShmPlaces(tuple(sorted(ours)), tuple(sorted(foreign)), legacy)


def pool_written(path: str) -> float:
    """When the pool file at ``path`` was last written, from its header (-1: no pool there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return -1.0
    try:
        head = Header.unpack(os.pread(fd, HEADER_BYTES, 0))
    except OSError:
        head = None
    finally:
        os.close(fd)
    return head.updated if head is not None else 0.0


def pool_beside_socket(address: str) -> str:
    """``kvoffd.pool`` in the socket's directory if a pool of this user is there (where kvoffd kept it
    by default when that directory is memory-backed, before the pool had a directory of its own in
    /dev/shm), else ""."""
    path = os.path.join(pool_socket_dir(address), POOL_NAME)
    try:
        st = os.lstat(path)
        memory = fs_type(os.path.dirname(path)) != "other"
    except OSError:
        return ""
    return path if memory and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() else ""


def default_pool_path(address: str) -> str:
    """Where the daemon of ``address`` keeps its pool when --pool-path is not given (read only: the
    daemon makes the directory, kvoffd/runtime.py ``ensure_default_pool_path``). ``kvoffd.pool`` in a
    directory of its own under /dev/shm, ``kvoffd-<uid>-<address hash>-<random>``, 0700: memory-backed
    and large (half the RAM by default), kept across restarts and ``systemctl stop`` (not a reboot), and
    out of other users' reach: they can create names in /dev/shm but not guess a random one, and
    entries of theirs are never used (a file another user made at a predictable name would send the
    pool to private memory at every start: kvoffd/pool/place.py). A pool already kept beside the
    socket by an older kvoffd stays there. A directory not made yet shows as ``...-XXXXXXXX``."""
    beside = pool_beside_socket(address)
    if beside:
        return beside
    places = shm_pool_places(address)
    if places.ours:
        return os.path.join(newest_pool_dir(places.ours), POOL_NAME)
    return os.path.join(SHM_DIR, f"{shm_pool_prefix(address)}-{RANDOM_PART}", POOL_NAME)


def newest_pool_dir(dirs: tuple[str, ...] | list[str]) -> str:
    """Of several pool directories, the one whose pool was written last (ties: the first)."""
    return max(dirs, key=lambda d: pool_written(os.path.join(d, POOL_NAME)))


@dataclass(frozen=True)
class PoolLayout:
    """Where each part of the file lies, for a pool of ``pool_bytes`` in ``chunk_bytes`` chunks."""

    pool_bytes: int
    chunk_bytes: int
    records_per_chunk: int

    @classmethod
    def of(cls, pool_bytes: int, chunk_bytes: int) -> PoolLayout:
        return cls(pool_bytes, chunk_bytes, min(RECORDS_PER_CHUNK, chunk_bytes // MIN_SLOT_BYTES))

    @property
    def num_chunks(self) -> int:
        return self.pool_bytes // self.chunk_bytes

    ns_offset = HEADER_BYTES

    @property
    def chunks_offset(self) -> int:
        """The chunk map: one 64-bit word per chunk, the slot size of its sealed records."""
        return HEADER_BYTES + 2 * NS_AREA_BYTES

    @property
    def records_offset(self) -> int:
        return self.chunks_offset + -(-self.num_chunks * 8 // 4096) * 4096

    @property
    def num_records(self) -> int:
        return self.num_chunks * self.records_per_chunk

    @property
    def meta_bytes(self) -> int:
        """The metadata file's length (header, namespace area, chunk map, records), whole pages."""
        end = self.records_offset + self.num_records * RECORD_BYTES
        return -(-end // 4096) * 4096

    @property
    def segment_bytes(self) -> int:
        """Bytes of each data segment file (the last may be shorter): 1 GiB, or enough whole chunks that
        the pool needs at most MAX_SEGMENTS files."""
        want = max(min(SEGMENT_BYTES, self.pool_bytes), -(-self.pool_bytes // MAX_SEGMENTS))
        return -(-want // self.chunk_bytes) * self.chunk_bytes

    @property
    def num_segments(self) -> int:
        return -(-self.pool_bytes // self.segment_bytes)

    def segment(self, i: int) -> tuple[int, int]:
        """(offset in the pool, length) of data segment ``i``."""
        off = i * self.segment_bytes
        return off, min(self.segment_bytes, self.pool_bytes - off)

    @property
    def total_bytes(self) -> int:
        """Everything the pool's files hold once allocated."""
        return self.meta_bytes + self.pool_bytes


def segment_path(path: str, ino: int, i: int) -> str:
    """Data segment ``i`` of the pool whose metadata file is ``path``, of inode ``ino``."""
    return f"{path}.ino{ino}.{i:04d}"


def legacy_segment_path(path: str, i: int) -> str:
    """Data segment ``i``'s name before the metadata's inode was in it (renamed at adoption)."""
    return f"{path}.{i:04d}"


def adoptable_segment_path(path: str, ino: int, i: int) -> str:
    """The file an adopter takes as segment ``i``: its name, or its legacy name where only that exists."""
    seg, legacy = segment_path(path, ino, i), legacy_segment_path(path, i)
    return legacy if not os.path.lexists(seg) and os.path.lexists(legacy) else seg


def segments_mismatch(path: str, ino: int, layout: PoolLayout) -> str:
    """Why the data segments of the metadata file ``path`` (inode ``ino``) cannot be adopted by a pool of
    ``layout`` ("" if they can): each must be a 0600 regular file of this user, of its segment's length."""
    for i in range(layout.num_segments):
        seg = adoptable_segment_path(path, ino, i)
        try:
            st = os.lstat(seg)
        except OSError as e:
            return f"its data segment {os.path.basename(seg)} cannot be examined ({e.strerror})"
        length = layout.segment(i)[1]
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return f"its data segment {os.path.basename(seg)} is not a 0600 file of this user"
        if st.st_size != length:
            return f"its data segment {os.path.basename(seg)} is {st.st_size} bytes long, not {length}"
    return ""


def allocated_bytes(path: str, layout: PoolLayout) -> int:
    """Bytes of the pool's files (metadata and segments) that their filesystem has allocated already,
    counting only files of the right length (what a daemon of ``layout`` would keep)."""
    total = 0
    try:
        ino = os.lstat(path).st_ino
    except OSError:
        return 0
    for p, length in [(path, layout.meta_bytes)] + [(adoptable_segment_path(path, ino, i), layout.segment(i)[1])
                                                      for i in range(layout.num_segments)]:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size == length:
            total += min(st.st_blocks * 512, length)
    return total


@dataclass(frozen=True)
class Header:
    version: int
    page_size: int
    pool_bytes: int
    chunk_bytes: int
    records_per_chunk: int
    meta_bytes: int
    created: float
    updated: float
    adopted_from: float  # when the pool's first daemon created it (survives adoptions)
    pid: int

    def pack(self) -> bytes:
        body = _HEADER.pack(MAGIC, self.version, self.page_size, self.pool_bytes, self.chunk_bytes,
                            self.records_per_chunk, self.meta_bytes, self.created, self.updated,
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

    def mismatch(self, layout: PoolLayout, file_bytes: int) -> str:
        """Why a pool of ``layout`` cannot adopt this metadata file ("" if it can; the segments are
        checked by their opener)."""
        want = (FORMAT_VERSION, mmap.PAGESIZE, layout.pool_bytes, layout.chunk_bytes, layout.records_per_chunk,
                layout.meta_bytes)
        have = (self.version, self.page_size, self.pool_bytes, self.chunk_bytes, self.records_per_chunk,
                self.meta_bytes)
        names = ("format version", "page size", "pool size", "chunk size", "records per chunk", "metadata size")
        for name, h, w in zip(names, have, want, strict=True):
            if h != w:
                shown = (exact_size(h), exact_size(w)) if name in ("pool size", "chunk size") else (h, w)
                return f"its {name} is {shown[0]}, this daemon's {shown[1]}"
        if file_bytes != layout.meta_bytes:
            return f"it is {file_bytes} bytes long, not {layout.meta_bytes}"
        return ""
