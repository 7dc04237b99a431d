"""The disk tier's index file: read into private memory once, written back a page at a time with
``pwrite`` by one thread. Never a mapping of the file.

Why not a shared mapping of the file: a store into a page of a sparse file mapping allocates that page
when it faults, and on a full file system the kernel has nothing to answer with but SIGBUS, which
kills the daemon (at the first spill on a full disk, then at every restart before it serves);
a truncation of the file under the daemon does the same at its next access, in Python or in the
compiled probe. Here the index lives in anonymous memory (``IndexFile.image``: the file's bytes, header
included), the file's space is reserved when the file is made (``posix_fallocate``: no room, and that
block size is refused with one log line), and changes reach the file as ``pwrite``s of whole pages: a
full, truncated or failing file is a counted write error and a colder restart, never a signal.

What is written: the index tells ``changed`` the records it wrote (after writing them); one writer
thread takes the pages they lie on, copies them out of the image and writes them. The copy is made
with the GIL held (the compiled ``write_pages``, a chunk of pages per hold, the writes without it; or
``bytes`` of a memoryview per run of pages), so it sees the loop's numpy statements either done or,
for at most one of them, in progress; the index's rule (a record's ``tid`` is written last, a
removal clears ``tid`` alone) makes every record of such a copy either invisible, or whole, or a
record whose checksum then fails: what a SIGKILL at any moment left in the old file mapping too. A
page written after a change always follows it, so the file catches up with the memory; ``mark`` and
``wait`` let a spill's data write wait until the removal of the record that named its slot is out
(kvoffd/cache/tiers/disk.py: a SIGKILL mid-spill leaves the old record gone). A file found shorter than
it was made (truncated under the daemon) is written whole again from memory, with one log line.

What a SIGKILL can lose: the changes of the last moments that the writer had not written yet (it runs
as soon as told, so milliseconds' worth): spills landed but not found after the restart (misses), or a
record still naming a slot rewritten since (its checksum fails: a miss). Never a wrong byte.

Layout (unchanged): a 64-byte header (magic, capacity), then ``capacity`` records of ``RECORD``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvoffd.cache.tiers.diskio import open_own

try:  # the compiled writer (kvoffd/cache/tiers/_probe.c ``write_pages``); without it, the same in Python
    from kvoffd.cache.tiers import _probe
except ImportError:
    _probe = None

log = logging.getLogger(__name__)

RECORD = np.dtype([("k", "<u8", (4,)), ("tid", "<u4"), ("slot", "<u4"), ("crc", "<u4")])
HEADER = 64
MAGIC = b"KVOFFTB2"
PAGE = 4096
RUN_PAGES = 16  # pages per copy and write in Python: 64 KiB, a few microseconds of GIL per copy
RUN_PAGES_C = 1024  # pages per copy in the compiled writer: 4 MiB, ~0.5 ms of GIL, then the writes without it
READ_CHUNK = 64 << 20  # bytes per read at open
# A woken writer waits this long before it takes the pages: the loop's batch (a spill's removals, then
# its inserts) goes on without the writer asking for the GIL in its middle, and one pass writes it all.
# Measured on the 2-core VM (1,024 inserts and removals into a 1M-block index): the loop's p90 2-5 ms
# with no writer, 10-19 ms with a writer woken at once, 2.5-7.6 ms with this wait.
GATHER_S = 0.002
_NOT_SUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def anonymous(nbytes: int) -> np.ndarray:
    """Zeroed private memory for a big array, in transparent huge pages where the kernel allows
    (madvise mode): the index is read at random, one or two TLB entries per 2 MiB, not 512."""
    if nbytes < 2 << 20:
        return np.zeros(nbytes, dtype=np.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE here: 4 KiB pages, still correct
        mm.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mm, dtype=np.uint8)


def file_bytes(cap: int) -> int:
    return HEADER + cap * RECORD.itemsize


def header_of(cap: int) -> bytes:
    return MAGIC + cap.to_bytes(8, "little") + bytes(HEADER - 16)


class Damaged(ValueError):
    """An index file that cannot be what it claims (no magic, a size its header contradicts, short)."""


def _read_into(fd: int, buf: np.ndarray, name: str) -> None:
    mv = memoryview(buf)
    for lo in range(0, len(buf), READ_CHUNK):
        hi = min(len(buf), lo + READ_CHUNK)
        n = os.preadv(fd, [mv[lo:hi]], lo)
        if n != hi - lo:
            raise Damaged(f"{name}: short read ({lo + n} of {len(buf)} bytes)")


def read_header(fd: int, name: str) -> int:
    """The capacity an index file's header states, checked against the file's size."""
    head = os.pread(fd, 16, 0)
    if len(head) < 16 or head[:8] != MAGIC:
        raise Damaged(f"{name} is not a kvoffd disk index")
    cap = int.from_bytes(head[8:16], "little")
    size = os.fstat(fd).st_size
    if not 0 < cap < (1 << 40) or size != file_bytes(cap):
        raise Damaged(f"{name}: its header says {cap} records, its size is {size} bytes")
    return cap


def read_live(name: str, dir_fd: int | None, limit: int) -> np.ndarray:
    """The live records (at most ``limit``) of the index file ``name``, read a chunk at a time (an
    import: ``--disk-size`` changed). Raises ``Damaged`` or OSError for a file that cannot be read."""
    fd = open_own(name, dir_fd, os.O_RDONLY)
    try:
        cap = read_header(fd, name)
        per = max(1, READ_CHUNK // RECORD.itemsize)
        out: list[np.ndarray] = []
        got = 0
        for lo in range(0, cap, per):
            n = min(per, cap - lo)
            chunk = np.empty(n, dtype=RECORD)
            raw = chunk.view(np.uint8)
            if os.preadv(fd, [memoryview(raw)], HEADER + lo * RECORD.itemsize) != raw.nbytes:
                raise Damaged(f"{name}: short read")
            live = chunk[chunk["tid"] != 0]
            out.append(live[:limit - got])
            got += len(out[-1])
            if got >= limit:
                break
        return np.concatenate(out) if out else np.zeros(0, dtype=RECORD)
    finally:
        os.close(fd)


@dataclass
class Opened:
    """What ``IndexFile.open`` found: the file, and why it was started over ("" when found whole)."""

    file: IndexFile
    note: str = ""


class IndexFile:
    """One index file and its writer thread; ``records`` are the index's records, in private memory."""

    def __init__(self, fd: int, image: np.ndarray, name: str):
        self.fd = fd
        self.name = name
        self.image = image
        self.records = image[HEADER:].view(RECORD)
        self._mv = memoryview(image)
        self.write_errors = 0
        self.first_error = ""
        self.rewrites = 0  # times the file was found truncated and written whole again
        # Whether the file system shows the file wholly allocated (it was reserved, or written whole):
        # then a hole in it, which a truncation followed by one of our writes past it leaves, is seen
        # too (not on a file system that stores zeros in no blocks, which never looks whole).
        self._dense = self._allocated(fd) >= len(image)
        self._scratch = bytearray(RUN_PAGES_C * PAGE) if _probe is not None else None
        self._pending: list[np.ndarray] = []  # pages changed since the writer last took them (the loop appends)
        self._gen = 0  # changes told (the loop)
        self._done = 0  # changes written through (the writer)
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvoffd-index-writer", daemon=True)
        self._thread.start()

    # --- opening -------------------------------------------------------------------------------------
    @classmethod
    def open(cls, name: str, dir_fd: int | None, cap: int) -> Opened:
        """The index file ``name`` (under ``dir_fd``) for ``cap`` records: read whole into memory when
        it is one of this capacity; another capacity is moved to ``name.old`` (for the index to
        import); a damaged one is started over (the note says why). A new file's space is reserved
        at once: OSError when it cannot be (ENOSPC), and no file is left."""
        size = file_bytes(cap)
        note = ""
        try:
            fd = open_own(name, dir_fd, os.O_RDWR)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                found = read_header(fd, name)
                if found == cap:
                    image = anonymous(size)
                    _read_into(fd, image, name)
                    _reserve(fd, size, name)  # a file of an older daemon may be sparse
                    return Opened(cls(fd, image, name))
                os.close(fd)
                fd = -1
                os.rename(name, name + ".old", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # imported by the index
            except Damaged as e:
                note = f"{e}: started over, its blocks are not served"
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
            if fd >= 0:
                os.close(fd)
        return Opened(cls._create(name, dir_fd, cap), note)

    @classmethod
    def _create(cls, name: str, dir_fd: int | None, cap: int) -> IndexFile:
        size = file_bytes(cap)
        tmp = name + ".tmp"
        with contextlib.suppress(FileNotFoundError):  # a leftover (or anything else by that name) goes
            os.unlink(tmp, dir_fd=dir_fd)
        fd = open_own(tmp, dir_fd, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            _reserve(fd, size, name)
            head = header_of(cap)
            if os.pwrite(fd, head, 0) != len(head):
                raise OSError(errno.EIO, f"{name}: short write of its header")
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        image = anonymous(size)
        image[:HEADER] = np.frombuffer(head, dtype=np.uint8)
        return cls(fd, image, name)

    # --- changes -------------------------------------------------------------------------------------
    def changed(self, positions: np.ndarray) -> None:
        """Records at ``positions`` were just written in memory (on the loop): their pages go out."""
        if not len(positions):
            return
        lo = HEADER + positions.astype(np.int64) * RECORD.itemsize
        self._pending.append(lo >> 12)
        self._pending.append((lo + RECORD.itemsize - 1) >> 12)  # a record may straddle two pages
        self._gen += 1
        self._wake.set()

    def mark(self) -> int:
        """A point in the changes: ``wait(mark)`` returns once every change told before it is written."""
        return self._gen

    def wait(self, mark: int, timeout: float | None = None) -> bool:
        """Block (an I/O thread, never the loop) until the changes up to ``mark`` are written (or failed,
        counted); False on timeout or once closed."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= mark or self._closing, timeout) and self._done >= mark

    def write_all(self) -> None:
        """The whole image, in order (after an import filled a new index in memory; before any change)."""
        self._write_pages(np.arange(-(-len(self.image) // PAGE), dtype=np.int64))

    def flush(self, timeout: float = 30.0) -> None:
        """Every change written, then the file's data made durable."""
        self.wait(self._gen, timeout)
        os.fdatasync(self.fd)

    def close(self) -> None:
        """Write what is pending, stop the writer, close the file."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # --- the writer ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(GATHER_S)  # the loop finishes what it is doing (an insert of many records) first
            self._wake.clear()
            gen = self._gen
            pending, self._pending = self._pending, []  # one statement under the GIL: nothing lost
            if pending and self._truncated():
                self._rewrite()
            elif pending:
                self._write_pages(np.unique(np.concatenate(pending)))
            with self._cond:
                self._done = max(self._done, gen)
                self._cond.notify_all()
                if self._closing and not self._pending:
                    return

    @staticmethod
    def _allocated(fd: int) -> int:
        try:
            return os.fstat(fd).st_blocks * 512
        except OSError:
            return 0

    def _truncated(self) -> bool:
        """Shorter than the image, or (a file that was whole) holes in it: cut under the daemon, even if
        a write of ours past the cut made its size whole again meanwhile."""
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return st.st_size < len(self.image) or (self._dense and st.st_blocks * 512 < len(self.image))

    def _rewrite(self) -> None:
        """The whole file again from memory (it was truncated under the daemon: the pages cut are gone)."""
        self.rewrites += 1
        log.error("disk tier: its index %s was truncated under the daemon; written whole again from memory",
                  self.name)
        self._write_pages(np.arange(-(-len(self.image) // PAGE), dtype=np.int64))

    def _write_pages(self, pages: np.ndarray) -> None:
        """Pages ``pages`` (sorted, unique) of the image, at their offsets; the copies hold the GIL."""
        if self._scratch is not None:
            _, failed, err = _probe.write_pages(self.fd, self.image, np.ascontiguousarray(pages, np.int64),
                                                self._scratch)
            if failed:
                self.write_errors += failed - 1  # (the one below counts itself)
                self._failed(OSError(err, os.strerror(err)))
            return
        size = len(self.image)
        starts = np.flatnonzero(np.diff(pages, prepend=-2) != 1)  # the runs of consecutive pages
        for first, last in zip(pages[starts].tolist(), (pages[np.append(starts[1:], len(pages)) - 1] + 1).tolist(),
                               strict=True):
            for p in range(first, last, RUN_PAGES):
                lo, hi = p * PAGE, min(size, min(last, p + RUN_PAGES) * PAGE)
                self._pwrite(bytes(self._mv[lo:hi]), lo)  # the copy holds the GIL: see the module doc

    def _pwrite(self, data: bytes, off: int) -> None:
        try:
            n = os.pwrite(self.fd, data, off)
            if n != len(data):
                raise OSError(errno.EIO, f"short write: {n} of {len(data)} bytes")
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        self.write_errors += 1
        if not self.first_error:
            self.first_error = str(e)
            log.error("disk tier: cannot write its index %s: %s (its blocks may not be found after a "
                      "restart; later errors are counted in io_errors)", self.name, e)


def _reserve(fd: int, size: int, name: str) -> None:
    """The file's blocks, allocated now: no write into it can then find the file system full (where the
    file system cannot say, the writes' own errors are counted instead)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in _NOT_SUPPORTED:
            return
        raise OSError(e.errno, f"cannot reserve {size} bytes for the index {name}: {e.strerror}") from None
