"""CUDA backend: engine KV memory mapped by CUDA IPC, copied by the copy engines in batched DMAs.

How one job moves (docs/cuda.md has the full story and the measurements):
  1. descriptors for every (block, segment) run are built with numpy (``run_descriptors``) and
     coalesced, so a block-contiguous cache gives one run per block;
  2. a job naming an event of the engine's interprocess ring is *gated*: the poller thread queries
     that event and submits the job only once it fired, i.e. once the step's forward wrote the
     blocks. (A device-side ``cuStreamWaitEvent`` would be cheaper by a poll, but if the engine dies
     before its GPU reaches the event the daemon's stream waits forever and every later call on it
     hangs: measured on the H200, see docs/cuda.md. Host-side, a dead engine's gated jobs just fail.)
     Jobs then go to the engine's own stream pair (loads at the highest priority, stores at the
     lowest);
  3. the runs go to the copy engines in ``cuMemcpyBatchAsync`` calls of at most ``batch_runs``
     descriptors (no SMs used, no staging), then a completion event is recorded;
  4. one poller thread queries the completion events of every job in flight and resolves the jobs'
     futures on the event loop. (uvloop's timers tick in milliseconds, so polling from the loop
     would add up to 1 ms per job; a thread sleeping ~50 us between sweeps adds far less.)

Small jobs are submitted inline on the loop thread (tens of microseconds). Of a large one, where the
driver spends milliseconds building descriptors, only the first ``inline_runs`` runs are: the copy
engine starts at once, and a small thread pool queues the rest behind them, so the loop never stalls
and the DMA never waits for the pool thread to get the GIL.
Nothing here imports torch, and nothing touches CUDA at import time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffd.cache.pool import Pool
from kvoffd.transfer import cuda_driver as cudart
from kvoffd.transfer.base import (
    AttachError,
    Direction,
    JobExpired,
    MappedMemory,
    TransferBackend,
    coalesce,
    past,
    pool_chunks,
    run_descriptors,
)
from kvoffd.transfer.pinning import Pinner
from kvoffd_client.protocol import Segment

log = logging.getLogger(__name__)

MAX_EVENTS = 4096


@dataclass
class _Device:
    ordinal: int
    uuid: str
    prio_low: int
    prio_high: int
    free_events: list[int] = field(default_factory=list)  # completion events, reused
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Mapping:
    """Backend-private state of one attached engine (``MappedMemory.handle``)."""

    device: _Device
    key: tuple[int, bytes]  # (ordinal, IPC handle): the refcounted opening
    region: int  # device address of the region's first byte (allocation base + offset)
    load_stream: int
    store_stream: int
    events: list[int]  # the engine's interprocess event ring, opened here
    attrs_store: cudart.MemcpyAttributes
    attrs_load: cudart.MemcpyAttributes
    closed: bool = False  # detached or aborted: gated jobs fail instead of starting


@dataclass
class _Gate:
    """A job waiting (host side) for the engine's event before it is submitted."""

    event: int
    mapping: _Mapping
    args: tuple
    deadline: float


@dataclass
class _Pending:
    event: int
    device: _Device
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    error: BaseException | None = None  # the job failed, but only once what it enqueued is done


