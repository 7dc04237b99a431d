"""Background pinning of the pool: the daemon serves at once, capacity grows as memory is pinned.

Page-locking a large pool is slow when done the usual way (torch's ``pin_memory`` allocator manages
~1.9 GiB/s on an H200 host, so a 512 GiB pool would keep the daemon down for minutes). Measured on
the H200 host (docs/cuda.md):
  * the cost is almost all first-touch page faults and zeroing, and it parallelises across cores;
  * with transparent huge pages the faults are 2 MiB each and ``cuMemHostRegister`` of populated
    memory runs at ~40 GiB/s on one thread, but several registrations at once serialise inside the
    driver and get *slower* in total;
  * touching with plain stores beats ``madvise(MADV_POPULATE_WRITE)`` once the CUDA driver starts
    at the same time: populate holds the process's mmap lock, so the driver's own start-up (hundreds
    of mmap calls) took 1.0 s instead of 0.2 s and pinning a 12 GiB pool fell to 8 GiB/s; page faults
    take only the pool's VMA lock (Linux >= 6.4) and the same pool pinned at 16-22 GiB/s;
  * shared memory (a pool file on tmpfs) gets no huge pages where shmem THP is off (the default), and
    ``MADV_POPULATE_WRITE`` on it runs at 2-3 GiB/s whatever the threads; what is fast is reading:
    one load per 4 KiB page of an allocated file maps (and zero-fills) it under the VMA lock only,
    9-10 GiB/s on 8 threads, and a page that already holds data (an adopted pool) is mapped with its
    neighbours by the kernel's fault-around (64 KiB), so one load per 64 KiB suffices (24 GiB/s);
    ``cuMemHostRegister`` of the mapped pages then runs at 20-25 GiB/s (``bench/pool_pin.py``).
So: ``threads`` workers touch 1 GiB regions (private memory: MADV_HUGEPAGE and one store per page;
a pool file: one load per page, or per 64 KiB where ``mincore`` says every page is in memory, each
region only once its file segment is allocated: ``Pool.provisioned``), one registrar thread registers
them in address order (at most 64 GiB each: single huge registrations are known to fail), and the
pool becomes allocatable up to the registered prefix through ``on_progress``.

Regions are registered PORTABLE, so every GPU's context in the daemon can DMA to and from them.
If registration fails (memlock limit, no GPU), the rest of the pool is made usable unpinned and a
warning is logged: the copies then still work, only slower.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from kvoffd import libc
from kvoffd.pool.allocator import Pool
from kvoffd.pool.shards import bind_thread_near, byte_ranges
from kvoffd.transfer import cuda_driver as cudart

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
FAULT_AROUND = 64 << 10  # the kernel's fault_around_bytes default: a read fault maps this much of a file
TOUCH_LOADS = 4096  # loads per np.copyto when touching by reading
MAX_REGION = 64 << 30
POPULATE_STEP = 8 << 20


@dataclass
class PinStats:
    pinned_bytes: int = 0
    total_bytes: int = 0
    started: float = 0.0
    finished: float = 0.0  # 0 while running
    error: str = ""
    touch_s: float = 0.0  # summed over threads: first touch
    register_s: float = 0.0  # summed over threads: cuMemHostRegister
    driver_s: float = 0.0  # the registrar's wait for the CUDA driver (cuInit, context) at the start
    regions: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) registered

    @property
    def seconds(self) -> float:
        end = self.finished or time.monotonic()
        return max(end - self.started, 1e-9) if self.started else 0.0

    @property
    def gib_per_s(self) -> float:
        return self.pinned_bytes / (1 << 30) / self.seconds if self.started else 0.0


def _libc() -> ModuleType | None:
    """kvoffd.libc where it has the two calls pinning needs."""
    return libc if libc.madvise is not None and libc.mincore is not None else None


class Pinner:
    """Pins ``pool`` region by region in background threads; see the module docstring.

    ``on_progress(nbytes)`` is called from the registrar thread each time the pinned prefix grows
    (and once with the whole pool when pinning gives up); the caller hands it to its event loop.
    """

    def __init__(self, pool: Pool, on_progress: Callable[[int], None] | None = None, *,
                 region_bytes: int = 1 << 30, threads: int = 0, device: int = 0, populate: bool = True,
                 hugepages: bool = True, populate_step: int = POPULATE_STEP,
                 touch: str = "write"):
        step = pool.chunk_bytes
        region_bytes = min(max(region_bytes, step), MAX_REGION)
        self.region_bytes = region_bytes - region_bytes % step
        self.pool = pool
        self.on_progress = on_progress
        # H200 VM, 16 GiB pools touched by writes: 6 threads 22 GiB/s, 8 threads 26 GiB/s
        self.threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self.device = device
        self.populate = populate
        self.hugepages = hugepages
        self.populate_step = populate_step
        self.touch = touch  # "write" (one store per page), "read" (one load per page) or "populate"
        self.stats = PinStats(total_bytes=pool.nbytes)
        self._regions = [(o, min(self.region_bytes, end - o))  # within one NUMA shard each
                         for start, end in byte_ranges(pool.shards, pool.chunk_bytes, pool.nbytes)
                         for o in range(start, end, self.region_bytes)]
        # The pool's first chunk is a region of its own, pinned first: stores start as soon as it is (a
        # fresh pool file is allocated a chunk at a time), not a whole region later.
        if self._regions and self._regions[0][1] > step:
            first = self._regions.pop(0)
            self._regions[:0] = [(0, step), (step, first[1] - step)]
        self._next = 0
        self._touched = [False] * len(self._regions)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._go = threading.Event()
        self._workers: list[threading.Thread] = []
        self._libc = _libc()
        self._failed = False
        self._short = False  # a region will never be provisioned (the pool file's allocation stopped)
        self._yielding = 0  # callers inside ``yielding()``: no region starts meanwhile

    # --- control ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.stats.started = time.monotonic()
        # Touching by writing zeros is only for memory never handed out, and never for a pool file (it
        # would zero adopted blocks); a pool file is read, and only where allocated (no SIGBUS).
        if self.pool.persistent:
            self.touch = "read"
        elif self.pool.used_bytes:
            self.touch = "populate"
        if not self._regions:
            self.stats.finished = self.stats.started
            return
        n = min(self.threads, len(self._regions)) if self.populate and self._libc else 0
        self._workers = [threading.Thread(target=self._touch_work, name=f"kvoffd-touch-{i}", daemon=True)
                         for i in range(n)]
        self._workers.append(threading.Thread(target=self._register_work, name="kvoffd-pin", daemon=True))
        # Create every thread before any populates: populating holds the mmap lock, which thread
        # creation (stack mmap) needs; starting them one by one made start() take ~1 s.
        for t in self._workers:
            t.start()
        self._go.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop taking new regions and wait for the ones in progress."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._workers:
            t.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every region is done (tests and benchmarks). True when finished."""
        for t in self._workers:
            t.join(timeout)
        return all(not t.is_alive() for t in self._workers)

    def unpin(self) -> None:
        """Unregister every pinned region. Call after stop() and once no copy uses the pool."""
        if not self.stats.regions:
            return
        try:
            drv = cudart.driver()
            drv.use_device(self.device)
        except (cudart.CudaUnavailable, cudart.CudaError) as e:
            log.warning("cannot unpin the pool: %s", e)
            return
        base = self.pool.base_address
        with self._lock:
            regions, self.stats.regions = self.stats.regions, []
        for off, _ in regions:
            try:
                drv.host_unregister(base + off)
            except cudart.CudaError as e:
                log.warning("cuMemHostUnregister at offset %d: %s", off, e)
        self.stats.pinned_bytes = 0
        self.pool.pinned_bytes = 0

    @contextmanager
    def yielding(self) -> Iterator[None]:
        """Hold back the next region's touch and registration while the caller runs.

        An engine's REGISTER maps its memory (cuIpcOpenMemHandle, cuMemMap) through the same CUDA
        driver and address space that registration and touching keep busy back to back: behind them
        it waited until the whole pool was pinned (64 GiB: 4 s, past the client's 2 s), the first
        REGISTER after a warm restart above all. With this it waits for the regions in progress only.
        """
        with self._cond:
            self._yielding += 1
        try:
            yield
        finally:
            with self._cond:
                self._yielding -= 1
                self._cond.notify_all()

    def _wait_turn(self) -> None:
        """Return once no caller is in ``yielding()`` (or pinning stops)."""
        with self._cond:
            while self._yielding and not self._stop.is_set():
                self._cond.wait(0.1)

    # --- work -------------------------------------------------------------------------------------
    def _touch_work(self) -> None:
        self._go.wait()
        while True:
            self._wait_turn()
            with self._lock:
                if self._stop.is_set() or self._failed or self._next >= len(self._regions):
                    return
                i = self._next
                self._next += 1
            off, length = self._regions[i]
            if not self.pool.provisioned.wait_for(off + length, self._stop):
                with self._cond:  # the pool file's allocation ended before this region: so does pinning
                    self._short = True
                    self._cond.notify_all()
                return
            bind_thread_near(self.pool.shards, self.pool.chunk_bytes, off)  # a sharded pool: from its node's CPUs
            t0 = time.monotonic()
            self._touch(self.pool.base_address + off, length)
            with self._cond:
                self.stats.touch_s += time.monotonic() - t0
                self._touched[i] = True
                self._cond.notify_all()

    def _register_work(self) -> None:
        self._go.wait()
        t0 = time.monotonic()
        try:
            drv = cudart.driver()
            drv.use_device(self.device)
        except (cudart.CudaUnavailable, cudart.CudaError) as e:
            self._give_up(f"no CUDA driver: {e}")
            return
        self.stats.driver_s = time.monotonic() - t0
        base = self.pool.base_address
        touching = any(t.name.startswith("kvoffd-touch") for t in self._workers)
        for i, (off, length) in enumerate(self._regions):
            with self._cond:
                while touching and not self._touched[i] and not self._stop.is_set() and not self._short:
                    self._cond.wait(0.1)
                if self._stop.is_set():
                    return
                touched, short = self._touched[i], self._short
            if not touched and not short:  # nobody touches (no libc): the region must exist all the same
                short = not self.pool.provisioned.wait_for(off + length, self._stop)
            if short:
                self._give_up(f"the pool file was allocated only up to {self.pool.provisioned.nbytes} bytes")
                return
            self._wait_turn()
            t0 = time.monotonic()
            try:
                drv.host_register(base + off, length)
            except cudart.CudaError as e:
                self._give_up(f"cuMemHostRegister of {length} bytes at offset {off}: {e}")
                return
            with self._lock:
                self.stats.register_s += time.monotonic() - t0
                self.stats.regions.append((off, length))
                self.stats.pinned_bytes += length
                self.pool.pinned_bytes = self.stats.pinned_bytes
            if self.on_progress is not None:
                self.on_progress(off + length)
        self.stats.finished = time.monotonic()
        log.info("pool pinned: %.1f GiB in %.2f s (%.1f GiB/s; %d populate threads: touch %.2f s, register %.2f s "
                 "thread-summed; CUDA driver ready after %.2f s)", self.stats.pinned_bytes / (1 << 30),
                 self.stats.seconds, self.stats.gib_per_s, len(self._workers) - 1, self.stats.touch_s,
                 self.stats.register_s, self.stats.driver_s)

    def _touch(self, addr: int, length: int) -> None:
        if self._libc is None:
            return
        if self.hugepages:
            self._libc.madvise(addr, length, MADV_HUGEPAGE)  # a hint; shmem may ignore it
        step = self.populate_step
        if self.touch == "read":
            # A load per page maps an allocated page (zero-filling one never written) without the mmap
            # lock; where every page holds data already (mincore: in memory), fault-around maps 64 KiB
            # per fault, so one load per 64 KiB does. The loads are a strided np.copyto into a small
            # buffer, which releases the GIL (a strided .sum() does not: eight touching threads held
            # the GIL from the loop and the adoption, and a 64 GiB restart answered its first hit in
            # 2.3 s instead of 1), in spans of at least 4,096 loads (numpy keeps the GIL for small ones).
            stride = FAULT_AROUND if self._resident(addr, length) else mmap.PAGESIZE
            span = max(step, stride * TOUCH_LOADS)
            sink = np.empty(span // stride, dtype=np.uint8)
            buf = self.pool.buffer
            off0 = addr - self.pool.base_address
            for off in range(off0, off0 + length, span):
                if self._stop.is_set():
                    return
                view = buf[off: min(off + span, off0 + length): stride]
                np.copyto(sink[:len(view)], view)
            return
        if self.touch == "write":
            # Plain page faults take only the pool's own VMA lock (Linux >= 6.4), so they do not hold
            # up the mmap calls of the CUDA driver's initialisation running at the same time, which
            # MADV_POPULATE_WRITE (holding the process's mmap lock) was measured to slow 3x. numpy
            # releases the GIL for the strided store.
            buf = self.pool.buffer
            off0 = addr - self.pool.base_address
            for off in range(off0, off0 + length, step):
                if self._stop.is_set():
                    return
                buf[off: min(off + step, off0 + length): mmap.PAGESIZE] = 0  # a fresh pool: zeros already
            return
        # in steps: each call holds the process's mmap lock, which any mmap (the event loop's large
        # allocations, the CUDA driver's) waits for
        for a in range(addr, addr + length, step):
            if not self.populate or self._stop.is_set():
                return
            if self._libc.madvise(a, min(step, addr + length - a), MADV_POPULATE_WRITE) != 0:
                self.populate = False  # old kernel: registration faults the pages itself

    def _resident(self, addr: int, length: int) -> bool:
        """Whether every page of the range is in memory and up to date (``mincore``): pages of an
        adopted pool that held data. A page allocated but never written is not (the kernel zero-fills
        it at its first fault, and fault-around skips it)."""
        if self._libc is None:
            return False
        vec = np.zeros(length // mmap.PAGESIZE, dtype=np.uint8)
        if self._libc.mincore(addr, length, vec.ctypes.data) != 0:
            return False
        return bool((vec & 1).all())

    def _give_up(self, why: str) -> None:
        with self._lock:
            if self._failed:
                return
            self._failed = True
            self.stats.error = why
            self.stats.finished = time.monotonic()
        log.warning("pinning stopped (%s); the rest of the pool is used unpinned (slower copies)", why)
        if self.on_progress is not None:
            self.on_progress(self.pool.nbytes)
