"""Opening an engine's GPU memory by CUDA IPC, for the CUDA backend: the typed mapping it keeps.

Why a registry: the driver lets a process open one IPC memory handle once per context, and several
engines (tensor-parallel ranks of one model sharing an allocation, or re-registrations) may name the
same handle, so openings are refcounted per (device, handle). Each device also keeps the daemon's
pool of completion events and its stream priority range.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvoffd.transfer import cuda_driver as cudart
from kvoffd.transfer import cuda_vmm
from kvoffd.transfer.base import AttachError, Descriptors, Direction, MappedMemory, check_bounds
from kvoffd_client import protocol as P
from kvoffd_client.protocol import Segment

log = logging.getLogger(__name__)

MAX_EVENTS = 4096


@dataclass
class Device:
    """A GPU the daemon has used: its stream priorities and its pool of completion events."""

    ordinal: int
    uuid: str
    prio_low: int
    prio_high: int
    bus_id: str = ""  # PCI bus id (the engine's NUMA node: kvoffd/server/placement.py)
    free_events: list[int] = field(default_factory=list)  # completion events, reused
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(kw_only=True)
class CudaMapping(MappedMemory):
    """An engine's GPU memory opened by CUDA IPC, with the streams and events the daemon keeps for it."""

    device: Device
    key: tuple[int, bytes]  # (ordinal, IPC handle): the refcounted opening
    region: int  # device address of the region's first byte (allocation base + offset)
    load_stream: int
    store_stream: int
    events: list[int]  # the engine's interprocess event ring, opened here
    attrs_store: cudart.MemcpyAttributes
    attrs_load: cudart.MemcpyAttributes
    vmm: cuda_vmm.VmmRange | None = None  # ``cuda_vmm`` memory: the pieces mapped here (key unused then)
    closed: bool = False  # aborted (the engine died) or detached: jobs fail instead of starting
    detached: bool = False  # streams and events destroyed, the IPC opening closed

    def stream(self, direction: Direction) -> int:
        return self.store_stream if direction is Direction.STORE else self.load_stream


