"""The pool's file: a pool that outlives the daemon (a restart, an upgrade, a crash).

Why a file on a memory-backed filesystem (tmpfs or hugetlbfs) mapped MAP_SHARED, and not a memfd in
systemd's descriptor store: a file works the same under systemd, in a container (a memory-backed
volume that outlives the container) and by hand, an operator can see it (``ls -l``, ``kvoffd doctor``)
and remove it, and nothing has to hand a descriptor over between two processes. Its pages belong to
the filesystem, so they survive the process that wrote them; a host reboot empties them.

SIGBUS: a write to a tmpfs page the filesystem has no room for kills the writer. The file is
therefore allocated (``posix_fallocate``) after checking the filesystem's free space: the header and
metadata at once, the data in 1 GiB steps by a background thread (``PoolFile.allocate``; tmpfs zeroes
each page, ~1.3 GB/s on the VM, so 8 GiB took 6 s in one call), and the pool hands out only chunks
already allocated (``Pool.set_allocated_bytes``), so no store can fault on a full filesystem and the
daemon serves at once whatever the pool size. If the room is not there the daemon keeps its pool in
private memory and says so in one line: it works, it just does not survive a restart.

The file's layout and header (``Layout``, ``Header``) are in kvoffd/pool_format.py, which
``kvoffd doctor`` reads too; this module opens, locks, allocates and maps the file.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

from kvoffd.config import format_size
from kvoffd.pool_format import FORMAT_VERSION, HEADER_BYTES, Header, Layout, fs_type

log = logging.getLogger(__name__)

ALLOCATE_STEP = 1 << 30  # the data region is allocated in steps of this (a chunk multiple)


class PoolFileError(RuntimeError):
    """The pool cannot live in this file (the daemon then uses private memory and says why)."""


class PoolFile:
    """The open, locked, mapped file. ``previous`` is the header found (None: made new or reset)."""

    def __init__(self, path: str, fd: int, mapping: mmap.mmap, layout: Layout, previous: Header | None,
                 allocated: int):
        self.path, self.fd, self.map, self.layout, self.previous = path, fd, mapping, layout, previous
        self.created = previous.adopted_from if previous else time.time()
        self.allocated = allocated  # bytes of the data region allocated so far (``allocate``)
        self.error = ""

    def allocate(self, on_progress: Callable[[int], None], stop: threading.Event,
                 before_step: Callable[[int], None] | None = None) -> None:
        """Allocate the rest of the data region in steps (a thread's work), reporting the bytes of
        data allocated after each. ENOSPC (the filesystem filled meanwhile) stops it: the pool then
        stays at what was allocated, with one error line. ``before_step(data offset)``: a hook run
        before each step (a sharded pool moves the thread to the CPUs of the step's NUMA node)."""
        lay = self.layout
        while self.allocated < lay.pool_bytes and not stop.is_set():
            n = min(ALLOCATE_STEP, lay.pool_bytes - self.allocated)
            if before_step is not None:
                before_step(self.allocated)
            try:
                os.posix_fallocate(self.fd, lay.data_offset + self.allocated, n)
            except OSError as e:
                self.error = f"allocating the pool file stopped at {format_size(self.allocated)}: {e.strerror}"
                log.error("%s; the pool stays at that size", self.error)
                return
            self.allocated += n
            on_progress(self.allocated)

    def write_header(self) -> None:
        """Stamp the header (at start, every few seconds, at stop): ``updated`` says from when the
        blocks of an adopted pool are."""
        lay = self.layout
        h = Header(FORMAT_VERSION, mmap.PAGESIZE, lay.pool_bytes, lay.chunk_bytes, lay.records_per_chunk,
                   lay.data_offset, self.created, time.time(), self.created, os.getpid())
        raw = h.pack()
        self.map[:len(raw)] = raw

    def close(self) -> None:
        """Closes the descriptor (and with it the lock); the mapping belongs to the pool."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_pool_file(path: str, layout: Layout, cold: bool) -> tuple[PoolFile, str]:
    """Open (or make) the pool file, locked for this daemon alone. Returns it and, when a previous
    pool was found and not adopted, the one line saying why. PoolFileError when it cannot be used."""
    kind = _check_dir(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise PoolFileError(f"cannot open {path}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PoolFileError(f"{path} is in use by another kvoffd (give each daemon its own --pool-path)") from None
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PoolFileError(f"{path} is not a 0600 file of this user (uid {st.st_uid}, mode "
                                f"{st.st_mode & 0o777:o}); remove it or choose another --pool-path")
        previous, why = _read_previous(fd, st.st_size, layout)
        if cold and previous is not None:
            previous, why = None, "--cold"
        if previous is None:
            os.ftruncate(fd, 0)  # an empty pool of this layout: every old page (and record) dropped
            os.ftruncate(fd, layout.file_bytes)
        allocated = layout.pool_bytes if st.st_blocks * 512 >= layout.file_bytes and previous else 0
        if not allocated:
            _allocate(fd, path, layout, kind, fresh=previous is None)  # the metadata; the data: PoolFile.allocate
        try:
            mapping = mmap.mmap(fd, layout.file_bytes, flags=mmap.MAP_SHARED)
        except OSError as e:
            if previous is None:
                os.ftruncate(fd, 0)  # made for nothing: give the memory back
            raise PoolFileError(f"cannot map the {format_size(layout.file_bytes)} pool file {path}: {e.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return PoolFile(path, fd, mapping, layout, previous, allocated), why


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


def _read_previous(fd: int, size: int, layout: Layout) -> tuple[Header | None, str]:
    if size == 0:
        return None, ""
    head = Header.unpack(os.pread(fd, HEADER_BYTES, 0))
    if head is None:
        return None, "its header is not a kvoffd pool header (damaged or another format)"
    why = head.mismatch(layout, size)
    return (None, why) if why else (head, "")


def _allocate(fd: int, path: str, layout: Layout, kind: str, fresh: bool) -> None:
    """Check there is room for the whole file and allocate its metadata. A file just made is given
    back (truncated) when there is no room; a previous pool is left for a daemon that has room."""
    st = os.fstatvfs(fd)
    free = st.f_bavail * st.f_frsize
    need = layout.file_bytes - os.fstat(fd).st_blocks * 512
    if need > free:
        if fresh:
            os.ftruncate(fd, 0)
        raise PoolFileError(f"{os.path.dirname(path)} ({kind}) has {format_size(free)} free, the pool file needs "
                            f"{format_size(need)} more; enlarge it (e.g. a bigger /dev/shm) or lower --pool-size")
    try:
        os.posix_fallocate(fd, 0, layout.data_offset)
    except OSError as e:
        if fresh:
            os.ftruncate(fd, 0)
        why = "the filesystem is full" if e.errno == errno.ENOSPC else e.strerror
        raise PoolFileError(f"cannot allocate the {format_size(layout.file_bytes)} pool file {path}: {why}") from None
