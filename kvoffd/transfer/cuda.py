"""CUDA backend: engine KV memory mapped by CUDA IPC, copied by the copy engines in batched DMAs.

How one job moves (docs/cuda.md has the full story and the measurements):
  1. ``submit`` makes a :class:`CudaJob`. One that names an event of the engine's interprocess ring
     is *gated* until that event fired, on the host, by the poller (``cuda_poll``): a device-side
     wait would hang the daemon's stream forever if the engine died first;
  2. descriptors for every (block, segment) run are built with numpy and coalesced, and go to the
     engine's own stream (loads at the highest priority, stores at the lowest) in
     ``cuMemcpyBatchAsync`` calls (no SMs used, no staging); a completion event is recorded behind;
  3. the poller resolves the job's future on the event loop once that event fired.

A job past its deadline never starts: the deadline is checked before every enqueue (each batch
call), on whichever thread it runs. Small jobs are enqueued inline on the loop thread; of a large
one only a head is, and a small thread pool queues the rest behind it, so the loop never stalls and
the DMA never waits for the pool thread to get the GIL. Nothing here imports torch, and nothing
touches CUDA at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvoffd.pool.allocator import Pool
from kvoffd.transfer import cuda_driver as cudart
from kvoffd.transfer.base import (
    AttachError,
    Descriptors,
    Direction,
    JobExpired,
    MappedMemory,
    Runs,
    TransferBackend,
    coalesce,
    pool_chunks,
    run_descriptors,
)
from kvoffd.transfer.cuda_mapping import CudaMapping, IpcMaps
from kvoffd.transfer.cuda_poll import CudaJob, Poller
from kvoffd.transfer.pinning import Pinner
from kvoffd_client import protocol as P
from kvoffd_client.protocol import Segment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CudaTuning:
    """The backend's knobs; the defaults are what docs/cuda.md measured on the H200."""

    batch_runs: int = 512  # descriptors per cuMemcpyBatchAsync call ...
    batch_bytes: int = 256 << 20  # ... and bytes: small calls let the DMA start while the rest is queued
    inline_runs: int = 256  # runs enqueued on the loop thread (~1 us of driver time each)
    head_bytes: int = 512 << 20  # ~10 ms of DMA: ample time for a submit thread to queue the rest
    submit_threads: int = 4
    poll_us: float = 20.0  # the poller's sleep between sweeps that found nothing
    pin: bool = True  # page-lock the pool in the background (pinning.Pinner)
    pin_threads: int = 0
    pin_region_bytes: int = 1 << 30
    gate_timeout_s: float = 120.0  # a gated job whose event never fires fails after this long

    def head_blocks(self, segments: int, slot_bytes: int) -> int:
        """Blocks of a job enqueued inline: up to ``inline_runs`` runs and ``head_bytes`` of payload."""
        return max(1, min(self.inline_runs // segments, self.head_bytes // slot_bytes))


def batch_cuts(lens: np.ndarray, tuning: CudaTuning) -> list[tuple[int, int]]:
    """Cut a job's runs into batch calls of at most ``batch_runs`` runs and about ``batch_bytes``.

    Small calls let the copy engine start on the first while the driver still takes the next.
    """
    n = len(lens)
    total = int(lens.sum())
    if n <= 1 or total <= tuning.batch_bytes and n <= tuning.batch_runs:
        return [(0, n)] if n else []
    by_bytes = np.searchsorted(np.cumsum(lens), np.arange(tuning.batch_bytes, total, tuning.batch_bytes, dtype=lens.dtype),
                               side="right")
    cuts = sorted({0, n, *by_bytes.tolist(), *range(tuning.batch_runs, n, tuning.batch_runs)})
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def copy_runs(drv: cudart.Driver, stream: int, attrs: cudart.MemcpyAttributes, src: np.ndarray,
              dst: np.ndarray, lens: np.ndarray) -> None:
    """One batch of runs (contiguous uint64 arrays): a single cuMemcpyBatchAsync, or one cuMemcpyAsync
    per run on a driver without it (before CUDA 12.8)."""
    if drv.has_batch:
        drv.memcpy_batch_async(dst.ctypes.data, src.ctypes.data, lens.ctypes.data, len(lens), attrs, stream)
    else:
        copy_runs_one_by_one(drv, stream, src, dst, lens)


def copy_runs_one_by_one(drv: cudart.Driver, stream: int, src: np.ndarray, dst: np.ndarray,
                         lens: np.ndarray) -> None:
    """One cuMemcpyAsync per run: drivers without cuMemcpyBatchAsync, and the benchmark's reference."""
    for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True):
        drv.memcpy_async(d, s, n, stream)


class CudaBackend(TransferBackend):
    name = "cuda"

    def __init__(self, pool: Pool, tuning: CudaTuning | None = None):
        super().__init__(pool)
        self.tuning = tuning or CudaTuning()
        self.pinner: Pinner | None = None
        self.poller = Poller(poll_s=self.tuning.poll_us * 1e-6, start=self._start, recycle=self._recycle)
        self._submit = ThreadPoolExecutor(self.tuning.submit_threads, thread_name_prefix="kvoffd-cuda-submit")
        self._maps = IpcMaps()

    # --- lifecycle --------------------------------------------------------------------------------
    def kinds(self) -> tuple[str, ...]:
        return ("cuda_ipc", "cuda_vmm")

    def start(self) -> None:
        """Start the poller and the background pinning; returns at once."""
        self.poller.start()
        if self.tuning.pin and self.pinner is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            pool = self.pool

            def progress(nbytes: int) -> None:
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(pool.set_usable_bytes, nbytes)
                else:
                    pool.set_usable_bytes(nbytes)

            pool.set_usable_bytes(0)
            self.pinner = Pinner(pool, progress, threads=self.tuning.pin_threads,
                                 region_bytes=self.tuning.pin_region_bytes)
            self.pinner.start()

    def close(self) -> None:
        if self.pinner is not None:
            self.pinner.stop()
        self.poller.stop()
        self._submit.shutdown(wait=True, cancel_futures=True)
        if self.pinner is not None:
            self.pinner.unpin()
        self._maps.release_events()

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "batch_runs": self.tuning.batch_runs}
        try:
            drv = cudart.driver()
            d["driver_version"] = drv.version
            d["batch_abi"] = drv.batch_abi or "none"
            d["method"] = "batch" if drv.has_batch else "per-run"  # cuMemcpyBatchAsync, or cuMemcpyAsync each
        except cudart.CudaUnavailable as e:
            d["error"] = str(e)
        d["devices"] = {dev.ordinal: dev.uuid for dev in self._maps.devices.values()}
        if self.pinner is not None:
            s = self.pinner.stats
            d["pinning"] = {"pinned_bytes": s.pinned_bytes, "total_bytes": s.total_bytes,
                            "gib_per_s": round(s.gib_per_s, 2), "done": bool(s.finished), "error": s.error}
        return d

    # --- attach / detach ------------------------------------------------------------------------------
    def attach(self, engine_id: str, memory: P.Memory, handover: Descriptors | None, num_blocks: int,
               segments: list[Segment]) -> MappedMemory:
        with self.pinner.yielding() if self.pinner is not None else contextlib.nullcontext():
            if isinstance(memory, P.CudaVmm):
                return self._maps.open_vmm(engine_id, memory, handover, num_blocks, segments)
            if handover is not None:
                handover.close()  # (cuda_ipc comes without descriptors; none is kept)
            if not isinstance(memory, P.CudaIpc):
                raise AttachError(f"{memory.KIND} memory is not GPU memory")
            return self._maps.open(engine_id, memory, num_blocks, segments)

    def detach(self, mapped: CudaMapping) -> None:  # type: ignore[override]  # the mapping attach returned
        self.abort(mapped)
        self._maps.close(mapped)

    def abort(self, mapped: CudaMapping) -> int:  # type: ignore[override]
        """The engine is gone: fail its jobs still waiting for an event (they never reached a stream).

        Returns how many were failed. Jobs already on a stream finish normally (the IPC mapping keeps
        the memory alive until detach). Safe to call from any thread.
        """
        mapped.closed = True
        return self.poller.cancel(mapped, RuntimeError(f"engine {mapped.engine_id} left before its event fired"))

    # --- copies -----------------------------------------------------------------------------------
    def submit(self, direction: Direction, mapped: CudaMapping, block_ids: np.ndarray,  # type: ignore[override]
               slots: np.ndarray, event: int = -1, expires_ns: int = 0, runs: Runs | None = None
               ) -> Awaitable[None]:
        if mapped.detached:
            raise RuntimeError(f"engine {mapped.engine_id} is not mapped")
        if event >= len(mapped.events):
            raise ValueError(f"event {event} is outside the engine's ring of {len(mapped.events)}")
        loop = asyncio.get_running_loop()
        job = CudaJob(direction=direction, mapped=mapped, block_ids=block_ids, slots=slots, expires_ns=expires_ns,
                      future=loop.create_future(), loop=loop, runs=mapped.runs if runs is None else runs)
        if len(block_ids) == 0:
            job.future.set_result(None)
            return job.future
        if event >= 0:
            drv = cudart.driver()
            drv.use_device(mapped.device.ordinal)
            if not drv.event_query(mapped.events[event]):
                deadline = time.monotonic() + self.tuning.gate_timeout_s
                if expires_ns:  # never start after the client gave up (it may reuse the blocks)
                    deadline = min(deadline, expires_ns / 1e9)
                self.poller.gate(job, mapped, mapped.events[event], mapped.device.ordinal, deadline)
                return job.future
        self._start(job)
        return job.future

    def submit_parts(self, direction: Direction, mapped: CudaMapping,  # type: ignore[override]
                     block_ids: np.ndarray, slots: np.ndarray, parts: list[Runs], events: list[int],
                     expires_ns: int = 0) -> list[Awaitable[None]]:
        """Parts of an ungated job (a LOAD) go on the stream in part order, each with its own
        completion event, so part 0 lands first and the engine computes behind it: the head of part 0
        from this thread, then the rest of it and every later part from one submit thread. (As jobs
        of their own, each part's tail would be queued by any of the submit pool's threads, in any
        order behind every part's head.) Gated parts (a STORE behind the forward) start as their
        events fire, each on its own."""
        if len(parts) < 2 or any(e >= 0 for e in events) or len(block_ids) == 0:
            return super().submit_parts(direction, mapped, block_ids, slots, parts, events, expires_ns)
        if mapped.detached:
            raise RuntimeError(f"engine {mapped.engine_id} is not mapped")
        loop = asyncio.get_running_loop()
        jobs = [CudaJob(direction=direction, mapped=mapped, block_ids=block_ids, slots=slots, expires_ns=expires_ns,
                        future=loop.create_future(), loop=loop, runs=runs) for runs in parts]
        first = jobs[0]
        if mapped.closed or first.expired():
            err = RuntimeError("the engine was detached") if mapped.closed else JobExpired(
                "deadline passed before the copy could start; not started")
            for j in jobs:
                j.resolve(err)
            return [j.future for j in jobs]
        head = min(len(block_ids), self.tuning.head_blocks(len(first.runs), first.runs.nbytes))
        try:
            self._enqueue(first, 0, head)
        except Exception as e:  # noqa: BLE001 - the job fails, never the daemon
            self._fail_chain(jobs, e)
            return [j.future for j in jobs]
        try:
            self._submit.submit(self._submit_chain, jobs, head)
        except RuntimeError as e:  # the pool is shut down: the daemon is stopping
            self._fail_chain(jobs, e)
        return [j.future for j in jobs]

    def _submit_chain(self, jobs: list[CudaJob], first: int) -> None:
        """Enqueue the rest of part 0 (from block ``first``) and every later part, in order, each part's
        event recorded behind it. After a part that could not be queued the rest are not started."""
        for i, job in enumerate(jobs):
            try:
                self._enqueue(job, first if i == 0 else 0, len(job.block_ids))
            except Exception as e:  # noqa: BLE001 - any failure fails the job, never the daemon
                self._fail_chain(jobs[i:], e)
                return
            self._finish_on_stream(job, None)

    def _fail_chain(self, jobs: list[CudaJob], error: BaseException) -> None:
        """The first of ``jobs`` may have copies on the stream: it fails once they are done; the others
        never started and fail now."""
        self._finish_on_stream(jobs[0], error)
        for j in jobs[1:]:
            j.resolve(JobExpired("an earlier part was not started; not started") if isinstance(error, JobExpired)
                      else RuntimeError(f"an earlier part failed: {error}"))

    def _start(self, job: CudaJob) -> None:
        """Put a job on its stream: on the loop thread, or the poller's once its gate opened.

        Small jobs go all at once from this thread; of a large one only the head (``head_blocks``),
        so the copy engine starts at once, and the rest from the submit pool (building thousands of
        descriptors takes the driver milliseconds). The head start covers the time the pool thread
        may wait for the GIL while the loop does the job's bookkeeping.
        """
        mapped: CudaMapping = job.mapped  # type: ignore[assignment]
        if mapped.closed:
            job.resolve(RuntimeError("the engine was detached"))
            return
        if job.expired():  # a gated job whose event fired late, or a poller that was frozen
            job.resolve(JobExpired("deadline passed before the copy could start; not started"))
            return
        head = self.tuning.head_blocks(len(job.runs), job.runs.nbytes)
        if len(job.block_ids) <= head:
            self._submit_job(job, 0)
            return
        try:
            self._enqueue(job, 0, head)
        except Exception as e:  # noqa: BLE001 - the job fails, never the daemon
            self._finish_on_stream(job, e)  # part of the head may be on the stream
            return
        try:
            self._submit.submit(self._submit_job, job, head)
        except RuntimeError as e:  # the pool is shut down: the daemon is stopping
            self._finish_on_stream(job, e)

    def _submit_job(self, job: CudaJob, first: int) -> None:
        """Enqueue blocks ``first:`` of a job, record its completion event and hand that to the poller.

        If they cannot be enqueued (the deadline passed, the driver refused), the job fails, but only
        once whatever it already put on the stream is done: the event recorded behind decides when.
        """
        error: BaseException | None = None
        try:
            self._enqueue(job, first, len(job.block_ids))
        except Exception as e:  # noqa: BLE001 - any failure fails the job, never the daemon
            error = e
        self._finish_on_stream(job, error)

    def _enqueue(self, job: CudaJob, a: int, b: int) -> None:
        """Queue the copies of blocks ``a:b`` of the job on its stream, one batch call at a time.

        The deadline is checked before every call: a thread descheduled or frozen between two of them
        stops there (raising JobExpired) instead of starting the rest late."""
        mapped: CudaMapping = job.mapped  # type: ignore[assignment]
        drv = cudart.driver()
        eng, pool, lens = run_descriptors(mapped, job.block_ids[a:b], job.slots[a:b], self.pool.base_address,
                                          job.runs)
        eng += mapped.region
        store = job.direction is Direction.STORE
        src, dst = (eng, pool) if store else (pool, eng)
        src, dst, lens = coalesce(src, dst, lens, pool_chunks(pool, self.pool))
        # the driver reads arrays of uint64; converted once, every batch is a view of them
        src, dst, lens = (np.ascontiguousarray(x, dtype=np.uint64) for x in (src, dst, lens))
        stream = mapped.stream(job.direction)
        attrs = mapped.attrs_store if store else mapped.attrs_load
        drv.use_device(mapped.device.ordinal)
        try:
            for i, j in batch_cuts(lens, self.tuning):
                if job.expired():
                    raise JobExpired(f"deadline passed after {a} blocks and {i} of {len(lens)} runs; "
                                     "the rest not started")
                self._copy_runs(drv, stream, attrs, src[i:j], dst[i:j], lens[i:j])
        except cudart.CudaError:
            _log_refused(job, src, dst, lens, self.pool)
            raise

    # one batch of runs; an instance may override it (bench/transfer.py's per-run reference)
    _copy_runs = staticmethod(copy_runs)

    def _finish_on_stream(self, job: CudaJob, error: BaseException | None) -> None:
        """Resolve the job once everything it put on its stream is done: with ``error`` if it failed
        (its notice frees the engine's blocks, so it must not overtake a DMA still running)."""
        mapped: CudaMapping = job.mapped  # type: ignore[assignment]
        dev = mapped.device
        stream = mapped.stream(job.direction)
        drv = cudart.driver()
        try:
            drv.use_device(dev.ordinal)
            with dev.lock:
                done = dev.free_events.pop() if dev.free_events else drv.event_create(cudart.CU_EVENT_DISABLE_TIMING)
            drv.event_record(done, stream)
        except Exception as e:  # noqa: BLE001 - any failure fails the job, never the daemon
            try:  # no event to wait on: let the DMA end first
                drv.stream_synchronize(stream)
            except cudart.CudaError as sync_error:
                log.debug("engine %s: %s", mapped.engine_id, sync_error)
            job.resolve(error or e)
            return
        self.poller.watch(job, done, dev.ordinal, error)

    def _recycle(self, ordinal: int, event: int) -> None:
        dev = self._maps.devices[ordinal]
        with dev.lock:
            dev.free_events.append(event)


def _log_refused(job: CudaJob, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, pool: Pool) -> None:
    """What the driver refused, against the two regions it should lie in."""
    mapped: CudaMapping = job.mapped  # type: ignore[assignment]
    store = job.direction is Direction.STORE
    host, dev = (dst, src) if store else (src, dst)
    log.warning("engine %s: %s refused: %d runs, %d..%d bytes each; pool side [%#x, %#x) in pool "
                "[%#x, %#x); engine side [%#x, %#x) in region [%#x, %#x)", mapped.engine_id,
                job.direction.value, len(lens), int(lens.min()), int(lens.max()), int(host.min()),
                int((host + lens).max()), pool.base_address, pool.base_address + pool.nbytes, int(dev.min()),
                int((dev + lens).max()), mapped.region, mapped.region + mapped.size)


def cuda_available() -> bool:
    """True when the CUDA driver library loads and a GPU device node exists.

    Deliberately cheap (no cuInit, which costs hundreds of milliseconds): the daemon must be ready
    within 1 s. A host whose GPUs turn out unusable still serves; attach then fails with a clear
    error and pinning gives up, leaving the pool usable unpinned.
    """
    import ctypes
    import glob

    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True
