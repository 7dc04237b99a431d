"""Pinning a persistent pool (issue 14): the shared file mapping is pinned as it is (the pinner never
remaps the pool, and touches a pool file by reading, never by writing, each segment once allocated), so what is in the pool
before pinning is still in the file after (and a warm restart can adopt it). Prints the pin rate, to compare with a private pool's (test_pinning.py).

Run on the H200: ``.venv/bin/python -m pytest -q -s tests/gpu/test_pinning_pool_file.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import numpy as np

from kvoffd.cache.restart.keeper import open_pool
from kvoffd.transfer.pinning import Pinner


def test_a_pool_file_is_pinned_in_place_and_keeps_its_bytes():
    d = tempfile.mkdtemp(prefix="kvtest-pin-", dir="/dev/shm")
    try:
        pool, pf = open_pool(4 << 30, f"{d}/kvoffd.pool", "ipc:///nonexistent/x.sock", cold=False)
        assert pf is not None and pool.persistent
        pattern = np.arange(1 << 20, dtype=np.uint8)
        pool.set_usable_bytes(0)
        p = Pinner(pool, pool.set_usable_bytes, region_bytes=1 << 30, threads=4)
        t = time.perf_counter()
        p.start()  # waits for each segment's allocation, which runs beside it as in the daemon
        alloc = threading.Thread(target=pf.allocate, args=(pool.provisioned.advance, threading.Event()),
                                 kwargs={"threads": 4})
        alloc.start()
        alloc.join(300)
        pool.provisioned.end()
        assert pf.allocated == pool.nbytes and not pf.error
        pool.buffer[123 << 20:124 << 20] = pattern  # a store, once allocated (the pool hands out nothing before)
        assert p.wait(300)
        dt = time.perf_counter() - t
        try:
            assert not p.stats.error, p.stats.error
            assert pool.pinned_bytes == pool.nbytes
            assert (pool.buffer[123 << 20:124 << 20] == pattern).all()
            with open(pf.segment_path(0), "rb") as f:
                on_file = os.pread(f.fileno(), 1 << 20, 123 << 20)
            assert on_file == pattern.tobytes(), "the pool was remapped away from its file"
            print(f"pinned a {pool.nbytes >> 30} GiB pool file in {dt:.2f} s ({pool.nbytes / dt / (1 << 30):.1f} GiB/s)")
        finally:
            p.unpin()
    finally:
        shutil.rmtree(d, ignore_errors=True)
