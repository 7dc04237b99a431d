"""Connector side of the CUDA path: share vLLM's GPU KV memory and an event ring with the daemon.

vLLM allocates a worker's whole KV cache as one int8 buffer and hands the connector strided per-layer
views of it (vllm-api.md §4.1), so one CUDA IPC handle describes every layer. The handle must name
the *allocation* (the caching allocator may place the buffer at an interior pointer), so we export
the allocation's base plus ``offset`` = buffer start - base; the daemon opens the handle once and
addresses ``base + offset + segment offsets``.

We use the raw driver calls (``cuIpcGetMemHandle``) rather than torch's storage sharing: torch's
path also creates a reference-count file under /dev/shm, which would force a shared /dev/shm on
containers for nothing.

Ordering (vllm-api.md rules 4-6): after the step's forward the worker records one interprocess
event of the ring on its compute stream and names its index in STORE; the daemon's copy stream
waits on it. A slot is reused only after every job naming it completed (``retain``/``release``),
because a re-record before the daemon's wait would let the copy run ahead of the writes.

Only this module imports torch; the daemon never does.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

from kvoffd_client import protocol as P
from kvoffd_client.memory.local import LocalMemory

IPC_HANDLE_BYTES = 64
DEFAULT_EVENTS = 64


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_cuda: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _cuda
    if _cuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _cuda = lib
    return _cuda


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")


def export_allocation(ptr: int) -> tuple[bytes, int, int]:
    """(IPC handle of the allocation holding device pointer ``ptr``, ptr - base, allocation size).

    Fails for memory without a legacy IPC handle (cuMemCreate/VMM: PyTorch ``expandable_segments``,
    vLLM sleep mode / CuMem allocator); docs/cuda.md says what to do then.
    """
    lib = _lib()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    h = _Handle()
    rc = lib.cuIpcGetMemHandle(ctypes.byref(h), base.value)
    if rc != 0:
        try:
            _check(rc, "cuIpcGetMemHandle")
        except RuntimeError as e:
            raise RuntimeError(f"{e}: the KV cache has no legacy CUDA IPC handle; it was probably allocated "
                               "with cuMemCreate (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or vLLM "
                               "sleep mode) and is not exportable as descriptors (docs/cuda.md, VMM memory).") from None
    return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES), ptr - base.value, size.value


def device_uuid(device: Any) -> str:
    """``GPU-xxxxxxxx-...`` of a torch device; the daemon maps it to its own ordinal."""
    import torch

    u = str(torch.cuda.get_device_properties(device).uuid)
    return u if u.startswith(("GPU-", "MIG-")) else "GPU-" + u


class EventRing:
    """A ring of interprocess CUDA events the daemon opened at REGISTER.

    ``record()`` marks "the writes so far on this stream" and returns the slot index to put in
    STORE/LOAD ``event``; ``release(i)`` once the job naming it has completed (failed or not).
    When every slot is busy, ``record()`` synchronizes the stream and returns -1 (correct, slower).
    """

    def __init__(self, device: Any, n: int = DEFAULT_EVENTS):
        import torch

        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.events = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                           for _ in range(n)]
            self.handles = [bytes(e.ipc_handle()) for e in self.events]
        self._refs = [0] * n
        self._next = 0
        self._lock = threading.Lock()

    def record(self, stream: Any = None) -> int:
        i = self.try_record(stream)
        if i < 0:
            import torch

            (stream or torch.cuda.current_stream(self.device)).synchronize()
        return i

    def try_record(self, stream: Any = None) -> int:
        """``record`` without the fallback: -1 when every slot is busy, and nothing waited for (the
        caller names another event, e.g. a later one, instead: a layer-wise store mid-forward)."""
        import torch

        stream = stream or torch.cuda.current_stream(self.device)
        with self._lock:
            n = len(self.events)
            for k in range(n):
                i = (self._next + k) % n
                if self._refs[i] == 0:
                    self._refs[i] = 1
                    self._next = (i + 1) % n
                    break
            else:
                return -1
        self.events[i].record(stream)
        return i

    def retain(self, i: int) -> None:
        """Another job names the same slot (one record per step, several jobs)."""
        if i >= 0:
            with self._lock:
                self._refs[i] += 1

    def release(self, i: int) -> None:
        if i >= 0:
            with self._lock:
                self._refs[i] = max(0, self._refs[i] - 1)

    @property
    def busy(self) -> int:
        return sum(1 for r in self._refs if r)


@dataclass
class CudaExport:
    """What REGISTER needs (``memory``: ``P.CudaIpc``, or ``P.CudaVmm`` with its pieces' descriptors;
    ``layout``) plus the ring the worker records into."""

    memory: LocalMemory
    layout: dict[str, Any]
    ring: EventRing
    region_ptr: int
    keepalive: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Let go of the memory's exported descriptors (VMM): before the engine frees it (sleep)."""
        self.memory.close()


def export_kv_caches(tensors: dict[str, Any], num_blocks: int, *, layout: dict[str, Any] | None = None,
                     num_events: int = DEFAULT_EVENTS) -> CudaExport:
    """Describe vLLM's GPU KV tensors for REGISTER (kind ``cuda_ipc``, or ``cuda_vmm`` when they live in
    ``cuMemCreate`` memory: ``kvoffd_client.memory.cuda_vmm``).

    Every tensor must live in one allocation (vLLM's single int8 buffer). ``layout`` defaults to
    ``kvoffd_client.memory.cpu_fd.describe_layout(tensors, num_blocks)``, whose segment offsets count from
    the start of the shared storage; that start is the region exported here.
    """
    ts = list(tensors.values())
    if not ts:
        raise ValueError("no KV tensors")
    dev = ts[0].device
    if dev.type != "cuda" or any(t.device != dev for t in ts):
        raise ValueError("every KV tensor must be on the same CUDA device")
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in ts}
    if len(storages) != 1:
        raise ValueError(f"kvoffd needs every KV tensor in one allocation (vLLM's single buffer); "
                         f"found {len(storages)}")
    region_ptr, storage = next(iter(storages.items()))
    if layout is None:
        from kvoffd_client.memory.layout import describe_layout

        layout = describe_layout(tensors, num_blocks)
    try:
        handle, offset, _ = export_allocation(region_ptr)
    except RuntimeError:
        from kvoffd_client.memory import cuda_vmm

        if not cuda_vmm.is_vmm(region_ptr):
            raise
        # cuMemCreate memory has no IPC handle: its physical pieces go as POSIX descriptors instead
        ring = EventRing(dev, num_events)
        vmm = cuda_vmm.export_region(region_ptr, storage.nbytes(), device_uuid=device_uuid(dev), events=ring.handles)
        return CudaExport(memory=vmm, layout=layout, ring=ring, region_ptr=region_ptr, keepalive=ts)
    ring = EventRing(dev, num_events)
    memory = P.CudaIpc(handle=handle, offset=offset, size=storage.nbytes(), device_uuid=device_uuid(dev),
                       events=ring.handles)
    return CudaExport(memory=LocalMemory(memory), layout=layout, ring=ring, region_ptr=region_ptr, keepalive=ts)