class IpcMaps:
    """The engines' GPU memory this process has opened, and the devices it has used."""

    def __init__(self) -> None:
        self.devices: dict[int, Device] = {}
        self._opened: dict[tuple[int, bytes], list[int]] = {}  # key -> [base, refcount]
        self._lock = threading.Lock()

    def _device(self, drv: cudart.Driver, ordinal: int, uuid: str) -> Device:
        with self._lock:
            dev = self.devices.get(ordinal)
            if dev is None:
                drv.use_device(ordinal)
                low, high = drv.stream_priority_range()
                try:
                    bus_id = drv.pci_bus_id(ordinal)
                except cudart.CudaError:
                    bus_id = ""
                dev = self.devices[ordinal] = Device(ordinal, uuid, low, high, bus_id)
            return dev

    def open(self, engine_id: str, memory: P.CudaIpc, num_blocks: int, segments: list[Segment]
             ) -> CudaMapping:
        """Validate REGISTER's ``cuda_ipc`` memory and open it: region, event ring, two streams."""
        handle, offset, size = memory.handle, memory.offset, memory.size
        if type(handle) is not bytes or len(handle) != cudart.IPC_HANDLE_BYTES:
            raise AttachError(f"memory.handle must be {cudart.IPC_HANDLE_BYTES} bytes")
        drv, dev, events = self._prepare(memory, num_blocks, segments)
        key = (dev.ordinal, handle)
        base = None
        try:
            drv.use_device(dev.ordinal)
            base = self._open(drv, key)
            _, alloc_size = drv.address_range(base)
            if offset + size > alloc_size:
                raise AttachError(f"region [{offset}, +{size}) exceeds the {alloc_size}-byte allocation")
            return self._finish(engine_id, "cuda_ipc", drv, dev, memory, num_blocks, segments, events,
                                key=key, region=base + offset)
        except (cudart.CudaError, AttachError) as e:
            if base is not None:
                self._close(drv, key)
            raise AttachError(f"cannot map the engine's GPU memory: {e}") from None

    def open_vmm(self, engine_id: str, memory: P.CudaVmm, handover: Descriptors | None, num_blocks: int,
                 segments: list[Segment]) -> CudaMapping:
        """``cuda_vmm`` memory (cuda_vmm.py): import the pieces' descriptors (``handover``: descriptor i
        is piece i), map them into one VA range, then the event ring and streams as for IPC. The
        descriptors are closed whatever happens."""
        fds, pieces = (handover.fds if handover is not None else []), memory.pieces
        try:
            if not pieces or len(fds) != len(pieces) or any(type(fd) is not int for fd in fds):
                raise AttachError("memory.pieces must come with one descriptor per piece")
            drv, dev, events = self._prepare(memory, num_blocks, segments)
            vmm = cuda_vmm.Vmm(drv)
        except (AttachError, cudart.CudaUnavailable) as e:
            if handover is not None:
                handover.close()
            raise AttachError(str(e)) from None
        rng = None
        try:
            drv.use_device(dev.ordinal)
            rng = cuda_vmm.map_pieces(vmm, dev.ordinal, fds, pieces)
            if memory.offset + memory.size > rng.reserved:
                raise AttachError(f"region [{memory.offset}, +{memory.size}) exceeds the {rng.reserved} "
                                  "bytes of its pieces")
            return self._finish(engine_id, "cuda_vmm", drv, dev, memory, num_blocks, segments, events,
                                key=(dev.ordinal, b""), region=rng.va + memory.offset, vmm=rng)
        except (cudart.CudaError, AttachError) as e:
            if rng is not None:
                cuda_vmm.unmap(vmm, rng)
            raise AttachError(f"cannot map the engine's VMM memory: {e}") from None

    def _prepare(self, memory: P.CudaIpc | P.CudaVmm, num_blocks: int, segments: list[Segment]
                 ) -> tuple[cudart.Driver, Device, list[bytes]]:
        """The checks both kinds share (size, offset, GPU, event ring) and the device they name."""
        offset, size = memory.offset, memory.size
        uuid, events = memory.device_uuid, list(memory.events)
        if type(offset) is not int or offset < 0 or type(size) is not int or size <= 0:
            raise AttachError("memory.offset must be an integer >= 0 and memory.size a positive integer")
        if type(uuid) is not str or not uuid:
            raise AttachError("memory.device_uuid must name the GPU (GPU-xxxxxxxx-...)")
        if (type(events) is not list or len(events) > MAX_EVENTS
                or any(type(e) is not bytes or len(e) != cudart.IPC_HANDLE_BYTES for e in events)):
            raise AttachError(f"memory.events must be a list of at most {MAX_EVENTS} IPC event handles")
        check_bounds(size, num_blocks, segments)
        try:
            drv = cudart.driver()
            ordinal = drv.ordinal_of(uuid)
        except (cudart.CudaUnavailable, cudart.CudaError, LookupError) as e:
            raise AttachError(str(e)) from None
        return drv, self._device(drv, ordinal, uuid), events

    def _finish(self, engine_id: str, kind: str, drv: cudart.Driver, dev: Device, memory: P.CudaIpc | P.CudaVmm,
                num_blocks: int, segments: list[Segment], events: list[bytes], *, key: tuple[int, bytes],
                region: int, vmm: cuda_vmm.VmmRange | None = None) -> CudaMapping:
        """Open the event ring and make the two streams; on failure destroy what was made and raise."""
        opened_events: list[int] = []
        streams: list[int] = []
        try:
            for e in events:
                opened_events.append(drv.ipc_open_event_handle(e))
            streams.append(drv.stream_create(dev.prio_high))
            streams.append(drv.stream_create(dev.prio_low))
        except cudart.CudaError:
            for ev in opened_events:
                _quiet(drv.event_destroy, ev)
            for s in streams:
                _quiet(drv.stream_destroy, s)
            raise
        size = memory.size
        log.info("engine %s: mapped %d bytes on GPU %d (%s, %s), %d events, %d segments", engine_id, size,
                 dev.ordinal, dev.uuid, kind, len(opened_events), len(segments))
        return CudaMapping(engine_id=engine_id, kind=kind, size=size, num_blocks=num_blocks,
                           segments=segments, slot_bytes=sum(s.length for s in segments),
                           num_events=len(opened_events), gpu_ordinal=dev.ordinal, pci_bus_id=dev.bus_id,
                           device=dev, key=key, region=region,
                           load_stream=streams[0], store_stream=streams[1], events=opened_events,
                           attrs_store=cudart.copy_attributes(dev.ordinal, store=True),
                           attrs_load=cudart.copy_attributes(dev.ordinal, store=False), vmm=vmm)

    def release_events(self) -> None:
        """Destroy the devices' pooled completion events (the daemon is stopping)."""
        try:
            drv = cudart.driver()
        except cudart.CudaUnavailable:
            return
        for dev in self.devices.values():
            drv.use_device(dev.ordinal)
            for ev in dev.free_events:
                drv.event_destroy(ev)
            dev.free_events.clear()

    def close(self, mapped: CudaMapping) -> None:
        """Destroy the mapping's streams (once their copies are over) and events, and close its opening."""
        if mapped.detached:
            return
        mapped.closed = mapped.detached = True
        drv = cudart.driver()
        drv.use_device(mapped.device.ordinal)
        # The server detaches only with no job in flight; draining the streams makes sure even a
        # cancelled job's DMA is over before the memory goes away.
        for s in (mapped.load_stream, mapped.store_stream):
            _quiet(drv.stream_synchronize, s)
            _quiet(drv.stream_destroy, s)
        for ev in mapped.events:
            _quiet(drv.event_destroy, ev)
        if mapped.vmm is not None:
            cuda_vmm.unmap(cuda_vmm.Vmm(drv), mapped.vmm)
            return
        try:
            self._close(drv, mapped.key)
        except cudart.CudaError as e:
            log.warning("engine %s: closing its IPC mapping: %s", mapped.engine_id, e)

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


def _quiet(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except cudart.CudaError as e:
        log.debug("%s%r: %s", getattr(fn, "__name__", fn), args, e)
