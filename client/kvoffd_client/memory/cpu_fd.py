"""CPU engines share their KV memory as a sealed anonymous memfd (the ``cpu_fd`` memory kind).

The engine's KV allocation is moved, in place, into a sealed memfd whose descriptor the client hands
to the daemon (kvoffd_client.fdpass); every view vLLM's layers hold is re-pointed, and proven to be
the only users of the old allocation. Where each block sits is described by
``kvoffd_client.memory.layout``; CUDA engines share theirs through ``kvoffd_client.memory.cuda_ipc``.

torch is imported lazily: this module is imported by the connector in vLLM's API server too.
"""

from __future__ import annotations

import fcntl
import os
from typing import TYPE_CHECKING, Any

from kvoffd_client import protocol as P
from kvoffd_client.memory.layout import storage_of
from kvoffd_client.memory.local import LocalMemory

if TYPE_CHECKING:
    import torch

MEMFD_PREFIX = "kvoffd-"
#: a shrink would fault whoever maps the memory; growing or unsealing it again serves nothing
MEMFD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create_sealed_memfd(nbytes: int, tag: str = "") -> int:
    """An anonymous shared memory file of ``nbytes``, sealed so that its size can never change.

    Anonymous: no name in any filesystem, so nothing is left behind when the engine dies and no
    other process can open it; the memory is freed once the last descriptor and mapping are gone.
    It is not in /dev/shm either, so a container's 64 MiB /dev/shm does not bound it.
    """
    fd = os.memfd_create(f"{MEMFD_PREFIX}{(tag or 'kv')[:40]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def share_cpu_kv_caches(kv_caches: dict[str, torch.Tensor], tag: str = "",
                        holders: Any = None) -> LocalMemory:
    """Move the CPU KV allocation into a sealed memfd, in place, and return REGISTER's ``memory``.

    Every tensor in ``kv_caches`` is re-pointed (``Tensor.set_``) at the same bytes in the memfd, so
    the engine keeps using the very tensor objects it bound to its attention layers and the daemon
    maps the memfd: no copy per transfer, and none at registration beyond this one move.

    The result, ``P.CpuFd`` (its token empty) with the memfd's descriptor beside it, is what
    KvoffdClient.register takes: it hands the descriptor to the daemon's fd socket at every
    registration and sends the token it gets back in the Struct. Keep the descriptor open while the engine may register again
    (after a daemon restart); ``release_cpu_kv_caches`` closes it.
    """
    import torch

    storage, _ = storage_of(kv_caches)
    if storage.device.type != "cpu":
        raise ValueError("share_cpu_kv_caches is for CPU tensors; use kvoffd_client.memory.cuda_ipc on GPUs")
    nbytes = storage.nbytes()
    fd = create_sealed_memfd(nbytes, tag.replace("/", "_"))
    try:
        # torch maps a path; /proc/self/fd/N opens this very memfd (the seals hold for every opener)
        shared = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
        shared.copy_(storage)
    except BaseException:
        os.close(fd)
        raise
    moved = _repoint(list(kv_caches.values()) + _views_held_by(holders or (), storage), storage, shared)
    if holders is not None:
        # The proof that the engine computes in the bytes the daemon copies: once every view we know
        # of is moved, nothing else in the process may still reference the old allocation. ``storage``
        # (this frame's handle) is the one reference left.
        left = torch._C._storage_Use_Count(storage._cdata) - 1
        if left:
            _repoint(moved, shared, storage)  # back where they were: vLLM keeps working, without offload
            del shared
            os.close(fd)
            raise StaleViewError(
                f"{left} tensor(s) outside the registered KV views still use the KV allocation (a layer "
                "keeps a view of its own), so the bytes the daemon would copy are not the bytes the model "
                "reads and writes")
    return LocalMemory(P.CpuFd(token="", size=nbytes), [fd])


class StaleViewError(ValueError):
    """Moving the KV allocation would leave the engine computing in memory the daemon never sees."""


def _views_held_by(holders: Any, storage: Any) -> list[torch.Tensor]:
    """Tensors viewing ``storage`` that the attention layers (and their backend impls) hold directly.

    vLLM's ``bind_kv_cache`` lets a layer keep a view derived from the registered tensor (MLA squeezes
    the head dim, Mamba splits conv/SSM state, kernel-block splitting reshapes); those views must move
    with the allocation.
    """
    import torch

    base = storage.data_ptr()
    found: dict[int, torch.Tensor] = {}
    for holder in holders:
        for obj in (holder, getattr(holder, "impl", None)):
            for v in (vars(obj).values() if obj is not None and hasattr(obj, "__dict__") else ()):
                for t in (v if isinstance(v, (list, tuple)) else (v,)):
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() == base:
                        found[id(t)] = t
    return list(found.values())


def _repoint(tensors: list[torch.Tensor], old: Any, new: Any) -> list[torch.Tensor]:
    """``set_`` every tensor viewing ``old`` onto ``new`` at the same offset, size and strides."""
    moved = []
    base = old.data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() == base:
            t.set_(new, t.storage_offset(), t.size(), t.stride())
            moved.append(t)
    return moved


def release_cpu_kv_caches(memory: LocalMemory) -> None:
    """Close the memfd's descriptor (the memory lives on while the tensors, or the daemon, map it)."""
    memory.close()
