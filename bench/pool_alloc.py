"""How fast can a pool file's pages be allocated? (issue 14: pinning a pool file must not be slower.)

A fresh pool file on tmpfs has no pages; something must allocate (and zero) them before the pool is
pinned or written. Three ways, each on a fresh file of --size, with --threads workers:
  * ``fallocate``: ``posix_fallocate`` (errors instead of SIGBUS when the filesystem is full);
  * ``populate``: ``madvise(MADV_POPULATE_WRITE)`` per 1 GiB region (errors too, but holds the mmap
    lock while it runs);
  * ``stores``: one store per page (page faults; SIGBUS if the filesystem cannot back a page).
With and without ``MADV_HUGEPAGE`` (shmem huge pages need the sysfs shmem_enabled setting or a
``huge=`` mount option; the script prints both). Prints GiB/s for each.

    python bench/pool_alloc.py --dir /dev/shm --size 12GiB --threads 8
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import threading
import time

import numpy as np

GiB = 1 << 30
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable ({e.strerror})"


def _mount_options(d: str) -> str:
    best = ""
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) > 3 and d.startswith(parts[1]) and len(parts[1]) >= len(best.split(" ")[0] or ""):
            best = f"{parts[1]} {parts[2]} {parts[3]}"
    return best


def one(d: str, size: int, threads: int, how: str, huge: bool) -> float:
    path = os.path.join(d, f"kvoffd-alloc-bench-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED)
        if huge:
            m.madvise(MADV_HUGEPAGE)
        view = {"pages": np.frombuffer(m, dtype=np.uint8)}  # dropped before the mapping closes
        regions = [(o, min(GiB, size - o)) for o in range(0, size, GiB)]
        todo = list(regions)
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    off, n = todo.pop()
                if how == "fallocate":
                    os.posix_fallocate(fd, off, n)
                elif how == "populate":
                    m.madvise(MADV_POPULATE_WRITE, off, n)
                else:
                    view["pages"][off:off + n:4096] = 0

        t0 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        view.clear()
        m.close()
        return size / GiB / dt
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    size = int(a.size.removesuffix("GiB")) * GiB
    print(f"shmem_enabled: {_read('/sys/kernel/mm/transparent_hugepage/shmem_enabled')}")
    print(f"mount: {_mount_options(os.path.realpath(a.dir))}; {os.cpu_count()} cpus")
    ctypes.CDLL(None)  # libc loaded (nothing else needed)
    for how in ("fallocate", "populate", "stores"):
        for threads in sorted({1, a.threads}):
            for huge in (False, True):
                r = one(a.dir, size, threads, how, huge)
                print(f"{how:<9} threads {threads:>2} hugepage {'yes' if huge else 'no ':<3} {r:6.2f} GiB/s", flush=True)


if __name__ == "__main__":
    main()