class CudaBackend(TransferBackend):
    name = "cuda"

    def __init__(self, pool: Pool, *, batch_runs: int = 512, batch_bytes: int = 256 << 20, inline_runs: int = 256,
                 head_bytes: int = 512 << 20, submit_threads: int = 4,
                 poll_us: float = 20.0, pin: bool = True, pin_threads: int = 0, pin_region_bytes: int = 1 << 30,
                 method: str = "batch", wait: str = "host", gate_timeout_s: float = 120.0):
        super().__init__(pool)
        self.wait = wait  # "host" (gate in the poller) or "device" (cuStreamWaitEvent; see above)
        self.gate_timeout_s = gate_timeout_s
        self._gates: list[_Gate] = []
        self.batch_runs = batch_runs  # descriptors per cuMemcpyBatchAsync call ...
        self.batch_bytes = batch_bytes  # ... and bytes: small calls let the DMA start while the rest is queued
        self.inline_runs = inline_runs  # ~1 us of driver time each on the loop thread
        self.head_bytes = head_bytes  # ~10 ms of DMA: ample time for the pool thread to queue the rest
        self.poll_s = poll_us * 1e-6
        self.method = method  # "batch" (cuMemcpyBatchAsync) or "loop" (cuMemcpyAsync per run; reference)
        self._pin = pin
        self._pin_args = {"threads": pin_threads, "region_bytes": pin_region_bytes, "remap_private": True}
        self.pinner: Pinner | None = None
        self._submit = ThreadPoolExecutor(submit_threads, thread_name_prefix="kvoffd-cuda-submit")
        self._devices: dict[int, _Device] = {}
        self._opened: dict[tuple[int, bytes], list[int]] = {}  # key -> [base, refcount]
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._poller: threading.Thread | None = None
        self.bytes_moved = {Direction.STORE: 0, Direction.LOAD: 0}

    # --- lifecycle --------------------------------------------------------------------------------
    def kinds(self) -> tuple[str, ...]:
        return ("cuda_ipc",)

    def start(self) -> None:
        """Start the completion poller and the background pinning; returns at once."""
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="kvoffd-cuda-poll", daemon=True)
            self._poller.start()
        if self._pin and self.pinner is None:
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
            self.pinner = Pinner(pool, progress, **self._pin_args)
            self.pinner.start()

    def close(self) -> None:
        if self.pinner is not None:
            self.pinner.stop()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._poller is not None:
            self._poller.join(5)
        self._submit.shutdown(wait=True, cancel_futures=True)
        if self.pinner is not None:
            self.pinner.unpin()
        try:
            drv = cudart.driver()
        except cudart.CudaUnavailable:
            return
        for dev in self._devices.values():
            drv.use_device(dev.ordinal)
            for ev in dev.free_events:
                drv.event_destroy(ev)
            dev.free_events.clear()

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "method": self.method, "batch_runs": self.batch_runs}
        try:
            drv = cudart.driver()
            d["driver_version"] = drv.version
            d["batch_abi"] = drv.batch_abi or "none"
        except cudart.CudaUnavailable as e:
            d["error"] = str(e)
        d["devices"] = {dev.ordinal: dev.uuid for dev in self._devices.values()}
        if self.pinner is not None:
            s = self.pinner.stats
            d["pinning"] = {"pinned_bytes": s.pinned_bytes, "total_bytes": s.total_bytes,
                            "gib_per_s": round(s.gib_per_s, 2), "done": bool(s.finished), "error": s.error}
        return d

    # --- attach / detach ------------------------------------------------------------------------------
    def _device(self, drv: cudart.Driver, ordinal: int, uuid: str) -> _Device:
        with self._lock:
            dev = self._devices.get(ordinal)
            if dev is None:
                drv.use_device(ordinal)
                low, high = drv.stream_priority_range()
                dev = self._devices[ordinal] = _Device(ordinal, uuid, low, high)
            return dev

    def attach(self, engine_id: str, memory: dict[str, Any], num_blocks: int,
               segments: list[Segment]) -> MappedMemory:
        handle, offset, size = memory.get("handle"), memory.get("offset", 0), memory.get("size")
        uuid, events = memory.get("device_uuid"), memory.get("events", [])
        if type(handle) is not bytes or len(handle) != cudart.IPC_HANDLE_BYTES:
            raise AttachError(f"memory.handle must be {cudart.IPC_HANDLE_BYTES} bytes")
        if type(offset) is not int or offset < 0 or type(size) is not int or size <= 0:
            raise AttachError("memory.offset must be an integer >= 0 and memory.size a positive integer")
        if type(uuid) is not str or not uuid:
            raise AttachError("memory.device_uuid must name the GPU (GPU-xxxxxxxx-...)")
        if (type(events) is not list or len(events) > MAX_EVENTS
                or any(type(e) is not bytes or len(e) != cudart.IPC_HANDLE_BYTES for e in events)):
            raise AttachError(f"memory.events must be a list of at most {MAX_EVENTS} IPC event handles")
        mapped = MappedMemory(engine_id=engine_id, kind="cuda_ipc", size=size, num_blocks=num_blocks,
                              segments=segments, slot_bytes=sum(s.length for s in segments))
        mapped.check_bounds()
        try:
            drv = cudart.driver()
            ordinal = drv.ordinal_of(uuid)
        except (cudart.CudaUnavailable, cudart.CudaError, LookupError) as e:
            raise AttachError(str(e)) from None
        dev = self._device(drv, ordinal, uuid)
        key = (ordinal, handle)
        opened_events: list[int] = []
        streams: list[int] = []
        base = None
        try:
            drv.use_device(ordinal)
            base = self._open(drv, key)
            _, alloc_size = drv.address_range(base)
            if offset + size > alloc_size:
                raise AttachError(f"region [{offset}, +{size}) exceeds the {alloc_size}-byte allocation")
            for e in events:
                opened_events.append(drv.ipc_open_event_handle(e))
            streams.append(drv.stream_create(dev.prio_high))
            streams.append(drv.stream_create(dev.prio_low))
        except (cudart.CudaError, AttachError) as e:
            for ev in opened_events:
                _quiet(drv.event_destroy, ev)
            for s in streams:
                _quiet(drv.stream_destroy, s)
            if base is not None:
                self._close(drv, key)
            raise AttachError(f"cannot map the engine's GPU memory: {e}") from None
        mapped.handle = _Mapping(device=dev, key=key, region=base + offset, load_stream=streams[0],
                                 store_stream=streams[1], events=opened_events,
                                 attrs_store=cudart.copy_attributes(ordinal, store=True),
                                 attrs_load=cudart.copy_attributes(ordinal, store=False))
        mapped.extra.update({"device": ordinal, "uuid": uuid, "num_events": len(opened_events)})
        log.info("engine %s: mapped %d bytes on GPU %d (%s), %d events, %d segments", engine_id, size, ordinal,
                 uuid, len(opened_events), len(segments))
        return mapped

    def _open(self, drv: cudart.Driver, key: tuple[int, bytes]) -> int:
        """Open an IPC handle once per process (the driver allows one opening per context)."""
        with self._lock:
            ent = self._opened.get(key)
            if ent is not None:
                ent[1] += 1
                return ent[0]
            base = drv.ipc_open_mem_handle(key[1])
            self._opened[key] = [base, 1]
            return base

    def _close(self, drv: cudart.Driver, key: tuple[int, bytes]) -> None:
        with self._lock:
            ent = self._opened.get(key)
            if ent is None:
                return
            ent[1] -= 1
            if ent[1] > 0:
                return
            del self._opened[key]
        drv.ipc_close_mem_handle(ent[0])

    def detach(self, mapped: MappedMemory) -> None:
        m: _Mapping | None = mapped.handle
        if m is None:
            return
        self.abort(mapped)
        mapped.handle = None
        drv = cudart.driver()
        drv.use_device(m.device.ordinal)
        # The server detaches only with no job in flight; draining the streams makes sure even a
        # cancelled job's DMA is over before the memory goes away.
        for s in (m.load_stream, m.store_stream):
            _quiet(drv.stream_synchronize, s)
            _quiet(drv.stream_destroy, s)
        for ev in m.events:
            _quiet(drv.event_destroy, ev)
        try:
            self._close(drv, m.key)
        except cudart.CudaError as e:
            log.warning("engine %s: closing its IPC mapping: %s", mapped.engine_id, e)

    # --- copies -----------------------------------------------------------------------------------
    def submit(self, direction: Direction, mapped: MappedMemory, block_ids: np.ndarray,
               slots: np.ndarray, event: int = -1, expires_ns: int = 0) -> Awaitable[None]:
        m: _Mapping | None = mapped.handle
        if m is None:
            raise RuntimeError(f"engine {mapped.engine_id} is not mapped")
        if event >= len(m.events):
            raise ValueError(f"event {event} is outside the engine's ring of {len(m.events)}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if len(block_ids) == 0:
            fut.set_result(None)
            return fut
        if event >= 0 and self.wait == "host":
            args = (direction, mapped, m, block_ids, slots, -1, expires_ns, fut, loop)
            drv = cudart.driver()
            drv.use_device(m.device.ordinal)
            if not drv.event_query(m.events[event]):
                with self._cond:
                    deadline = time.monotonic() + self.gate_timeout_s
                    if expires_ns:  # never start after the client gave up (it may reuse the blocks)
                        deadline = min(deadline, expires_ns / 1e9)
                    self._gates.append(_Gate(m.events[event], m, args, deadline))
                    self._cond.notify()
                return fut
        else:
            args = (direction, mapped, m, block_ids, slots, event, expires_ns, fut, loop)
        self._start(*args)
        return fut

    def _start(self, direction: Direction, mapped: MappedMemory, m: _Mapping, block_ids: np.ndarray,
               slots: np.ndarray, event: int, expires_ns: int, fut: asyncio.Future,
               loop: asyncio.AbstractEventLoop) -> None:
        """Put a job on its stream. Small jobs go all at once from this thread; a large one has its
        first ``inline_runs`` runs enqueued here, so the copy engine starts at once, and the rest
        from the submit pool (building thousands of descriptors takes the driver milliseconds). The
        head start covers the time the pool thread may wait for the GIL while the loop does the
        job's bookkeeping.

        The deadline is checked here (a gated job whose event fired late, or a poller that was
        frozen) and again by the pool thread before it enqueues the rest: once on a stream a copy
        runs, so those are the last points where a late job can still be kept from starting."""
        if past(expires_ns):
            _resolve(loop, fut, JobExpired("deadline passed before the copy could start; not started"))
            return
        # the head: up to ``inline_runs`` descriptors, and no more than ``head_bytes`` of payload
        head = max(1, min(self.inline_runs // len(mapped.segments), self.head_bytes // mapped.slot_bytes))
        if len(block_ids) <= head:
            self._submit_job(direction, mapped, m, block_ids, slots, event, fut, loop, expires_ns)
            return
        try:
            self._enqueue(direction, mapped, m, block_ids[:head], slots[:head], event)
        except Exception as e:  # noqa: BLE001 - the job fails, never the daemon
            self._finish_on_stream(direction, m, fut, loop, e)  # part of the head may be on the stream
            return
        try:
            self._submit.submit(self._submit_job, direction, mapped, m, block_ids[head:], slots[head:], -1, fut,
                                loop, expires_ns, True)
        except RuntimeError as e:  # the pool is shut down: the daemon is stopping
            _resolve(loop, fut, e)

    def abort(self, mapped: MappedMemory) -> int:
        """The engine is gone: fail its jobs still waiting for an event (they never reached a stream).

        Returns how many were failed. Jobs already on a stream finish normally (the IPC mapping keeps
        the memory alive until detach). Safe to call from any thread.
        """
        m: _Mapping | None = mapped.handle
        if m is None:
            return 0
        m.closed = True
        with self._cond:
            dead = [g for g in self._gates if g.mapping is m]
            self._gates = [g for g in self._gates if g.mapping is not m]
        for g in dead:
            _resolve(g.args[-1], g.args[-2], RuntimeError(f"engine {mapped.engine_id} left before its event fired"))
        return len(dead)

    def _enqueue(self, direction: Direction, mapped: MappedMemory, m: _Mapping, block_ids: np.ndarray,
                 slots: np.ndarray, event: int) -> None:
        """Queue the copies of these blocks on the job's stream (after ``event`` if >= 0)."""
        drv = cudart.driver()
        eng, pool, lens = run_descriptors(mapped, block_ids, slots, self.pool.base_address)
        eng += m.region
        store = direction is Direction.STORE
        src, dst = (eng, pool) if store else (pool, eng)
        src, dst, lens = coalesce(src, dst, lens, pool_chunks(pool, self.pool))
        stream = m.store_stream if store else m.load_stream
        drv.use_device(m.device.ordinal)
        if event >= 0:
            drv.stream_wait_event(stream, m.events[event])
        try:
            if self.method == "batch" and drv.has_batch:
                self._batch(drv, stream, m.attrs_store if store else m.attrs_load, src, dst, lens)
            else:
                for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True):
                    drv.memcpy_async(d, s, n, stream)
        except cudart.CudaError:
            # what the driver refused, against the two regions it should lie in
            pool0, pool1 = self.pool.base_address, self.pool.base_address + self.pool.nbytes
            host = dst if store else src
            log.warning("engine %s: %s refused: %d runs, %d..%d bytes each; pool side [%#x, %#x) in pool "
                        "[%#x, %#x); engine side [%#x, %#x) in region [%#x, %#x)", mapped.engine_id,
                        direction.value, len(lens), int(lens.min()), int(lens.max()), int(host.min()),
                        int((host + lens).max()), pool0, pool1, int((src if store else dst).min()),
                        int(((src if store else dst) + lens).max()), m.region, m.region + mapped.size)
            raise
        self.bytes_moved[direction] += int(lens.sum())

    def _submit_job(self, direction: Direction, mapped: MappedMemory, m: _Mapping, block_ids: np.ndarray,
                    slots: np.ndarray, event: int, fut: asyncio.Future, loop: asyncio.AbstractEventLoop,
                    expires_ns: int = 0, after_head: bool = False) -> None:
        """Enqueue (the rest of) a job, record its completion event and hand that to the poller.

        ``after_head``: the job's head is already on the stream. If the rest cannot be enqueued (its
        deadline passed while it waited for a pool thread, or the driver refused it), the job fails,
        but only once the head's DMA is over: the event recorded behind it decides when."""
        error: BaseException | None = None
        if past(expires_ns):
            error = JobExpired("deadline passed while the job waited for a submit thread; the rest not started")
            if not after_head:
                _resolve(loop, fut, error)
                return
        else:
            try:
                self._enqueue(direction, mapped, m, block_ids, slots, event)
            except Exception as e:  # noqa: BLE001 - any failure fails the job, never the daemon
                error = e  # some of its batches may be on the stream already
        self._finish_on_stream(direction, m, fut, loop, error)

    def _finish_on_stream(self, direction: Direction, m: _Mapping, fut: asyncio.Future,
                          loop: asyncio.AbstractEventLoop, error: BaseException | None) -> None:
        """Resolve the job once everything it put on its stream is done: with ``error`` if it failed
        (its notice frees the engine's blocks, so it must not overtake a DMA still running)."""
        dev = m.device
        stream = m.store_stream if direction is Direction.STORE else m.load_stream
        drv = cudart.driver()
        try:
            drv.use_device(dev.ordinal)
            with dev.lock:
                done = dev.free_events.pop() if dev.free_events else drv.event_create(cudart.CU_EVENT_DISABLE_TIMING)
            drv.event_record(done, stream)
        except Exception as e:  # noqa: BLE001 - any failure fails the job, never the daemon
            _quiet(drv.stream_synchronize, stream)  # no event to wait on: let the DMA end first
            _resolve(loop, fut, error or e)
            return
        with self._cond:
            self._pending.append(_Pending(done, dev, fut, loop, error))
            self._cond.notify()

    def _batch(self, drv: cudart.Driver, stream: int, attrs: cudart.MemcpyAttributes, src: np.ndarray,
               dst: np.ndarray, lens: np.ndarray) -> None:
        src = np.ascontiguousarray(src, dtype=np.uint64)
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        lens = np.ascontiguousarray(lens, dtype=np.uint64)
        n = len(lens)
        if n <= 1 or int(lens[-1]) * n <= self.batch_bytes and n <= self.batch_runs:
            cuts = [0, n]
        else:  # cut at every batch_bytes of payload and every batch_runs descriptors
            by_bytes = np.searchsorted(np.cumsum(lens), np.arange(self.batch_bytes, int(lens.sum()), self.batch_bytes,
                                                                  dtype=np.uint64), side="right")
            cuts = sorted({0, n, *by_bytes.tolist(), *range(self.batch_runs, n, self.batch_runs)})
        for a, b in zip(cuts, cuts[1:], strict=False):
            if b > a:
                drv.memcpy_batch_async(dst[a:].ctypes.data, src[a:].ctypes.data, lens[a:].ctypes.data, b - a,
                                       attrs, stream)

    # --- completion -----------------------------------------------------------------------------------
    def _poll(self) -> None:
        """Start gated jobs whose event fired and resolve jobs whose completion event fired.

        Sleeps on a condition when nothing is waiting, ~``poll_us`` between sweeps otherwise.
        """
        drv = None
        current = -1
        while True:
            with self._cond:
                while not self._pending and not self._gates and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._pending:
                    for g in self._gates:
                        _resolve(g.args[-1], g.args[-2], RuntimeError("the daemon is stopping"))
                    self._gates = []
                    return
                pending = list(self._pending)
                gates = list(self._gates)
            if drv is None:
                drv = cudart.driver()
            progressed = False
            if gates:
                ready: list[_Gate] = []
                failed: list[tuple[_Gate, BaseException]] = []
                now = time.monotonic()
                for g in gates:
                    dev = g.mapping.device.ordinal
                    try:
                        if dev != current:
                            drv.use_device(dev)
                            current = dev
                        if g.mapping.closed:
                            failed.append((g, RuntimeError("the engine was detached")))
                        elif drv.event_query(g.event):
                            ready.append(g)
                        elif now > g.deadline:
                            expired = past(g.args[-3])
                            failed.append((g, (JobExpired if expired else TimeoutError)(
                                "the engine's event did not fire before the job's deadline; not started")))
                    except cudart.CudaError as e:
                        failed.append((g, e))
                if ready or failed:
                    progressed = True
                    gone = {id(g) for g in ready} | {id(g) for g, _ in failed}
                    with self._cond:
                        self._gates = [g for g in self._gates if id(g) not in gone]
                    for g in ready:
                        self._start(*g.args)
                    for g, err in failed:
                        _resolve(g.args[-1], g.args[-2], err)
            finished: list[tuple[_Pending, BaseException | None]] = []
            for p in pending:
                try:
                    if p.device.ordinal != current:
                        drv.use_device(p.device.ordinal)
                        current = p.device.ordinal
                    if drv.event_query(p.event):
                        finished.append((p, None))
                except cudart.CudaError as e:
                    finished.append((p, e))
            if finished:
                progressed = True
                gone = {id(p) for p, _ in finished}
                with self._cond:
                    self._pending = [p for p in self._pending if id(p) not in gone]
                for p, err in finished:
                    if err is None:
                        with p.device.lock:
                            p.device.free_events.append(p.event)
                    _resolve(p.loop, p.future, err or p.error)
            if not progressed:
                time.sleep(self.poll_s)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, err: BaseException | None) -> None:
    def done() -> None:
        if fut.done():
            return
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)

    try:
        if _in_loop(loop):
            done()
        else:
            loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed (daemon stopping)
        pass


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _quiet(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except cudart.CudaError as e:
        log.debug("%s%r: %s", getattr(fn, "__name__", fn), args, e)


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


available = cuda_available
