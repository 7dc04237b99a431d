"""Connector side of VMM memory (kind ``cuda_vmm``): KV tensors allocated with ``cuMemCreate``.

PyTorch's ``expandable_segments:True`` and vLLM's CuMem allocator (sleep mode) map physical allocations
into a reserved VA range; such memory has no legacy IPC handle. Instead each physical allocation behind
the KV region is found (``cuMemGetAddressRange`` gives the mapped piece holding an address,
``cuMemRetainAllocationHandle`` its handle) and exported as a POSIX descriptor
(``cuMemExportToShareableHandle``). The descriptors go to the daemon's fd socket (SCM_RIGHTS, as for
``cpu_fd``: ``kvoffd_client.fdpass.wire_memory``); the daemon maps the pieces at the same offsets in one
VA range of its own.

Export works only for allocations created with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` among their
requested handle types; :class:`VmmNotExportable` says so in one sentence (the worker logs it once and
serves without offload). The descriptors keep the physical memory alive: :meth:`LocalMemory.close` them
before the engine frees its KV cache (sleep), or the memory is not given back.
"""

from __future__ import annotations

import ctypes
import os

from kvoffd_client import protocol as P
from kvoffd_client.memory.local import LocalMemory

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CUDA_SUCCESS = 0
MAX_PIECES = 16384  # = kvoffd_client.protocol.MAX_VMM_PIECES (checked in tests)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):
    """``CUmemAllocationProp`` (cuda.h): 32 bytes."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class VmmNotExportable(RuntimeError):
    """The KV memory is VMM memory whose allocations cannot be exported as POSIX descriptors."""


_cuda: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _cuda
    if _cuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, h = ctypes.c_uint64, ctypes.c_ulonglong
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
        lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(h), ctypes.c_void_p]
        lib.cuMemGetAllocationPropertiesFromHandle.argtypes = [ctypes.POINTER(_Prop), h]
        lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, h, ctypes.c_int, ctypes.c_ulonglong]
        lib.cuMemRelease.argtypes = [h]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in (lib.cuMemGetAddressRange_v2, lib.cuMemRetainAllocationHandle, lib.cuMemRelease,
                  lib.cuMemGetAllocationPropertiesFromHandle, lib.cuMemExportToShareableHandle, lib.cuGetErrorName):
            f.restype = ctypes.c_int
        _cuda = lib
    return _cuda


def _check(rc: int, what: str) -> None:
    if rc != CUDA_SUCCESS:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")


def is_vmm(ptr: int) -> bool:
    """Whether device pointer ``ptr`` lies in memory mapped with cuMemMap (a handle can be retained)."""
    lib = _lib()
    h = ctypes.c_ulonglong()
    if lib.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(ptr)) != CUDA_SUCCESS:
        return False
    _check(lib.cuMemRelease(h), "cuMemRelease")
    return True


def _export_piece(addr: int) -> int:
    """One POSIX descriptor for the physical allocation mapped at ``addr``; the retained handle is
    released whatever happens (the engine keeps its own)."""
    lib = _lib()
    h = ctypes.c_ulonglong()
    _check(lib.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(addr)), "cuMemRetainAllocationHandle")
    try:
        prop = _Prop()
        _check(lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), h),
               "cuMemGetAllocationPropertiesFromHandle")
        if not prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            raise VmmNotExportable(
                f"the KV cache is VMM memory (cuMemCreate) created without the POSIX-descriptor handle type "
                f"(requested types {prop.requestedHandleTypes:#x}), so it cannot be shared with kvoffd; with "
                "PyTorch's expandable segments set TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=1 and no fabric handles "
                "(docs/cuda.md)")
        fd = ctypes.c_int(-1)
        _check(lib.cuMemExportToShareableHandle(ctypes.byref(fd), h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               "cuMemExportToShareableHandle")
        return fd.value
    finally:
        lib.cuMemRelease(h)


def _range(addr: int) -> tuple[int, int]:
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), addr), "cuMemGetAddressRange")
    return base.value, size.value


#: descriptors an engine process keeps free for everything else while it holds its exported pieces
NOFILE_SPARE = 256
_NOFILE_STEP = 64  # pieces exported between two looks at the limit


def _room_for_more(held: int) -> None:
    """Raise this process's soft RLIMIT_NOFILE (never past the hard one) before the next
    ``_NOFILE_STEP`` exported pieces would leave fewer than NOFILE_SPARE descriptors: a KV cache of
    thousands of pieces holds one descriptor each, and a worker's soft limit is often 1024. Refuses in
    one sentence when the hard limit is the bound."""
    if held % _NOFILE_STEP:
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(os.listdir("/proc/self/fd")) + _NOFILE_STEP + NOFILE_SPARE
    if need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise VmmNotExportable(f"exporting the KV cache's pieces needs more than {hard} file descriptors, this "
                               "process's hard RLIMIT_NOFILE: raise it (one descriptor per 20 MiB piece)")
    target = max(need, 2 * soft) if hard == resource.RLIM_INFINITY else min(hard, max(need, 2 * soft))
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def export_region(ptr: int, nbytes: int, *, device_uuid: str, events: list[bytes]) -> LocalMemory:
    """Describe the VMM region ``[ptr, +nbytes)``: its pieces from the first one's base, in order, each
    exported as the descriptor at its position in ``fds`` (``close`` them before the engine frees the
    memory, e.g. on sleep, or it is not given back).

    Raises VmmNotExportable (not exportable, or more pieces than the protocol allows) or RuntimeError.
    """
    first, _ = _range(ptr)
    pieces: list[P.VmmPiece] = []
    fds: list[int] = []
    addr, end = first, ptr + nbytes
    try:
        while addr < end:
            base, size = _range(addr)
            if base != addr or size <= 0:
                raise RuntimeError(f"VMM region not tiled by its mappings at {addr:#x} (piece at {base:#x})")
            if len(pieces) == MAX_PIECES:
                raise VmmNotExportable(f"the KV cache spans more than {MAX_PIECES} physical allocations; "
                                       f"kvoffd maps at most {MAX_PIECES} per engine (docs/cuda.md)")
            _room_for_more(len(fds))
            fds.append(_export_piece(addr))
            pieces.append(P.VmmPiece(offset=addr - first, size=size))
            addr += size
    except BaseException:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    spec = P.CudaVmm(token="", pieces=pieces, offset=ptr - first, size=nbytes, device_uuid=device_uuid, events=events)
    return LocalMemory(spec, fds)
