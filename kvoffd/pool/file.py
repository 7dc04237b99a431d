"""The pool's files: a pool that outlives the daemon (a restart, an upgrade, a crash).

Why files on a memory-backed filesystem (tmpfs or hugetlbfs) mapped MAP_SHARED, and not a memfd in
systemd's descriptor store: files work the same under systemd, in a container (a memory-backed
volume that outlives the container) and by hand, an operator can see them (``ls -l``, ``kvoffd doctor``)
and remove them, and nothing has to hand a descriptor over between two processes. Their pages belong
to the filesystem, so they survive the process that wrote them; a host reboot empties them.

The pool is a metadata file (``--pool-path``: header, namespace area, chunk map, slot records) and data
segment files beside it, each mapped MAP_FIXED into one reserved address range so that the pool is
one array to the rest of the daemon (kvoffd/pool/format.py says why segments: tmpfs allocates one
file on one thread at a time).

One daemon per pool: the daemon holds a ``flock`` of the metadata file, and opens, truncates and
writes only the segments named after that file's inode (``segment_path``), so the lock covers the
data too. Segments of other names at the path (another inode's, a previous larger pool's, the
pre-inode names) are only ever unlinked, which never changes a byte that a live daemon maps.

SIGBUS: a write to a tmpfs page the filesystem has no room for kills the writer. The data is therefore
allocated after checking the filesystem's free space, segment by segment by background threads
(``PoolFile.allocate``: zeros written into a fresh segment, ``posix_fallocate`` of one that may hold
adopted blocks; both fail with ENOSPC, never SIGBUS), and the pool hands out only chunks of the allocated prefix
(``Pool.set_allocated_bytes``), so no store can fault on a full filesystem and the daemon serves at
once whatever the pool size. If the room is not there the daemon keeps its pool in private memory
and says so in one line: it works, it just does not survive a restart.

The layout and header (``PoolLayout``, ``Header``) are in kvoffd/pool/format.py, which ``kvoffd doctor``
reads too; this module opens, locks, allocates and maps the files.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Callable

from kvoffd import libc
from kvoffd.pool.format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    Header,
    PoolLayout,
    fs_type,
    legacy_segment_path,
    segment_path,
    segments_mismatch,
)
from kvoffd.pool.private import reserve_private
from kvoffd.units import format_size

log = logging.getLogger(__name__)

MAP_FIXED = 0x10
# threads allocating segments: 8 reach 32-33 GiB/s on the H200 host (one: 7-9), more than the pinning
# threads touch, and the allocation ends early on in the pinning
ALLOCATE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


class PoolFileError(RuntimeError):
    """The pool cannot live in these files (the daemon then uses private memory and says why)."""


class PoolFile:
    """The open, locked, mapped pool. ``map``: the metadata file's mapping; ``data``: the pool's data
    (the segments side by side). ``previous``: the header found (None: made new or reset)."""

    def __init__(self, path: str, fd: int, mapping: mmap.mmap, data: mmap.mmap, layout: PoolLayout,
                 previous: Header | None, allocated: list[bool], inodes: list[int]):
        self.path, self.fd, self.map, self.data, self.layout = path, fd, mapping, data, layout
        self.previous = previous
        self.created = previous.adopted_from if previous else time.time()
        self.segment_allocated = allocated  # per segment: whole (posix_fallocate done, now or before)
        self.preexisting = list(allocated)  # per segment: allocated before this daemon (an adopted pool)
        self._partial = [0] * len(allocated)  # per segment being allocated: whole chunks done from its start
        self._inodes = inodes  # per segment, as mapped: a path replaced meanwhile is not allocated
        self.ino = os.fstat(fd).st_ino  # the metadata file's: the segments are named after it
        self.error = ""

    def segment_path(self, i: int) -> str:
        return segment_path(self.path, self.ino, i)

    @property
    def allocated(self) -> int:
        """Bytes of the data allocated from its start on, with no gap (what the pool may hand out): the
        whole segments, then the whole chunks done of the next one (so that a fresh pool takes stores a
        chunk after its start, not a segment after it)."""
        n = 0
        for i, whole in enumerate(self.segment_allocated):
            if not whole:
                return n + self._partial[i]
            n += self.layout.segment(i)[1]
        return n

    def allocate(self, on_progress: Callable[[int], None], stop: threading.Event,
                 before_step: Callable[[int], None] | None = None, threads: int = 1) -> None:
        """Allocate the segments not yet allocated, ``threads`` at a time in address order (each
        segment by one thread: no two threads share an inode lock), reporting the allocated prefix's
        bytes each time it grows, in order. ENOSPC (the filesystem filled meanwhile) stops it: the pool
        stays at the prefix allocated, with one error line. ``before_step(offset)``: run before each
        segment (a sharded pool moves the thread to the CPUs of the segment's NUMA node)."""
        todo = iter([i for i, whole in enumerate(self.segment_allocated) if not whole])
        lock = threading.Lock()
        reported = [self.allocated]

        def work() -> None:
            while not stop.is_set():
                with lock:
                    if self.error:
                        return
                    i = next(todo, None)
                if i is None:
                    return
                off, length = self.layout.segment(i)
                if before_step is not None:
                    before_step(off)

                def report(done: int, i: int = i) -> None:  # under ``lock``
                    self._partial[i] = done
                    now = self.allocated
                    if now > reported[0]:
                        reported[0] = now
                        on_progress(now)

                def stepped(done: int, i: int = i) -> None:
                    with lock:
                        report(done, i)

                why = self._allocate_segment(i, length, stepped)
                with lock:
                    if why:
                        if not self.error:
                            self.error = f"allocating the pool file stopped at {format_size(self.allocated)}: {why}"
                            log.error("%s; the pool stays at that size", self.error)
                        return
                    self.segment_allocated[i] = True
                    report(0)

        workers = [threading.Thread(target=work, name=f"kvoffd-allocate-{k}", daemon=True)
                   for k in range(max(1, min(threads, self.segment_allocated.count(False))))]
        for t in workers:
            t.start()
        for t in workers:
            t.join()

    def _allocate_segment(self, i: int, length: int, stepped: Callable[[int], None] | None = None) -> str:
        """Allocate segment ``i`` whole, a chunk at a time (``stepped(bytes done)`` after each); the reason
        when it could not be ("" when done)."""
        seg = self.segment_path(i)
        try:
            fd = os.open(seg, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            return f"{seg}: {e.strerror}"
        try:
            if os.fstat(fd).st_ino != self._inodes[i]:
                return f"{seg} was replaced while the daemon ran"
            step = self.layout.chunk_bytes
            if self.previous is None:
                write_zeros(fd, length, stepped, step)
            else:  # it may hold adopted blocks already: allocate around them
                for off in range(0, length, step):
                    os.posix_fallocate(fd, off, min(step, length - off))
                    if stepped is not None:
                        stepped(min(off + step, length))
        except OSError as e:
            return e.strerror or str(e)
        finally:
            os.close(fd)
        return ""

    def write_header(self) -> None:
        """Stamp the header (at start, every few seconds, at stop): ``updated`` says from when the
        blocks of an adopted pool are."""
        lay = self.layout
        h = Header(FORMAT_VERSION, mmap.PAGESIZE, lay.pool_bytes, lay.chunk_bytes, lay.records_per_chunk,
                   lay.meta_bytes, self.created, time.time(), self.created, os.getpid())
        raw = h.pack()
        self.map[:len(raw)] = raw

    def discard(self) -> None:
        """The start failed before the daemon served: a pool that holds nothing adopted (made or emptied
        by this start) leaves no file behind; one holding a previous daemon's blocks stays for the next
        start. Then unlocked."""
        if self.previous is None and self.fd >= 0:
            discard_files(self.path, self.ino, self.layout)
        self.close()

    def close(self) -> None:
        """Closes the descriptor (and with it the lock); the mappings belong to the pool and its keeper."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_pool_file(path: str, layout: PoolLayout, cold: bool) -> tuple[PoolFile, str]:
    """Open (or make) the pool's files, locked for this daemon alone. Returns the pool file and, when a
    previous pool was found and not adopted, the one line saying why. PoolFileError when it cannot be
    used."""
    kind = _check_dir(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise PoolFileError(f"cannot open {path}: {e.strerror}") from None
    seg_fds: list[int] = []
    emptied = False  # the lock is ours and the file holds nothing any daemon would adopt
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PoolFileError(f"{path} is in use by another kvoffd (give each daemon its own --pool-path)") from None
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PoolFileError(f"{path} is not a 0600 file of this user (uid {st.st_uid}, mode "
                                f"{st.st_mode & 0o777:o}); remove it or choose another --pool-path")
        previous, why = _read_previous(fd, st.st_size, path, st.st_ino, layout)
        if cold and previous is not None:
            previous, why = None, "--cold"
        if previous is None:
            emptied = True
            os.ftruncate(fd, 0)  # an empty pool of this layout: every old page (and record) dropped
            os.ftruncate(fd, layout.meta_bytes)
        else:
            _rename_legacy_segments(path, st.st_ino, layout)
        seg_fds = _open_segments(path, st.st_ino, layout, fresh=previous is None)
        _remove_stale_segments(path, st.st_ino, layout)
        allocated = [previous is not None and os.fstat(f).st_blocks * 512 >= layout.segment(i)[1]
                     for i, f in enumerate(seg_fds)]
        _allocate_meta(fd, seg_fds, path, layout, kind, fresh=previous is None)
        inodes = [os.fstat(f).st_ino for f in seg_fds]
        mapping, data = _map(fd, seg_fds, path, st.st_ino, layout, fresh=previous is None)
    except BaseException:
        if emptied:  # a pool no one will use: its files go (a failed start leaves no file behind)
            discard_files(path, os.fstat(fd).st_ino, layout)
        os.close(fd)
        raise
    finally:
        for f in seg_fds:
            os.close(f)
    return PoolFile(path, fd, mapping, data, layout, previous, allocated, inodes), why


def discard_files(path: str, ino: int, layout: PoolLayout) -> None:
    """Unlink a pool's files: the segments named after the metadata inode ``ino`` and the metadata file
    if it is still that inode. Only while holding its lock, for a pool that holds nothing any daemon
    would adopt (made or emptied by this start). A daemon still mapping them keeps its pages until it
    exits; the memory goes back then."""
    for p in [segment_path(path, ino, i) for i in range(layout.num_segments)] + [path]:
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and (p != path or st.st_ino == ino):
                os.unlink(p)
        except OSError:
            pass  # gone already, or not this user's to remove


ZEROS = bytes(8 << 20)


def write_zeros(fd: int, length: int, stepped: Callable[[int], None] | None = None, step: int = 0) -> None:
    """Allocate a fresh segment by writing zeros (ENOSPC, never SIGBUS). Why not ``posix_fallocate``:
    tmpfs allocates without zeroing and leaves each page to be zeroed at its first fault, one 4 KiB
    fault at a time (~1.2 GiB/s a thread), and the kernel's fault-around skips such pages; written
    pages are whole, so the pinning threads map them 64 KiB per fault. Writing and then touching runs
    at twice the speed of allocating and then faulting (2.1-2.3 against 1.1-1.2 GiB/s on one thread,
    2-core VM). ``os.pwrite`` releases the GIL. Only for a segment nothing was written to: the pool hands
    out no chunk beyond the allocated prefix (``Pool.set_allocated_bytes``), and a segment that may
    hold adopted blocks is fallocated instead. ``stepped(bytes done)``: after each whole ``step``."""
    for off in range(0, length, len(ZEROS)):
        n = min(len(ZEROS), length - off)
        if os.pwrite(fd, ZEROS if n == len(ZEROS) else ZEROS[:n], off) != n:
            raise OSError(errno.ENOSPC, "short write: the filesystem is full")
        if stepped is not None and step and (off + n) // step > off // step:
            stepped((off + n) // step * step)


def _check_dir(path: str) -> str:
    d = os.path.dirname(path) or "."
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        kind = fs_type(d)
    except OSError as e:
        raise PoolFileError(f"cannot use {d} for the pool: {e.strerror}") from None
    if kind == "other":
        raise PoolFileError(f"{d} is not memory-backed (tmpfs or hugetlbfs): a pool there would be written to "
                            "disk; use /dev/shm or a tmpfs mount for --pool-path")
    return kind


def _read_previous(fd: int, size: int, path: str, ino: int, layout: PoolLayout) -> tuple[Header | None, str]:
    if size == 0:
        return None, ""
    head = Header.unpack(os.pread(fd, HEADER_BYTES, 0))
    if head is None:
        return None, "its header is not a kvoffd pool header (damaged or another format)"
    why = head.mismatch(layout, size) or segments_mismatch(path, ino, layout)
    return (None, why) if why else (head, "")


def _rename_legacy_segments(path: str, ino: int, layout: PoolLayout) -> None:
    """An adopted pool's segments that still have their pre-inode names get their names (the lock on
    the metadata file is held, and its header and segments were found to be this pool's)."""
    for i in range(layout.num_segments):
        seg, legacy = segment_path(path, ino, i), legacy_segment_path(path, i)
        if not os.path.lexists(seg) and os.path.lexists(legacy):
            os.rename(legacy, seg)


def _remove_stale_segments(path: str, ino: int, layout: PoolLayout) -> None:
    """Unlink the segment files at ``path`` that are not this pool's: another metadata inode's (a
    metadata file removed and made again; a daemon still mapping them keeps its pages), the pre-inode
    names, a previous larger pool's. A pool file is RAM until someone deletes it."""
    d, base = os.path.split(path)
    name = re.compile(re.escape(base) + r"\.(?:ino(\d+)\.)?(\d{4})")
    removed = 0
    with os.scandir(d or ".") as entries:
        for entry in entries:
            m = name.fullmatch(entry.name)
            if m is None or (m.group(1) is not None and int(m.group(1)) == ino
                             and int(m.group(2)) < layout.num_segments):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if entry.is_file(follow_symlinks=False) and st.st_uid == os.getuid():
                    os.unlink(entry.path)
                    removed += st.st_blocks * 512
            except OSError:
                continue
    if removed:
        log.info("removed %s of data segments at %s that were not this pool's", format_size(removed), path)


def _open_segments(path: str, ino: int, layout: PoolLayout, fresh: bool) -> list[int]:
    """Each data segment's descriptor, made (or emptied) to its length when ``fresh``. Every one must be
    a 0600 regular file of this user."""
    fds: list[int] = []
    try:
        for i in range(layout.num_segments):
            seg = segment_path(path, ino, i)
            try:
                f = os.open(seg, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as e:
                raise PoolFileError(f"cannot open the pool's data segment {seg}: {e.strerror}") from None
            fds.append(f)
            st = os.fstat(f)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PoolFileError(f"{seg} is not a 0600 file of this user; remove it or choose another --pool-path")
            if fresh:
                os.ftruncate(f, 0)
                os.ftruncate(f, layout.segment(i)[1])
    except BaseException:
        for f in fds:
            os.close(f)
        raise
    return fds


def _allocate_meta(fd: int, seg_fds: list[int], path: str, layout: PoolLayout, kind: str, fresh: bool) -> None:
    """Check there is room for every file and allocate the metadata. A pool just made is given back
    (truncated here, its files removed by ``open_pool_file``) when there is no room; a previous pool is
    left for a daemon that has room."""
    st = os.fstatvfs(fd)
    free = st.f_bavail * st.f_frsize
    have = os.fstat(fd).st_blocks * 512 + sum(os.fstat(f).st_blocks * 512 for f in seg_fds)
    need = layout.total_bytes - have
    try:
        if need > free:
            raise PoolFileError(f"{os.path.dirname(path)} ({kind}) has {format_size(free)} free, the pool needs "
                                f"{format_size(need)} more; enlarge it (e.g. a bigger /dev/shm) or lower --pool-size")
        try:
            os.posix_fallocate(fd, 0, layout.meta_bytes)
        except OSError as e:
            why = "the filesystem is full" if e.errno == errno.ENOSPC else e.strerror
            raise PoolFileError(f"cannot allocate the {format_size(layout.total_bytes)} pool {path}: {why}") from None
    except PoolFileError:
        if fresh:
            _give_back(fd, seg_fds)
        raise


def _map(fd: int, seg_fds: list[int], path: str, ino: int, layout: PoolLayout,
         fresh: bool) -> tuple[mmap.mmap, mmap.mmap]:
    """The metadata's mapping, and the data's: one reserved range with each segment mapped over its part."""
    try:
        meta = mmap.mmap(fd, layout.meta_bytes, flags=mmap.MAP_SHARED)
        data = reserve_private(layout.pool_bytes, noreserve=True)
    except (OSError, MemoryError) as e:
        if fresh:
            _give_back(fd, seg_fds)
        raise PoolFileError(f"cannot map the {format_size(layout.total_bytes)} pool {path}: {e}") from None
    base = ctypes.addressof(ctypes.c_char.from_buffer(data))
    for i, f in enumerate(seg_fds):
        off, length = layout.segment(i)
        try:
            map_fixed(base + off, length, f)
        except OSError as e:
            meta.close()
            data.close()
            if fresh:
                _give_back(fd, seg_fds)
            raise PoolFileError(f"cannot map data segment {segment_path(path, ino, i)}: {e.strerror}") from None
    return meta, data


def map_fixed(addr: int, length: int, fd: int) -> None:
    """Map ``fd`` (from its start) shared over ``[addr, addr + length)`` of a range reserved already."""
    got = libc.mmap(addr, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _give_back(fd: int, seg_fds: list[int]) -> None:
    """A pool made for nothing: its memory goes back to the filesystem."""
    for f in (fd, *seg_fds):
        os.ftruncate(f, 0)
