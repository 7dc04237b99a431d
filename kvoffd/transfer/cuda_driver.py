"""ctypes bindings to the CUDA *driver* API (libcuda.so.1): the few calls the daemon needs (the
importing half of IPC: engines export, in the client library).

Why the driver API and not libcudart or torch:
  * libcuda.so.1 is present wherever a GPU is usable (it comes with the driver), while libcudart
    lives in a version-numbered file inside some Python package or toolkit; the daemon would have
    to hunt for it.
  * The daemon needs no torch at all on its serving path: importing torch costs ~1 s and a CUDA
    context from torch's caching allocator is of no use to it. Readiness within 1 s stays easy.
  * ``cuMemcpyBatchAsync`` changed its ABI between CUDA 12.8 (a ``failIdx`` out-parameter) and
    13.0 (none); ``cuGetProcAddress`` with an explicit version gives the entry point whose
    signature we know, whatever the driver.
Handles are interchangeable with the runtime's (a ``cudaIpcMemHandle_t`` *is* a ``CUipcMemHandle``),
so an engine that exported with torch / cudart is opened here without conversion.

Every call is checked; failures raise :class:`CudaError` with the driver's error name. ctypes
releases the GIL for the duration of each call, so a blocking call (stream synchronize, host
register) in a worker thread never stalls the daemon's event loop.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713

CU_EVENT_BLOCKING_SYNC = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4
CU_STREAM_NON_BLOCKING = 0x1
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_LOCATION_TYPE_HOST = 0x2

IPC_HANDLE_BYTES = 64

CUdeviceptr = ctypes.c_uint64
CUresult = ctypes.c_int
_p = ctypes.c_void_p


class CudaError(RuntimeError):
    """A driver call failed. ``code`` is the CUresult."""

    def __init__(self, code: int, call: str, name: str, text: str):
        super().__init__(f"{call} failed: {name} ({code}): {text}")
        self.code = code
        self.call = call


class CudaUnavailable(RuntimeError):
    """No usable driver (no libcuda, no device, or cuInit failed)."""


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes_v1`` (identical to ``cudaMemcpyAttributes``): 24 bytes."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", ctypes.c_uint)]


# name -> (argtypes); restype is always CUresult
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_p), ctypes.c_int],
    "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
    "cuCtxSetCurrent": [_p],
    "cuCtxGetStreamPriorityRange": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    "cuStreamCreateWithPriority": [ctypes.POINTER(_p), ctypes.c_uint, ctypes.c_int],
    "cuStreamDestroy_v2": [_p],
    "cuStreamSynchronize": [_p],
    "cuStreamWaitEvent": [_p, _p, ctypes.c_uint],
    "cuEventCreate": [ctypes.POINTER(_p), ctypes.c_uint],
    "cuEventRecord": [_p, _p],
    "cuEventQuery": [_p],
    "cuEventDestroy_v2": [_p],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(CUdeviceptr), IpcHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [CUdeviceptr],
    "cuIpcOpenEventHandle": [ctypes.POINTER(_p), IpcHandle],
    "cuMemHostRegister_v2": [_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [_p],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), CUdeviceptr],
    "cuMemcpyAsync": [CUdeviceptr, CUdeviceptr, ctypes.c_size_t, _p],
}
_OPTIONAL = {"cuDeviceGetUuid_v2": [ctypes.POINTER(CUuuid), ctypes.c_int],
             "cuDeviceGetUuid": [ctypes.POINTER(CUuuid), ctypes.c_int],
             "cuGetProcAddress": [ctypes.c_char_p, ctypes.POINTER(_p), ctypes.c_int, ctypes.c_uint64],
             "cuDeviceGetPCIBusId": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]}

# cuMemcpyBatchAsync, 13.0 ABI: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
_BATCH13 = ctypes.CFUNCTYPE(CUresult, _p, _p, _p, ctypes.c_size_t, ctypes.POINTER(MemcpyAttributes), _p,
                            ctypes.c_size_t, _p)
# 12.8 ABI: the same plus size_t* failIdx before the stream
_BATCH128 = ctypes.CFUNCTYPE(CUresult, _p, _p, _p, ctypes.c_size_t, ctypes.POINTER(MemcpyAttributes), _p,
                             ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), _p)


def format_uuid(raw: bytes) -> str:
    """16 raw bytes -> ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi's spelling)."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    uuid: str


