"""Engine KV memory made with CUDA's virtual memory API, imported from POSIX descriptors and mapped into
one VA range of the daemon, so the rest of the CUDA backend sees one contiguous device region.

Why this exists: ``cuMemCreate`` memory (PyTorch's ``expandable_segments:True``, vLLM's CuMem allocator
for sleep mode) has no legacy IPC handle, so ``cuIpcGetMemHandle`` fails on it. Each physical piece is
exported by the engine as a POSIX descriptor (``cuMemExportToShareableHandle``) and handed over the fd
socket (SCM_RIGHTS); here each descriptor is imported (``cuMemImportFromShareableHandle``) and closed at
once (the imported handle keeps the memory alive, so the daemon holds no descriptor per engine), one VA
range is reserved (``cuMemAddressReserve``), every piece mapped at its offset (``cuMemMap``) and made
readable and writable by the device (``cuMemSetAccess``). :func:`unmap` undoes all of it.

The bindings live here rather than in ``cuda_driver`` (which keeps the calls every engine needs) because
they are optional: a driver without them still serves ``cuda_ipc``. Layouts follow ``cuda.h`` (12.x/13.x).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Any

from kvoffd.transfer import cuda_driver as cudart
from kvoffd_client import protocol as P

log = logging.getLogger(__name__)

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0

CUmemGenericAllocationHandle = ctypes.c_ulonglong


class MemLocation(ctypes.Structure):
    """``CUmemLocation``: {CUmemLocationType type; int id;} (8 bytes)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    """``CUmemAllocationProp::allocFlags`` (8 bytes)."""

    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` (32 bytes: type, requestedHandleTypes, location, win32HandleMetaData, allocFlags)."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``: {CUmemLocation location; CUmemAccess_flags flags;} (12 bytes)."""

    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


assert ctypes.sizeof(AllocationProp) == 32 and ctypes.sizeof(AccessDesc) == 12

_H = CUmemGenericAllocationHandle
_P = ctypes.c_void_p
SIGNATURES: dict[str, list[Any]] = {
    "cuMemCreate": [ctypes.POINTER(_H), ctypes.c_size_t, ctypes.POINTER(AllocationProp), ctypes.c_ulonglong],
    "cuMemRelease": [_H],
    "cuMemAddressReserve": [ctypes.POINTER(cudart.CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t,
                            cudart.CUdeviceptr, ctypes.c_ulonglong],
    "cuMemAddressFree": [cudart.CUdeviceptr, ctypes.c_size_t],
    "cuMemMap": [cudart.CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, _H, ctypes.c_ulonglong],
    "cuMemUnmap": [cudart.CUdeviceptr, ctypes.c_size_t],
    "cuMemSetAccess": [cudart.CUdeviceptr, ctypes.c_size_t, ctypes.POINTER(AccessDesc), ctypes.c_size_t],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_H), _P, ctypes.c_int],
    "cuMemRetainAllocationHandle": [ctypes.POINTER(_H), _P],
    "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(AllocationProp), _H],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(AllocationProp), ctypes.c_int],
}


class Vmm:
    """Checked wrappers of the VMM calls, on the process-wide :class:`cuda_driver.Driver`."""

    def __init__(self, drv: cudart.Driver):
        self.drv = drv
        self._fn: dict[str, Any] = {}
        for name, args in SIGNATURES.items():
            f = getattr(drv.lib, name, None)
            if f is None:
                raise cudart.CudaUnavailable(f"the CUDA driver lacks {name} (virtual memory management)")
            f.argtypes, f.restype = args, cudart.CUresult
            self._fn[name] = f

    def _check(self, name: str, *args: Any) -> None:
        rc = self._fn[name](*args)
        if rc != cudart.CUDA_SUCCESS:
            raise self.drv.error(rc, name)

    def create(self, size: int, ordinal: int, handle_types: int = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) -> int:
        prop = AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED, requestedHandleTypes=handle_types,
                              location=MemLocation(cudart.CU_MEM_LOCATION_TYPE_DEVICE, ordinal))
        h = _H()
        self._check("cuMemCreate", ctypes.byref(h), size, ctypes.byref(prop), 0)
        return h.value

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", handle)

    def granularity(self, ordinal: int) -> int:
        prop = AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                              location=MemLocation(cudart.CU_MEM_LOCATION_TYPE_DEVICE, ordinal))
        g = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop),
                    CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return g.value

    def reserve(self, size: int, alignment: int) -> int:
        p = cudart.CUdeviceptr()
        self._check("cuMemAddressReserve", ctypes.byref(p), size, alignment, 0, 0)
        return p.value

    def address_free(self, va: int, size: int) -> None:
        self._check("cuMemAddressFree", va, size)

    def map(self, va: int, size: int, handle: int) -> None:
        self._check("cuMemMap", va, size, 0, handle, 0)

    def unmap(self, va: int, size: int) -> None:
        self._check("cuMemUnmap", va, size)

    def set_access(self, va: int, size: int, ordinal: int) -> None:
        desc = AccessDesc(MemLocation(cudart.CU_MEM_LOCATION_TYPE_DEVICE, ordinal), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._check("cuMemSetAccess", va, size, ctypes.byref(desc), 1)

    def import_fd(self, fd: int) -> int:
        """The POSIX handle type passes the descriptor itself as the ``void*`` argument (cuda.h)."""
        h = _H()
        self._check("cuMemImportFromShareableHandle", ctypes.byref(h), ctypes.c_void_p(fd),
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return h.value


@dataclass
class VmmRange:
    """One engine's pieces as mapped here: the VA reservation and the imported handles, in order."""

    va: int
    reserved: int  # bytes reserved (the pieces' total)
    pieces: list[tuple[int, int, int]]  # (offset, size, imported handle)


def map_pieces(vmm: Vmm, ordinal: int, fds: list[int], pieces: list[P.VmmPiece]) -> VmmRange:
    """Import, reserve, map, set access; on any failure undo what was done and raise.

    Built for thousands of pieces (an expandable-segments KV cache is one 20 MiB piece per segment): one
    import and one map per piece, but one VA reservation and one ``cuMemSetAccess`` over the whole range.
    Each descriptor is closed as soon as it is imported (the imported handle keeps the memory alive), so
    the daemon never holds a second copy of the batch; every descriptor in ``fds`` (descriptor i backs
    piece i) is closed before this returns, whatever happens (marked -1 in ``fds`` once closed).
    """
    handles: list[tuple[int, int, int]] = []
    rng: VmmRange | None = None
    try:
        for i, p in enumerate(pieces):
            handles.append((p.offset, p.size, vmm.import_fd(fds[i])))
            _close(fds, i)
        total = sum(size for _, size, _ in handles)
        gran = vmm.granularity(ordinal)
        if any(off % gran or size % gran for off, size, _ in handles):
            raise cudart.CudaError(1, "map_pieces", "CUDA_ERROR_INVALID_VALUE",
                                   f"piece offsets and sizes must be multiples of the {gran}-byte granularity")
        rng = VmmRange(va=vmm.reserve(total, gran), reserved=total, pieces=[])
        for off, size, h in handles:
            vmm.map(rng.va + off, size, h)
            rng.pieces.append((off, size, h))
        vmm.set_access(rng.va, total, ordinal)
        return rng
    except BaseException:
        mapped = {h for _, _, h in rng.pieces} if rng is not None else set()
        if rng is not None:
            unmap(vmm, rng)  # unmaps and releases the mapped pieces, frees the VA
        for _, _, h in handles:
            if h not in mapped:
                _quiet(vmm.release, h)
        raise
    finally:
        for i in range(len(fds)):
            _close(fds, i)


def _close(fds: list[int], i: int) -> None:
    """Close ``fds[i]`` once (marked -1: the number may be reused by another thread at once)."""
    fd, fds[i] = fds[i], -1
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def unmap(vmm: Vmm, rng: VmmRange) -> None:
    """Unmap every piece, release its handle (the memory is freed once the engine released its own), free
    the VA. Errors are logged: detach must finish."""
    for off, size, h in rng.pieces:
        _quiet(vmm.unmap, rng.va + off, size)
        _quiet(vmm.release, h)
    rng.pieces = []
    if rng.reserved:
        _quiet(vmm.address_free, rng.va, rng.reserved)
        rng.reserved = 0


def _quiet(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except cudart.CudaError as e:
        log.warning("%s%r: %s", getattr(fn, "__name__", fn), args, e)
