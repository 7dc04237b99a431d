"""CPU backend: engine KV memory in a sealed memfd the engine hands over, copied with batched kernel memcpy.

The connector moves vLLM's CPU KV allocation into an anonymous memfd (see kvoffd_client.memory) and
passes its descriptor over the daemon's fd socket (kvoffd.server.fdserver); the daemon maps it, so both
processes address the same pages and nothing is copied at registration. The daemon never opens
engine memory by name: it maps only what a client could hand it (docs/security.md). The descriptor
is closed as soon as it is mapped (a raw libc mmap, not mmap.mmap, which would keep a dup), so an
engine costs the daemon no fd, and a dead engine's memory is freed the moment the daemon unmaps it.
docs/architecture.md says why this beat the alternatives.

A job's runs (one per block and segment, coalesced where contiguous) are moved by
``process_vm_readv`` on the daemon's own pid: one system call copies up to 1024 runs, kernel-side,
with descriptors built by numpy and the GIL released. Big jobs are split across a few threads.
Where the call is refused (seccomp, old kernel) the backend falls back to ctypes.memmove per run.
That fallback faults (SIGBUS) on a page past the end of a shrunk file, so a memfd is accepted only
sealed against shrinking (F_SEAL_SHRINK): its size cannot drop below what the daemon mapped.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvoffd import libc
from kvoffd.pool.allocator import Pool
from kvoffd.transfer.base import (
    AttachError,
    Descriptors,
    Direction,
    JobExpired,
    MappedMemory,
    Runs,
    TransferBackend,
    check_bounds,
    coalesce,
    describe_in_chunks,
    first_failure,
    past,
    pool_chunks,
)
from kvoffd_client import protocol as P
from kvoffd_client.protocol import Segment

log = logging.getLogger(__name__)

IOV_MAX = 1024
#: test-only: "1" makes the backend copy with memmove, as it does where seccomp refuses process_vm_readv
FORCE_MEMMOVE_ENV = "KVOFFD_TEST_FORCE_MEMMOVE"


def _load_readv() -> Any | None:
    """libc's process_vm_readv, or None where it is missing."""
    return libc.process_vm_readv


_MMAP, _MUNMAP = libc.mmap, libc.munmap
_MAP_FAILED = libc.MAP_FAILED
_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01


@dataclass(kw_only=True)
class FdMapping(MappedMemory):
    """An engine's memfd, mapped raw (no descriptor kept) at ``address``; 0 once ``detach`` unmapped it."""

    address: int