class Driver:
    """The loaded library plus checked wrappers. Use :func:`driver` to get the process-wide one."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._fn: dict[str, Any] = {}
        for name, args in _SIGNATURES.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, CUresult
            self._fn[name] = f
        for name, args in _OPTIONAL.items():
            f = getattr(lib, name, None)
            if f is not None:
                f.argtypes, f.restype = args, CUresult
                self._fn[name] = f
        self._name = lib.cuGetErrorName
        self._name.argtypes, self._name.restype = [CUresult, ctypes.POINTER(ctypes.c_char_p)], CUresult
        self._text = lib.cuGetErrorString
        self._text.argtypes, self._text.restype = [CUresult, ctypes.POINTER(ctypes.c_char_p)], CUresult
        self.check("cuInit", 0)
        v = ctypes.c_int()
        self.check("cuDriverGetVersion", ctypes.byref(v))
        self.version = v.value
        self._ctx: dict[int, int] = {}
        self._ctx_lock = threading.Lock()
        self.batch_abi, self._batch = self._load_batch()

    # --- plumbing ---------------------------------------------------------------------------------
    def error(self, code: int, call: str) -> CudaError:
        n, t = ctypes.c_char_p(), ctypes.c_char_p()
        self._name(code, ctypes.byref(n))
        self._text(code, ctypes.byref(t))
        return CudaError(code, call, (n.value or b"?").decode(), (t.value or b"").decode())

    def check(self, name: str, *args: Any) -> None:
        rc = self._fn[name](*args)
        if rc != CUDA_SUCCESS:
            raise self.error(rc, name)

    def _load_batch(self) -> tuple[str, Any]:
        """The batched-copy entry point and its ABI ("13", "12.8" or "" when the driver lacks it).

        Asked for by version through cuGetProcAddress, so the signature is the one we declare even on
        a driver newer than the ABI we ask for; direct symbols are the fallback.
        """
        if self.version < 12080:
            return "", None
        want = 13000 if self.version >= 13000 else 12080
        pfn = _p()
        gpa = self._fn.get("cuGetProcAddress")
        rc = gpa(b"cuMemcpyBatchAsync", ctypes.byref(pfn), want, 0) if gpa is not None else -1
        if rc != CUDA_SUCCESS or not pfn.value:
            sym = "cuMemcpyBatchAsync_v2" if want >= 13000 else "cuMemcpyBatchAsync"
            f = getattr(self.lib, sym, None)
            if f is None:
                return "", None
            pfn = _p(ctypes.cast(f, _p).value)
        if want >= 13000:
            return "13", _BATCH13(pfn.value)
        return "12.8", _BATCH128(pfn.value)

    # --- devices and contexts ------------------------------------------------------------------------
    def device_count(self) -> int:
        n = ctypes.c_int()
        self.check("cuDeviceGetCount", ctypes.byref(n))
        return n.value

    def device_uuid(self, ordinal: int) -> str:
        dev = ctypes.c_int()
        self.check("cuDeviceGet", ctypes.byref(dev), ordinal)
        u = CUuuid()
        name = "cuDeviceGetUuid_v2" if "cuDeviceGetUuid_v2" in self._fn else "cuDeviceGetUuid"
        self.check(name, ctypes.byref(u), dev.value)
        return format_uuid(bytes(u.bytes))

    def pci_bus_id(self, ordinal: int) -> str:
        """The GPU's PCI bus id (``0000:19:00.0``: how sysfs names its NUMA node); "" where the driver
        does not say."""
        if "cuDeviceGetPCIBusId" not in self._fn:
            return ""
        dev = ctypes.c_int()
        self.check("cuDeviceGet", ctypes.byref(dev), ordinal)
        buf = ctypes.create_string_buffer(32)
        self.check("cuDeviceGetPCIBusId", buf, len(buf), dev.value)
        return buf.value.decode()

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(i, self.device_uuid(i)) for i in range(self.device_count())]

    def ordinal_of(self, uuid: str) -> int:
        """The ordinal (in *this* process's CUDA_VISIBLE_DEVICES numbering) of the GPU with ``uuid``."""
        want = uuid.strip().lower()
        if not want.startswith("gpu-"):
            want = "gpu-" + want
        for d in self.devices():
            if d.uuid.lower() == want:
                return d.ordinal
        raise LookupError(f"no visible GPU has UUID {uuid} (visible: {[d.uuid for d in self.devices()]})")

    def use_device(self, ordinal: int) -> None:
        """Make the device's primary context current in the calling thread (retained once per process)."""
        ctx = self._ctx.get(ordinal)
        if ctx is None:
            with self._ctx_lock:
                ctx = self._ctx.get(ordinal)
                if ctx is None:
                    dev = ctypes.c_int()
                    self.check("cuDeviceGet", ctypes.byref(dev), ordinal)
                    c = _p()
                    self.check("cuDevicePrimaryCtxRetain", ctypes.byref(c), dev.value)
                    ctx = self._ctx[ordinal] = c.value
        self.check("cuCtxSetCurrent", ctx)

    # --- streams and events -----------------------------------------------------------------------
    def stream_priority_range(self) -> tuple[int, int]:
        """(least, greatest) priority; greatest is numerically lowest (most urgent)."""
        lo, hi = ctypes.c_int(), ctypes.c_int()
        self.check("cuCtxGetStreamPriorityRange", ctypes.byref(lo), ctypes.byref(hi))
        return lo.value, hi.value

    def stream_create(self, priority: int = 0) -> int:
        s = _p()
        self.check("cuStreamCreateWithPriority", ctypes.byref(s), CU_STREAM_NON_BLOCKING, priority)
        return s.value

    def stream_destroy(self, stream: int) -> None:
        self.check("cuStreamDestroy_v2", stream)

    def stream_synchronize(self, stream: int) -> None:
        self.check("cuStreamSynchronize", stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.check("cuStreamWaitEvent", stream, event, 0)

    def event_create(self, flags: int = CU_EVENT_DISABLE_TIMING) -> int:
        e = _p()
        self.check("cuEventCreate", ctypes.byref(e), flags)
        return e.value

    def event_record(self, event: int, stream: int) -> None:
        self.check("cuEventRecord", event, stream)

    def event_query(self, event: int) -> bool:
        rc = self._fn["cuEventQuery"](event)
        if rc == CUDA_SUCCESS:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        raise self.error(rc, "cuEventQuery")

    def event_destroy(self, event: int) -> None:
        self.check("cuEventDestroy_v2", event)

    # --- IPC ------------------------------------------------------------------------------------------
    def ipc_open_mem_handle(self, handle: bytes) -> int:
        """Map another process's allocation; returns the base address of the *whole* allocation."""
        h = _handle(handle)
        p = CUdeviceptr()
        self.check("cuIpcOpenMemHandle_v2", ctypes.byref(p), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return p.value

    def ipc_close_mem_handle(self, ptr: int) -> None:
        self.check("cuIpcCloseMemHandle", ptr)

    def ipc_open_event_handle(self, handle: bytes) -> int:
        e = _p()
        self.check("cuIpcOpenEventHandle", ctypes.byref(e), _handle(handle))
        return e.value

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding device pointer ``ptr``."""
        base, size = CUdeviceptr(), ctypes.c_size_t()
        self.check("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
        return base.value, size.value

    # --- host memory ---------------------------------------------------------------------------------
    def host_register(self, addr: int, nbytes: int, flags: int = CU_MEMHOSTREGISTER_PORTABLE) -> None:
        self.check("cuMemHostRegister_v2", addr, nbytes, flags)

    def host_unregister(self, addr: int) -> None:
        self.check("cuMemHostUnregister", addr)

    # --- copies ---------------------------------------------------------------------------------------
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check("cuMemcpyAsync", dst, src, nbytes, stream)

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy_batch_async(self, dsts: int, srcs: int, sizes: int, count: int, attrs: MemcpyAttributes,
                           stream: int) -> None:
        """One batched DMA of ``count`` copies; dsts/srcs/sizes are addresses of uint64 arrays.

        The arrays are read during the call only (the caller may free them once it returns).
        """
        idx = ctypes.c_size_t(0)
        if self.batch_abi == "13":
            rc = self._batch(dsts, srcs, sizes, count, ctypes.byref(attrs), ctypes.addressof(idx), 1, stream)
        else:
            fail = ctypes.c_size_t(0)
            rc = self._batch(dsts, srcs, sizes, count, ctypes.byref(attrs), ctypes.addressof(idx), 1,
                             ctypes.byref(fail), stream)
        if rc != CUDA_SUCCESS:
            raise self.error(rc, "cuMemcpyBatchAsync")


def _handle(raw: bytes) -> IpcHandle:
    if type(raw) is not bytes or len(raw) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes")
    h = IpcHandle()
    ctypes.memmove(ctypes.addressof(h), raw, IPC_HANDLE_BYTES)
    return h


def copy_attributes(device: int, store: bool) -> MemcpyAttributes:
    """Attributes for one batch: source read in stream order (after the waited event), copy engines."""
    dev, host = MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device), MemLocation(CU_MEM_LOCATION_TYPE_HOST, 0)
    src, dst = (dev, host) if store else (host, dev)
    return MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, src, dst, CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)


_driver: Driver | None = None
_driver_error: str | None = None
_lock = threading.Lock()


def driver() -> Driver:
    """The process-wide driver binding (loaded and cuInit'ed on first use). Raises CudaUnavailable."""
    global _driver, _driver_error
    if _driver is not None:
        return _driver
    with _lock:
        if _driver is None:
            if _driver_error is not None:
                raise CudaUnavailable(_driver_error)
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                _driver = Driver(lib)
            except (OSError, AttributeError, CudaError) as e:
                _driver_error = f"CUDA driver unusable: {e}"
                raise CudaUnavailable(_driver_error) from None
    return _driver


def available() -> bool:
    """True when the driver loads and at least one GPU is visible (cheap after the first call)."""
    try:
        return driver().device_count() > 0
    except (CudaUnavailable, CudaError):
        return False
