"""How fast can a pool file's pages be allocated and page-locked for CUDA? (issue 14: pinning a pool file.)

Each run makes a fresh pool of ``--size`` in ``--dir`` (tmpfs), allocates it, touches its 1 GiB
regions with ``--threads`` workers and registers them in address order on one thread
(``cuMemHostRegister``, PORTABLE), as ``kvoffd/transfer/pinning.py`` does. The ways compared:

allocation (``--alloc``):
  * ``one``: ``posix_fallocate`` of one file on one thread (tmpfs holds the inode lock for the call,
    so a second thread on the same file waits);
  * ``files:N``: the data split over N files, each allocated by its own thread (N inode locks);
  * ``overlap``: one file, allocated in 1 GiB steps by one thread while the touch and the registration
    follow the allocated prefix (what a daemon that serves at once has to do);
  * ``zeros:N``: N files, each written with zeros by its own thread (the daemon's way for a fresh
    pool: whole pages, which the kernel's fault-around maps 64 KiB at a time);
  * ``adopted:N``: N files allocated and every page written, then mapped afresh (a warm restart):
    the timing starts at the new mapping.

touch (``--touch``, a comma list):
  * ``populate``: ``madvise(MADV_POPULATE_WRITE)`` per region (holds the process's mmap lock);
  * ``read``: one load per 4 KiB page (read faults on pages that exist: no zeroing, no SIGBUS);
  * ``read64k``: one load per 64 KiB (the kernel maps the neighbouring pages of a read fault on a file,
    "fault-around", 64 KiB by default, so a sixteenth of the faults);
  * ``populate_read``: ``madvise(MADV_POPULATE_READ)`` per region;
  * ``none``: no touch, ``cuMemHostRegister`` faults the pages in itself.

Prints, per run: allocation GiB/s, touch GiB/s (thread-parallel wall time), registration GiB/s of
touched memory, and end to end (first allocation to last registration). ``--no-register`` leaves CUDA
out (a host without a GPU). The ceiling in the same run: private anonymous memory, touched by writes
and registered the same way (``--touch`` ``private``).

    python bench/pool_pin.py --dir /dev/shm --size 16GiB --threads 8 --alloc one,files:8,overlap \
        --touch read,read64k,populate
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvoffd.pool.file import map_fixed, write_zeros  # noqa: E402
from kvoffd.transfer import cuda_driver  # noqa: E402

GiB = 1 << 30
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
MADV_HUGEPAGE = 14


@dataclass
class Result:
    alloc: str
    touch: str
    alloc_gibs: float
    touch_gibs: float
    register_gibs: float
    end_to_end_gibs: float

    def line(self) -> str:
        return (f"{self.alloc:<9} {self.touch:<14} allocate {self.alloc_gibs:6.1f}  touch {self.touch_gibs:6.1f}  "
                f"register {self.register_gibs:6.1f}  end-to-end {self.end_to_end_gibs:6.1f} GiB/s")


class Run:
    """One pool: its files, its mapping (one VA range over all files), and the timings."""

    def __init__(self, d: str, size: int, alloc: str, threads: int):
        self.size, self.alloc, self.threads = size, alloc, threads
        self.private = alloc == "private"
        nfiles = int(alloc.split(":")[1]) if ":" in alloc else 1
        self.part = size // nfiles
        self.paths: list[str] = []
        self.fds: list[int] = []
        if self.private:
            self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            for i in range(nfiles):
                p = os.path.join(d, f"kvoffd-pin-bench-{os.getpid()}-{i}")
                self.paths.append(p)
                self.fds.append(os.open(p, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600))
                os.ftruncate(self.fds[-1], self.part)
        self._map_files()
        self.regions = [(o, min(GiB, size - o)) for o in range(0, size, GiB)]
        self.allocated = 0  # bytes of the range allocated (overlap: grows)
        self.cond = threading.Condition()

    def _map_files(self) -> None:
        """One reserved range, each file mapped over its part with MAP_FIXED (what the daemon does)."""
        if not self.private:
            self.map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)  # NORESERVE
        self.pages = np.frombuffer(self.map, dtype=np.uint8)
        self.base = self.pages.ctypes.data
        for i, fd in enumerate(self.fds):
            map_fixed(self.base + i * self.part, self.part, fd)

    def readopt(self) -> None:
        """As a restarted daemon finds an adopted pool: every page written before, a fresh mapping."""
        for off, n in self.regions:
            self.pages[off:off + n:4096] = 1
        del self.pages
        self.map.close()
        self._map_files()

    def allocate(self) -> float:
        """Allocate (everything but ``overlap``, which allocate_steps does); seconds."""
        t0 = time.perf_counter()
        if self.private:
            self.allocated = self.size
            return 0.0
        def zeros(fd: int) -> None:  # what the daemon does for a fresh segment
            write_zeros(fd, self.part)

        how = zeros if self.alloc.startswith("zeros") else (lambda fd: os.posix_fallocate(fd, 0, self.part))
        ts = [threading.Thread(target=how, args=(fd,)) for fd in self.fds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.allocated = self.size
        return time.perf_counter() - t0

    def allocate_steps(self) -> None:
        fd = self.fds[0]
        for off, n in self.regions:
            os.posix_fallocate(fd, off, n)
            with self.cond:
                self.allocated = off + n
                self.cond.notify_all()

    def touch(self, how: str, off: int, n: int) -> None:
        with self.cond:
            while self.allocated < off + n:
                self.cond.wait()
        if how == "private":
            self.map.madvise(MADV_HUGEPAGE, off, n)
            self.pages[off:off + n:4096] = 0
        elif how == "populate":
            self.map.madvise(MADV_POPULATE_WRITE, off, n)
        elif how == "populate_read":
            self.map.madvise(MADV_POPULATE_READ, off, n)
        elif how in ("read", "read64k"):  # a strided copy releases the GIL (a strided .sum() does not)
            view = self.pages[off:off + n:4096 if how == "read" else 65536]
            np.copyto(np.empty(len(view), np.uint8), view)

    def close(self) -> None:
        del self.pages
        self.map.close()
        for fd in self.fds:
            os.close(fd)
        for p in self.paths:
            os.unlink(p)


def one(d: str, size: int, threads: int, alloc: str, how: str, register: bool) -> Result:
    run = Run(d, size, alloc, threads)
    drv = None
    if register:
        drv = cuda_driver.driver()
        drv.use_device(0)
    registered: list[int] = []
    try:
        t_start = time.perf_counter()
        allocator = None
        if alloc == "overlap":
            allocator = threading.Thread(target=run.allocate_steps)
            allocator.start()
            alloc_s = 0.0
        else:
            alloc_s = run.allocate()
            if alloc.startswith("adopted"):
                run.readopt()
                t_start = time.perf_counter()
        touched = [threading.Event() for _ in run.regions]
        nxt = iter(range(len(run.regions)))
        lock = threading.Lock()
        touch_end = [0.0]

        def work() -> None:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                off, n = run.regions[i]
                run.touch(how, off, n)
                touched[i].set()
                touch_end[0] = max(touch_end[0], time.perf_counter())

        t1 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(threads if how != "none" else 0)]
        for t in ts:
            t.start()
        reg_s = 0.0
        for i, (off, n) in enumerate(run.regions):
            if how != "none":
                touched[i].wait()
            elif alloc == "overlap":
                with run.cond:
                    while run.allocated < off + n:
                        run.cond.wait()
            if drv is not None:
                r0 = time.perf_counter()
                drv.host_register(run.base + off, n)
                reg_s += time.perf_counter() - r0
                registered.append(run.base + off)
        t_end = time.perf_counter()
        for t in ts:
            t.join()
        if allocator is not None:
            allocator.join()
            alloc_s = t_end - t_start  # not separable: shown as the end-to-end rate
        touch_s = (touch_end[0] - t1) if ts else 0.0
        gib = size / GiB
        return Result(alloc, how, gib / alloc_s if alloc_s else 0.0, gib / touch_s if touch_s else 0.0,
                      gib / reg_s if reg_s else 0.0, gib / (t_end - t_start))
    finally:
        if drv is not None:
            for a in registered:
                drv.host_unregister(a)
        run.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--size", default="8GiB")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--alloc", default="one,files:8,overlap")
    ap.add_argument("--touch", default="read,read64k,populate")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-register", action="store_true")
    a = ap.parse_args()
    size = int(a.size.removesuffix("GiB")) * GiB
    print(f"kernel {os.uname().release}; shmem THP: "
          f"{Path('/sys/kernel/mm/transparent_hugepage/shmem_enabled').read_text().strip()}", flush=True)
    for _ in range(a.repeat):
        print(one(a.dir, size, a.threads, "private", "private", not a.no_register).line(), flush=True)
        for alloc in a.alloc.split(","):
            for how in a.touch.split(","):
                print(one(a.dir, size, a.threads, alloc, how, not a.no_register).line(), flush=True)


if __name__ == "__main__":
    main()
