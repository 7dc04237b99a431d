"""How fast can a pool file's allocated pages be page-locked for CUDA? (issue 14: pinning a pool file.)

The file is allocated first (``posix_fallocate``, as the daemon does), then each way below touches its
1 GiB regions with ``--threads`` workers while one thread registers them in address order
(``cuMemHostRegister``, PORTABLE), as ``kvoffd/transfer/pinning.py`` does:
  * ``populate``: ``madvise(MADV_POPULATE_WRITE)`` per region (what the daemon does for a pool file);
  * ``read``: one load per page (read faults on pages that exist: no zeroing, no SIGBUS, the VMA lock only);
  * ``none``: no touch, ``cuMemHostRegister`` faults the pages in itself.
Prints GiB/s from the first touch to the last registration, for each way, on a fresh file each.

    python bench/pool_pin.py --dir /dev/shm --size 12GiB --threads 8
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvoffd.transfer import cuda_driver  # noqa: E402

GiB = 1 << 30
MADV_POPULATE_WRITE = 23


def one(d: str, size: int, threads: int, how: str) -> tuple[float, float]:
    """(seconds to allocate, GiB/s from touch start to the last region registered)."""
    path = os.path.join(d, f"kvoffd-pin-bench-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    drv = cuda_driver.driver()
    drv.use_device(0)
    registered: list[int] = []
    try:
        t0 = time.perf_counter()
        os.posix_fallocate(fd, 0, size)
        alloc_s = time.perf_counter() - t0
        m = mmap.mmap(fd, size, mmap.MAP_SHARED)
        view = {"pages": np.frombuffer(m, dtype=np.uint8)}
        base = view["pages"].ctypes.data
        regions = [(o, min(GiB, size - o)) for o in range(0, size, GiB)]
        touched = [threading.Event() for _ in regions]
        nxt = iter(range(len(regions)))
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                off, n = regions[i]
                if how == "populate":
                    m.madvise(MADV_POPULATE_WRITE, off, n)
                elif how == "read":
                    int(view["pages"][off:off + n:4096].sum())
                touched[i].set()

        t1 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(threads if how != "none" else 0)]
        for t in ts:
            t.start()
        for i, (off, n) in enumerate(regions):
            if how != "none":
                touched[i].wait()
            drv.host_register(base + off, n)
            registered.append(base + off)
        dt = time.perf_counter() - t1
        for t in ts:
            t.join()
        for a in registered:
            drv.host_unregister(a)
        view.clear()
        m.close()
        return alloc_s, size / GiB / dt
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--size", default="8GiB")
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    size = int(a.size.removesuffix("GiB")) * GiB
    for how in ("populate", "read", "none", "populate", "read", "none"):
        alloc_s, rate = one(a.dir, size, a.threads, how)
        print(f"{how:<9} allocate {size / GiB / alloc_s:5.1f} GiB/s   touch+register {rate:5.1f} GiB/s", flush=True)


if __name__ == "__main__":
    main()
