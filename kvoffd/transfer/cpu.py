"""CPU backend: engine KV memory in a shared-memory file, copied with batched kernel memcpy.

The connector moves vLLM's CPU KV allocation into a file under /dev/shm (see
kvoffd_client.handles); the daemon maps the same file, so both processes address the same pages
and nothing is copied at registration. docs/architecture.md says why this beat the alternatives.

A job's runs (one per block and segment, coalesced where contiguous) are moved by
``process_vm_readv`` on the daemon's own pid: one system call copies up to 1024 runs, kernel-side,
with descriptors built by numpy and the GIL released. Big jobs are split across a few threads.
Where the call is refused (seccomp, old kernel) the backend falls back to ctypes.memmove per run.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvoffd import procfs
from kvoffd.pool import Pool
from kvoffd.transfer.base import (
    AttachError,
    Direction,
    MappedMemory,
    TransferBackend,
    coalesce,
    describe_in_chunks,
)
from kvoffd_client.handles import SHM_PREFIX
from kvoffd_client.protocol import Segment

log = logging.getLogger(__name__)

IOV_MAX = 1024
_SHM_DIRS = ("/dev/shm/",)


def _load_pvm() -> tuple[Any, Any] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rd, wr = libc.process_vm_readv, libc.process_vm_writev
    except (OSError, AttributeError):
        return None
    for f in (rd, wr):
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                      ctypes.c_ulong]
        f.restype = ctypes.c_ssize_t
    return rd, wr


class CpuBackend(TransferBackend):
    name = "cpu"

    def __init__(self, pool: Pool, threads: int = 0):
        super().__init__(pool)
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kvoffd-copy")
        self._pvm = _load_pvm()
        self._pid = os.getpid()
        reap_orphan_files()

    def kinds(self) -> tuple[str, ...]:
        return ("cpu_shm",)

    def attach(self, engine_id: str, memory: dict[str, Any], num_blocks: int,
               segments: list[Segment]) -> MappedMemory:
        path, size = memory.get("path"), memory.get("size")
        # A file directly in /dev/shm, named by the connector: no subdirectory (it could be a symlink
        # to anywhere the daemon's user can read), and the file itself opened without following links.
        if (type(path) is not str or os.path.dirname(path) != _SHM_DIRS[0].rstrip("/")
                or not os.path.basename(path).startswith(SHM_PREFIX)
                or os.path.realpath(os.path.dirname(path)) != os.path.realpath(_SHM_DIRS[0])):
            raise AttachError(f"memory.path must be a {SHM_PREFIX}* file directly under {_SHM_DIRS[0]}, "
                              f"got {path!r:.80}")
        if type(size) is not int or size <= 0:
            raise AttachError("memory.size must be a positive integer")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            raise AttachError(f"cannot open {path}: {e.strerror}") from None
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise AttachError(f"{path} holds {actual} bytes, fewer than the {size} declared")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise AttachError(f"cannot map {path}: {e.strerror}") from None
        finally:
            os.close(fd)
        mapped = MappedMemory(engine_id=engine_id, kind="cpu_shm", size=size, num_blocks=num_blocks,
                              segments=segments, slot_bytes=sum(s.length for s in segments))
        try:
            mapped.check_bounds()
        except AttachError:
            mm.close()
            raise
        view = np.frombuffer(mm, dtype=np.uint8)
        mapped.handle = (mm, view)
        mapped.extra["base"] = view.ctypes.data
        mapped.extra["path"] = path
        return mapped

    def detach(self, mapped: MappedMemory) -> None:
        mm, view = mapped.handle
        mapped.handle = None
        del view
        try:
            mm.close()
        except BufferError:
            log.warning("engine %s: mapping still referenced; the OS frees it at exit", mapped.engine_id)
        _unlink_if_orphan(mapped.extra["path"])

    def submit(self, direction: Direction, mapped: MappedMemory, block_ids: np.ndarray,
               slots: np.ndarray, event: int = -1, expires_ns: int = 0) -> Awaitable[None]:
        loop = asyncio.get_running_loop()
        parts = _split(len(block_ids), mapped.slot_bytes, self.threads)
        return asyncio.gather(*(loop.run_in_executor(self._executor, self._copy_blocks, direction, mapped,
                                                     block_ids[a:b], slots[a:b]) for a, b in parts))

    def _copy_blocks(self, direction: Direction, mapped: MappedMemory, block_ids: np.ndarray,
                     slots: np.ndarray) -> None:
        """Describe a range of blocks a chunk at a time and move each chunk: on a copy thread, so
        no job's descriptors (millions of runs for a many-segment layout) ever stall the loop."""
        base = mapped.extra["base"]
        for eng, pool, lens in describe_in_chunks(mapped, block_ids, slots, self.pool.base_address):
            eng += base
            src, dst = (eng, pool) if direction is Direction.STORE else (pool, eng)
            self._copy_runs(*coalesce(src, dst, lens))

    def _copy_runs(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        if self._pvm is not None:
            try:
                self._copy_pvm(src, dst, lens)
                return
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                    raise
                log.warning("process_vm_readv refused (%s); copying run by run instead", e.strerror)
                self._pvm = None
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True):
            ctypes.memmove(d, s, n)

    def _copy_pvm(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        readv = self._pvm[0]
        for a in range(0, len(lens), IOV_MAX):
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
            if done != want:  # a partial copy only happens on a fault: finish run by run to know
                raise OSError(errno.EFAULT, f"short copy: {done} of {want} bytes")

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "threads": self.threads,
                "method": "process_vm_readv" if self._pvm else "memmove"}


def _owner_pid(path: str) -> int:
    name = os.path.basename(path)
    if not name.startswith(SHM_PREFIX):
        return 0
    head = name[len(SHM_PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def _unlink_if_orphan(path: str) -> None:
    """Remove an engine's KV file once its process is gone (a killed engine cannot do it itself)."""
    pid = _owner_pid(path)
    if pid <= 0:
        return
    try:
        os.kill(pid, 0)
        if not procfs.is_zombie(pid):  # (a zombie is dead: its parent has not reaped it yet)
            return  # still alive (or another pid namespace: leave it to its owner)
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    try:
        if os.stat(path).st_uid == os.getuid():
            os.unlink(path)
            log.info("removed %s left by exited engine pid %d", path, pid)
    except OSError:
        pass  # gone already, or not ours to remove: cleanup is best effort


def reap_orphan_files() -> None:
    try:
        names = os.listdir(_SHM_DIRS[0])
    except OSError:
        return
    for name in names:
        if name.startswith(SHM_PREFIX):
            _unlink_if_orphan(os.path.join(_SHM_DIRS[0], name))


def _split(n: int, slot_bytes: int, parts: int) -> list[tuple[int, int]]:
    """Cut n blocks into up to ``parts`` ranges of about equal size (small jobs stay whole)."""
    if parts <= 1 or n <= 1 or n * slot_bytes < (8 << 20):
        return [(0, n)]
    parts = min(parts, n)
    bounds = [n * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