def map_sealed_memfd(fd: int, size: int) -> int:
    """Map ``size`` bytes of ``fd`` shared, read-write; returns the address. Refuses anything but a
    memfd sealed against shrinking that holds at least ``size`` bytes. Does not close ``fd``."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise AttachError(f"the descriptor is not a sealed memfd ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode) or not seals & fcntl.F_SEAL_SHRINK:
        raise AttachError("the descriptor must be a memfd sealed with F_SEAL_SHRINK (a shrinkable file "
                          "could fault the daemon's copies)")
    if st.st_size < size:
        raise AttachError(f"the memfd holds {st.st_size} bytes, fewer than the {size} declared")
    addr = _MMAP(None, size, _PROT_RW, _MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise AttachError(f"cannot map the memfd: {os.strerror(err)}")
    return addr


class CpuBackend(TransferBackend):
    name = "cpu"

    def __init__(self, pool: Pool, threads: int = 0):
        super().__init__(pool)
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kvoffd-copy")
        self._readv = None if os.environ.get(FORCE_MEMMOVE_ENV) == "1" else _load_readv()
        self._pid = os.getpid()

    def kinds(self) -> tuple[str, ...]:
        return ("cpu_fd",)

    def attach(self, engine_id: str, memory: P.Memory, handover: Descriptors | None, num_blocks: int,
               segments: list[Segment]) -> MappedMemory:
        """``cpu_fd`` memory: the one memfd its token named (``handover``, claimed from the fd socket),
        mapped shared. The descriptor is always closed here, mapped or not."""
        try:
            if not isinstance(memory, P.CpuFd) or handover is None or len(handover.fds) != 1:
                raise AttachError("cpu_fd memory is one descriptor, handed over under its token")
            size = memory.size
            check_bounds(size, num_blocks, segments)
            address = map_sealed_memfd(handover.fds[0], size)
        finally:
            if handover is not None:
                handover.close()
        return FdMapping(engine_id=engine_id, kind="cpu_fd", size=size, num_blocks=num_blocks, segments=segments,
                         slot_bytes=sum(s.length for s in segments), address=address)

    def detach(self, mapped: FdMapping) -> None:  # type: ignore[override]  # the mapping attach returned
        address, mapped.address = mapped.address, 0
        if address and _MUNMAP(address, mapped.size) != 0:
            log.warning("engine %s: munmap failed: %s", mapped.engine_id, os.strerror(ctypes.get_errno()))

    def submit(self, direction: Direction, mapped: MappedMemory, block_ids: np.ndarray,
               slots: np.ndarray, event: int = -1, expires_ns: int = 0, runs: Runs | None = None
               ) -> Awaitable[None]:
        loop = asyncio.get_running_loop()
        nbytes = mapped.slot_bytes if runs is None else runs.nbytes
        parts = _split(len(block_ids), nbytes, self.threads)
        return asyncio.ensure_future(_all_parts([
            loop.run_in_executor(self._executor, self._copy_blocks, direction, mapped, block_ids[a:b], slots[a:b],
                                 expires_ns, runs)
            for a, b in parts]))

    def _copy_blocks(self, direction: Direction, mapped: FdMapping, block_ids: np.ndarray,
                     slots: np.ndarray, expires_ns: int, runs: Runs | None = None) -> None:
        """Describe a range of blocks a chunk at a time and move each chunk: on a copy thread, so
        no job's descriptors (millions of runs for a many-segment layout) ever stall the loop. The
        deadline is checked before every batch of runs (``_copy_runs``)."""
        base = mapped.address
        for eng, pool, lens in describe_in_chunks(mapped, block_ids, slots, self.pool.base_address, runs=runs):
            eng += base
            src, dst = (eng, pool) if direction is Direction.STORE else (pool, eng)
            self._copy_runs(*coalesce(src, dst, lens, pool_chunks(pool, self.pool)), expires_ns)

    def _copy_runs(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, expires_ns: int = 0) -> None:
        """Copy on a pool thread. The deadline is checked here, before every batch of at most IOV_MAX
        runs: a job that waited in the executor's queue past it (a backlog), or a thread frozen
        mid-job (SIGSTOP, cgroup freezer), stops at the next batch boundary instead of writing late."""
        if self._readv is not None:
            try:
                self._copy_readv(src, dst, lens, expires_ns)
                return
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                    raise
                log.warning("process_vm_readv refused (%s); copying run by run instead", e.strerror)
                self._readv = None
        for a in range(0, len(lens), IOV_MAX):
            if past(expires_ns):
                raise JobExpired(f"deadline passed after {a} of {len(lens)} runs; the rest not started")
            for s, d, n in zip(src[a:a + IOV_MAX].tolist(), dst[a:a + IOV_MAX].tolist(),
                               lens[a:a + IOV_MAX].tolist(), strict=True):
                ctypes.memmove(d, s, n)

    def _copy_readv(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, expires_ns: int = 0) -> None:
        readv = self._readv
        for a in range(0, len(lens), IOV_MAX):
            if past(expires_ns):
                raise JobExpired(f"deadline passed after {a} of {len(lens)} runs; the rest not started")
            b = min(a + IOV_MAX, len(lens))
            n = b - a
            remote = np.empty((n, 2), dtype=np.uint64)
            local = np.empty((n, 2), dtype=np.uint64)
            remote[:, 0], remote[:, 1] = src[a:b], lens[a:b]
            local[:, 0], local[:, 1] = dst[a:b], lens[a:b]
            want = int(lens[a:b].sum())
            done = readv(self._pid, local.ctypes.data, n, remote.ctypes.data, n, 0)
            if done < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            if done != want:  # a partial copy only happens on a fault: the job fails
                raise OSError(errno.EFAULT, f"short copy: {done} of {want} bytes")

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "threads": self.threads,
                "method": "process_vm_readv" if self._readv else "memmove"}


async def _all_parts(parts: list[asyncio.Future]) -> None:
    """Wait for every part of a job, then raise the first failure (one that is not an expiry, if any).

    Never sooner: a job's notice frees the engine's blocks, so it must not go out while another part
    of the same job is still copying on another thread (a plain gather raises at the first failure).
    """
    results = await asyncio.gather(*parts, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise first_failure(errors)


def _split(n: int, slot_bytes: int, parts: int) -> list[tuple[int, int]]:
    """Cut n blocks into up to ``parts`` ranges of about equal size (small jobs stay whole)."""
    if parts <= 1 or n <= 1 or n * slot_bytes < (8 << 20):
        return [(0, n)]
    parts = min(parts, n)
    bounds = [n * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
